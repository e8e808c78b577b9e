#!/usr/bin/env python3
"""A random-weight GGUF in gpt-oss-20b's layer shapes (hidden 2880, 64 query heads and 8 KV heads
of 64, 32 experts of 2880 rows with 4 used per token, a 128-position window on every other layer,
learned sinks, biases, YaRN ×32 over 4,096 positions; fewer layers than its 24), with the
tokenizer of the GGUF given as SRC. The experts are MXFP4 as gpt-oss ships them (random nibbles,
scales near 2^-9); attention and output matrices Q8_0, embeddings F16, norms, biases and sinks
F32. For kvchat's checks against llama.cpp (perplexity, speed: docs/perf-notes.md); the
shapes, names and keys are those of the vendored llama.cpp's gguf-py and src/models/openai-moe.cpp.
    write-random-gpt-oss.py SRC.gguf DST.gguf [LAYERS] [HIDDEN] [EXPERTS]
(needs numpy and the vendored gguf-py on PYTHONPATH, for MXFP4 and the gpt-oss keys)
"""
import sys
import numpy as np
import gguf
from gguf_tokenizer import copy_tokenizer
from gguf_random import Random

src, dst = sys.argv[1], sys.argv[2]
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 4
hidden = int(sys.argv[4]) if len(sys.argv) > 4 else 2880
n_expert = int(sys.argv[5]) if len(sys.argv) > 5 else 32
heads, kv_heads, hd, used, ffn, window = 64, 8, 64, 4, hidden, 128
if hidden < 2880:  # a small model for quick checks: fewer heads
    heads, kv_heads = max(2, hidden // 64), max(1, hidden // 256)
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(dst, "gpt-oss")
w.add_name("random gpt-oss-20b-shaped (kvchat test model)")
w.add_context_length(131072)
w.add_embedding_length(hidden)
w.add_block_count(layers)
w.add_feed_forward_length(ffn)
w.add_head_count(heads)
w.add_head_count_kv(kv_heads)
w.add_key_length(hd)
w.add_value_length(hd)
w.add_rope_freq_base(150000.0)
w.add_layer_norm_rms_eps(1e-5)
w.add_expert_count(n_expert)
w.add_expert_used_count(used)
w.add_expert_feed_forward_length(ffn)
w.add_sliding_window(window)
w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
w.add_rope_scaling_factor(32.0)
w.add_rope_scaling_orig_ctx_len(4096)
w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
copy_tokenizer(r, w)
vocab = len(r.fields["tokenizer.ggml.tokens"].data)
rnd = Random(1)
rng, normal, q8_0, norm = rnd.rng, rnd.normal, rnd.q8_0, rnd.norm




def mxfp4(n, rows, cols):
    """n × [rows, cols] of random MXFP4 blocks: e in 118..120 (scales 2^-10..2^-8), random nibbles."""
    blocks = cols // 32
    b = rng.integers(0, 256, size=(n, rows, blocks, 17), dtype=np.uint8)
    b[..., 0] = rng.integers(118, 121, size=(n, rows, blocks), dtype=np.uint8)
    return b.reshape(n, rows, blocks * 17)


Q8, MX = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
w.add_tensor("token_embd.weight", normal((vocab, hidden), 0.02).astype(np.float16))
w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
# Wider than the rest, so that the logits are far from uniform and the perplexity reacts.
w.add_tensor("output.weight", q8_0(vocab, hidden, 0.05), raw_dtype=Q8)
for i in range(layers):
    p = f"blk.{i}"
    w.add_tensor(f"{p}.attn_norm.weight", 1 + normal(hidden, 0.1))
    w.add_tensor(f"{p}.post_attention_norm.weight", 1 + normal(hidden, 0.1))
    for name, rows, cols in [("attn_q", heads * hd, hidden), ("attn_k", kv_heads * hd, hidden),
                             ("attn_v", kv_heads * hd, hidden), ("attn_output", hidden, heads * hd)]:
        # q and k wide enough that the scores are far from flat (so positions and sinks matter).
        std = 1.5 / np.sqrt(cols) if name in ("attn_q", "attn_k") else 0.02
        w.add_tensor(f"{p}.{name}.weight", q8_0(rows, cols, std), raw_dtype=Q8)
        w.add_tensor(f"{p}.{name}.bias", normal(rows, 0.1))
    w.add_tensor(f"{p}.attn_sinks.weight", normal(heads, 1.0))
    w.add_tensor(f"{p}.ffn_gate_inp.weight", normal((n_expert, hidden), 0.02))
    w.add_tensor(f"{p}.ffn_gate_inp.bias", normal(n_expert, 0.1))
    for name, rows, cols in [("gate", ffn, hidden), ("up", ffn, hidden), ("down", hidden, ffn)]:
        w.add_tensor(f"{p}.ffn_{name}_exps.weight", mxfp4(n_expert, rows, cols), raw_dtype=MX)
        w.add_tensor(f"{p}.ffn_{name}_exps.bias", normal((n_expert, rows), 0.1))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
