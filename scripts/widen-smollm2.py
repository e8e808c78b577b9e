#!/usr/bin/env python3
"""SmolLM2-135M widened to Llama-3.2-1B's matrix shapes: a model of real speed *and* real answers.

    widen-smollm2.py SRC.gguf DST.gguf [q4_1|q4_0|q8_0]      (needs the gguf and numpy Python packages)

Speed checks need real shapes, and drafting needs a model that really copies (a random-weight
file's guesses are all wrong). This writes SmolLM2's function into Llama-3.2-1B's widths — hidden
2048, 32 query heads and 8 KV heads of 64, FFN 8192 — with SmolLM2's 30 layers (1.9 G parameters),
so its answers are SmolLM2's (up to requantization) while every matmul and every attention head
costs what a 1B model's does:

- every weight is zero-padded: SmolLM2's 576 hidden columns and rows first, its 1536 FFN rows;
- its 9 query heads go where Llama's grouping (4 query heads a KV head) pairs them with the same KV
  head as SmolLM2's (3 a KV head): query head i at 4 (i // 3) + i mod 3; the other heads are zero
  (they attend, uniformly, over zero values);
- RMSNorm averages over 2048 values instead of 576: the norm weights are scaled by sqrt(576/2048)
  and epsilon by 576/2048, which gives SmolLM2's normalised values exactly.

The matrices are requantized from SmolLM2's dequantized weights (the embedding stays q8_0): q4_1 by
default, which gives back the Q4_1 file's blocks (SmolLM2's 576 columns are whole blocks of 32, each
requantized from its own 16 levels); q4_0 changes the model's answers (it ends the copy prompt at
once). Used by scripts/draft-check.sh for issue 36's 1B-shape figures.
"""
import sys
import numpy as np
import gguf
from gguf_tokenizer import copy_tokenizer

src, dst = sys.argv[1], sys.argv[2]
qname = sys.argv[3] if len(sys.argv) > 3 else "q4_1"
qtypes = {
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
if qname not in qtypes:
    raise SystemExit(f"widen-smollm2: type {qname!r} is not one of {', '.join(qtypes)}")
qtype, ftype = qtypes[qname]
r = gguf.GGUFReader(src)


def field(name):
    return r.fields[name].contents()


H0, F0 = field("llama.embedding_length"), field("llama.feed_forward_length")
NH0, NKV0 = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
HD = H0 // NH0
H, F, NH, NKV = 2048, 8192, 32, 8
assert HD == H // NH, "head size must stay"
G0, G = NH0 // NKV0, NH // NKV
assert G0 <= G and NKV0 <= NKV
scale = np.float32(np.sqrt(H0 / H))

w = gguf.GGUFWriter(dst, "llama")
w.add_name("SmolLM2-135M widened to Llama-3.2-1B's matrix shapes (kvchat test model)")
w.add_context_length(field("llama.context_length"))
w.add_embedding_length(H)
w.add_block_count(field("llama.block_count"))
w.add_feed_forward_length(F)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_rope_freq_base(field("llama.rope.freq_base"))
w.add_rope_dimension_count(HD)
w.add_layer_norm_rms_eps(field("llama.attention.layer_norm_rms_epsilon") * H0 / H)
w.add_vocab_size(field("llama.vocab_size"))
w.add_file_type(ftype)
copy_tokenizer(r, w)


def head_rows(n_heads_old, place):
    """Row index in the widened matrix of each row of an old [n_heads_old * HD, ...] matrix."""
    return np.concatenate([place(i) * HD + np.arange(HD) for i in range(n_heads_old)])


q_rows = head_rows(NH0, lambda i: G * (i // G0) + i % G0)
kv_rows = head_rows(NKV0, lambda i: i)


def widen(x, rows_to, cols_to, rows=None, cols=None):
    """x [r, c] placed into zeros [rows_to, cols_to]: row i at rows[i] (or i), column j at cols[j]."""
    out = np.zeros((rows_to, cols_to), dtype=np.float32)
    ri = np.arange(x.shape[0]) if rows is None else rows
    ci = np.arange(x.shape[1]) if cols is None else cols
    out[np.ix_(ri, ci)] = x
    return out


def put(name, x, q):
    if x.ndim == 1:
        w.add_tensor(name, x.astype(np.float32))
        return
    data = gguf.quants.quantize(x, q)
    w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q)


for t in r.tensors:
    x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    n = t.name
    if n.endswith("norm.weight"):
        v = np.zeros(H, dtype=np.float32)
        v[:H0] = x.reshape(-1) * scale
        put(n, v, None)
    elif n == "token_embd.weight":
        put(n, widen(x, x.shape[0], H), gguf.GGMLQuantizationType.Q8_0)
    elif n.endswith("attn_q.weight"):
        put(n, widen(x, NH * HD, H, rows=q_rows), qtype)
    elif n.endswith("attn_k.weight") or n.endswith("attn_v.weight"):
        put(n, widen(x, NKV * HD, H, rows=kv_rows), qtype)
    elif n.endswith("attn_output.weight"):
        put(n, widen(x, H, NH * HD, cols=q_rows), qtype)
    elif n.endswith("ffn_gate.weight") or n.endswith("ffn_up.weight"):
        put(n, widen(x, F, H), qtype)
    elif n.endswith("ffn_down.weight"):
        put(n, widen(x, H, F), qtype)
    else:
        raise SystemExit(f"unexpected tensor {n}")

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"wrote {dst}", file=sys.stderr)
