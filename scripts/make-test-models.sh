#!/usr/bin/env bash
# Test models for the weight-type kernels (issue 16), made here from what PyPI and llama.cpp's sdist
# give, cached outside the repository in ${KVCHAT_HOME:-~/.cache/kvchat}/test-models/:
#   smollm2-TYPE.gguf   SmolLM2-135M-Instruct requantized from the shipped Q4_1 by llama-quantize
#                       (--allow-requantize) to each TYPE;
#   l1b-TYPE.gguf       a random-weight model with Llama-3.2-1B's dims (hidden 2048, 16 layers, 32
#                       heads, 8 KV heads, ffn 8192; SmolLM2's tokenizer) written as F16 by the gguf
#                       Python package, then quantized to each TYPE, so K-quant kernels meet
#                       256-multiple rows (SmolLM2's 576 makes llama.cpp fall back to Q5_0/Q8_0).
#   scripts/make-test-models.sh [TYPES...]   (default: Q4_0 Q5_0 Q8_0 Q4_K_M Q5_K_M Q6_K)
#   FAMILIES=smollm2 scripts/make-test-models.sh   only the SmolLM2 files (seconds; l1b takes minutes
#                                                  and ~8 GB)
# Prints the directory. Files already there are kept (delete one to remake it).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
home="${KVCHAT_HOME:-$HOME/.cache/kvchat}"
dir="$home/test-models"
types=("$@")
[ ${#types[@]} -gt 0 ] || types=(Q4_0 Q5_0 Q8_0 Q4_K_M Q5_K_M Q6_K)
mkdir -p "$dir"
"$root/scripts/fetch-models.sh" >&2
smol="$home/models/SmolLM2-135M-Instruct.Q4_1.gguf"
quantize="$("$root/scripts/llamacpp.sh" llama-quantize)/llama-quantize"
python3 -c 'import gguf, numpy' 2>/dev/null || python3 -m pip install --quiet 'gguf>=0.10' numpy >&2

families="${FAMILIES:-smollm2 l1b}"
l1b_f16="$dir/l1b-F16.gguf"
if [[ " $families " == *" l1b "* ]] && [ ! -s "$l1b_f16" ]; then
  echo "writing $l1b_f16 (random weights, Llama-3.2-1B dims)" >&2
  python3 - "$smol" "$l1b_f16.part" <<'PY'
import sys
import numpy as np
import gguf

src, dst = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(src)
hidden, layers, heads, kv_heads, ffn = 2048, 16, 32, 8, 8192
w = gguf.GGUFWriter(dst, "llama")
w.add_name("random llama-3.2-1b-shaped (kvchat test model)")
w.add_context_length(8192)
w.add_embedding_length(hidden)
w.add_block_count(layers)
w.add_feed_forward_length(ffn)
w.add_head_count(heads)
w.add_head_count_kv(kv_heads)
w.add_rope_freq_base(500000.0)
w.add_layer_norm_rms_eps(1e-5)
w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
# The tokenizer, copied from SmolLM2's file.
for name, field in r.fields.items():
    if not name.startswith("tokenizer."):
        continue
    v = field.contents()
    t = field.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        w.add_array(name, v)
    elif t == gguf.GGUFValueType.STRING:
        w.add_string(name, v)
    elif t == gguf.GGUFValueType.BOOL:
        w.add_bool(name, v)
    elif t == gguf.GGUFValueType.UINT32:
        w.add_uint32(name, v)
    elif t == gguf.GGUFValueType.INT32:
        w.add_int32(name, v)
    else:
        raise SystemExit(f"unhandled tokenizer field {name} of type {t}")
vocab = len(r.fields["tokenizer.ggml.tokens"].data)
rng = np.random.default_rng(1)
def mat(rows, cols, std=0.02):
    return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)
hd = hidden // heads
w.add_tensor("token_embd.weight", mat(vocab, hidden))
w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
w.add_tensor("output.weight", mat(vocab, hidden))
for i in range(layers):
    p = f"blk.{i}"
    w.add_tensor(f"{p}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor(f"{p}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor(f"{p}.attn_q.weight", mat(heads * hd, hidden))
    w.add_tensor(f"{p}.attn_k.weight", mat(kv_heads * hd, hidden))
    w.add_tensor(f"{p}.attn_v.weight", mat(kv_heads * hd, hidden))
    w.add_tensor(f"{p}.attn_output.weight", mat(hidden, heads * hd))
    w.add_tensor(f"{p}.ffn_gate.weight", mat(ffn, hidden))
    w.add_tensor(f"{p}.ffn_up.weight", mat(ffn, hidden))
    w.add_tensor(f"{p}.ffn_down.weight", mat(hidden, ffn))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
PY
  mv "$l1b_f16.part" "$l1b_f16"
fi

for t in "${types[@]}"; do
  for pair in "smollm2:$smol:--allow-requantize" "l1b:$l1b_f16:"; do
    IFS=: read -r name src flag <<<"$pair"
    [[ " $families " == *" $name "* ]] || continue
    out="$dir/$name-$t.gguf"
    [ -s "$out" ] && continue
    echo "quantizing $out" >&2
    "$quantize" $flag "$src" "$out.part" "$t" 2 > "$dir/$name-$t.log" 2>&1 \
      || { echo "llama-quantize failed; see $dir/$name-$t.log" >&2; exit 1; }
    mv "$out.part" "$out"
  done
done
echo "$dir"
