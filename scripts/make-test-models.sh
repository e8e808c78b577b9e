#!/usr/bin/env bash
# Test models for the weight-type kernels (issue 16), made here from what PyPI and llama.cpp's sdist
# give, cached outside the repository in ${KVCHAT_HOME:-~/.cache/kvchat}/test-models/:
#   smollm2-TYPE.gguf   SmolLM2-135M-Instruct requantized from the shipped Q4_1 by llama-quantize
#                       (--allow-requantize) to each TYPE;
#   l1b-TYPE.gguf       a random-weight model with Llama-3.2-1B's dims (hidden 2048, 16 layers, 32
#                       heads, 8 KV heads, ffn 8192; SmolLM2's tokenizer) written as F16 by the gguf
#                       Python package, then quantized to each TYPE, so K-quant kernels meet
#                       256-multiple rows (SmolLM2's 576 makes llama.cpp fall back to Q5_0/Q8_0).
#   scripts/make-test-models.sh [TYPES...]   (default: Q4_0 Q5_0 Q8_0 Q4_K_M Q5_K_M Q6_K; others
#                                            llama-quantize makes: Q2_K Q3_K_M F16 BF16 …)
#   FAMILIES=smollm2 scripts/make-test-models.sh   only the SmolLM2 files (seconds; l1b takes minutes
#                                                  and ~8 GB)
# The 1- to 3-bit i-quants (IQ1_*, IQ2_*, IQ3_*: their mixes use IQ2 types) need an importance
# matrix: NAME.imatrix is made once per family by llama-imatrix over assets/bench-text.txt
# (--no-repack: llama.cpp's repacked kernels crash on some CPUs) and given to llama-quantize.
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
bin="$("$root/scripts/llamacpp.sh" llama-quantize llama-imatrix)"
quantize="$bin/llama-quantize"
python3 -c 'import gguf, numpy' 2>/dev/null || python3 -m pip install --quiet 'gguf>=0.10' numpy >&2

families="${FAMILIES:-smollm2 l1b}"
l1b_f16="$dir/l1b-F16.gguf"
if [[ " $families " == *" l1b "* ]] && [ ! -s "$l1b_f16" ]; then
  echo "writing $l1b_f16 (random weights, Llama-3.2-1B dims)" >&2
  python3 "$root/scripts/write-random-llama.py" "$smol" "$l1b_f16.part"
  mv "$l1b_f16.part" "$l1b_f16"
fi

for t in "${types[@]}"; do
  for pair in "smollm2:$smol:--allow-requantize" "l1b:$l1b_f16:"; do
    IFS=: read -r name src flag <<<"$pair"
    [[ " $families " == *" $name "* ]] || continue
    out="$dir/$name-$t.gguf"
    [ -s "$out" ] && continue
    echo "quantizing $out" >&2
    imatrix=()
    if [[ "$t" == IQ1_* || "$t" == IQ2_* || "$t" == IQ3_* ]]; then
      im="$dir/$name.imatrix"
      if [ ! -s "$im" ]; then
        echo "making $im (llama-imatrix)" >&2
        "$bin/llama-imatrix" -m "$src" -f "$root/assets/bench-text.txt" -o "$im.part" -t 2 -c 512 -nr \
          > "$dir/$name-imatrix.log" 2>&1 || { echo "llama-imatrix failed; see $dir/$name-imatrix.log" >&2; exit 1; }
        mv "$im.part" "$im"
      fi
      imatrix=(--imatrix "$im")
    fi
    "$quantize" $flag "${imatrix[@]}" "$src" "$out.part" "$t" 2 > "$dir/$name-$t.log" 2>&1 \
      || { echo "llama-quantize failed; see $dir/$name-$t.log" >&2; exit 1; }
    mv "$out.part" "$out"
  done
done
echo "$dir"
