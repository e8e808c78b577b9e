#!/usr/bin/env python3
"""A random-weight GGUF in Qwen3.5-0.8B's shapes (llama.cpp's `qwen35`: 24 layers of hidden 1024,
every fourth attending — 8 query heads of 256 over 2 KV heads, each head's queries with an output
gate beside them, a quarter of each head rotated (sections 11/11/10) at base 10,000,000 — the
other 18 Gated DeltaNet layers: a 4-tap convolution over 16 key and 16 value heads of 128; FFN
3,584; tied embeddings), with the tokenizer (and so the vocabulary) of the GGUF given as SRC
(Qwen3.5's own has 248,320 entries; SmolLM2's 49,152 make the output matmul smaller, the same
for both tools). Matrices and embeddings Q8_0, vectors and convolution F32. For kvchat's speed
check against llama.cpp (docs/perf-notes.md); names and keys are those of the vendored
llama.cpp's gguf-py and src/models/qwen35.cpp.
    write-random-qwen35.py SRC.gguf DST.gguf [INTERVAL]
INTERVAL (default 4): every INTERVAL-th layer attends; 1 makes every layer attend, the "dense
model of the same size" the hybrid's long-context decode is compared with.
(needs numpy and the vendored gguf-py on PYTHONPATH, for the qwen35 keys)
"""
import sys
import numpy as np
import gguf
from gguf_tokenizer import copy_tokenizer
from gguf_random import Random

src, dst = sys.argv[1], sys.argv[2]
interval = int(sys.argv[3]) if len(sys.argv) > 3 else 4
layers, hidden, heads, kv_heads, hd, ffn = 24, 1024, 8, 2, 256, 3584
conv, k_heads, v_heads, d = 4, 16, 16, 128
channels = 2 * k_heads * d + v_heads * d
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(dst, "qwen35")
w.add_name(f"random Qwen3.5-0.8B-shaped, attention every {interval} (kvchat test model)")
w.add_context_length(262144)
w.add_embedding_length(hidden)
w.add_block_count(layers)
w.add_feed_forward_length(ffn)
w.add_head_count(heads)
w.add_head_count_kv(kv_heads)
w.add_key_length(hd)
w.add_value_length(hd)
w.add_rope_dimension_count(hd // 4)
w.add_rope_dimension_sections([11, 11, 10, 0])
w.add_rope_freq_base(10_000_000.0)
w.add_layer_norm_rms_eps(1e-6)
w.add_full_attention_interval(interval)
w.add_ssm_conv_kernel(conv)
w.add_ssm_inner_size(v_heads * d)
w.add_ssm_state_size(d)
w.add_ssm_time_step_rank(v_heads)
w.add_ssm_group_count(k_heads)
w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
copy_tokenizer(r, w)
vocab = len(r.fields["tokenizer.ggml.tokens"].data)
rnd = Random(35)
rng, normal, q8_0, norm = rnd.rng, rnd.normal, rnd.q8_0, rnd.norm
Q8 = gguf.GGMLQuantizationType.Q8_0





w.add_tensor("token_embd.weight", q8_0(vocab, hidden, 0.02), raw_dtype=Q8)
w.add_tensor("output_norm.weight", norm(hidden))
for i in range(layers):
    p = f"blk.{i}"
    w.add_tensor(f"{p}.attn_norm.weight", norm(hidden))
    w.add_tensor(f"{p}.post_attention_norm.weight", norm(hidden))
    if (i + 1) % interval == 0:
        w.add_tensor(f"{p}.attn_q_norm.weight", norm(hd))
        w.add_tensor(f"{p}.attn_k_norm.weight", norm(hd))
        mats = [("attn_q", 2 * heads * hd, hidden), ("attn_k", kv_heads * hd, hidden),
                ("attn_v", kv_heads * hd, hidden), ("attn_output", hidden, heads * hd)]
    else:
        w.add_tensor(f"{p}.ssm_conv1d.weight", normal((channels, conv), 0.5))
        w.add_tensor(f"{p}.ssm_dt.bias", normal(v_heads, 0.5))
        w.add_tensor(f"{p}.ssm_a", -np.exp(normal(v_heads, 0.5)))
        w.add_tensor(f"{p}.ssm_norm.weight", norm(d))
        mats = [("attn_qkv", channels, hidden), ("attn_gate", v_heads * d, hidden),
                ("ssm_beta", v_heads, hidden), ("ssm_alpha", v_heads, hidden),
                ("ssm_out", hidden, v_heads * d)]
    mats += [("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)]
    for name, rows, cols in mats:
        w.add_tensor(f"{p}.{name}.weight", q8_0(rows, cols, 1 / np.sqrt(cols)), raw_dtype=Q8)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
