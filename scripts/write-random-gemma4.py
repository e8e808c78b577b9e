#!/usr/bin/env python3
"""A random-weight GGUF in Gemma 4 E2B's shapes (llama.cpp's `gemma4`, 35 layers: hidden 1536,
8 query heads and 1 KV head; window layers (4 of every 5, a 512-position window) of head size
256 rotated at base 10,000, global layers of head size 512 rotated "proportionally" (a quarter
of the pairs turn: rope_freqs 1, then 1e30) at base 1,000,000; the last 20 layers sharing the
keys and values of layers 13 and 14, with FFNs twice as wide (12,288 against 6,144); per-layer
token embeddings of 256; logits soft-capped at 30), with the tokenizer (and so the vocabulary) of
the GGUF given as SRC. Matrices and embeddings Q8_0, norms F32. For kvchat's speed check against
llama.cpp (docs/perf-notes.md); names and keys are those of the vendored llama.cpp's gguf-py and
src/models/gemma4.cpp.
    write-random-gemma4.py SRC.gguf DST.gguf [LAYERS] [SHARED]
(needs numpy and the vendored gguf-py on PYTHONPATH, for the gemma4 keys)
"""
import sys
import numpy as np
import gguf
from gguf_tokenizer import copy_tokenizer
from gguf_random import Random

src, dst = sys.argv[1], sys.argv[2]
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 35
shared = int(sys.argv[4]) if len(sys.argv) > 4 else 20
hidden, heads, hd_global, hd_local, ffn, ple, window = 1536, 8, 512, 256, 6144, 256, 512
import os  # smaller pieces for bisecting a difference: HD_GLOBAL, HD_LOCAL, PLE (0: none)
hd_global = int(os.environ.get("HD_GLOBAL", hd_global))
hd_local = int(os.environ.get("HD_LOCAL", hd_local))
ple = int(os.environ.get("PLE", ple))
is_window = [i % 5 != 4 for i in range(layers)]
own = layers - shared
assert own >= 2 and is_window[own - 2] and not is_window[own - 1], "shared layers need a source of each kind"
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(dst, "gemma4")
w.add_name("random Gemma-4-E2B-shaped (kvchat test model)")
w.add_context_length(131072)
w.add_embedding_length(hidden)
w.add_block_count(layers)
ffns = [ffn if i < own else 2 * ffn for i in range(layers)]
w.add_feed_forward_length(ffns)
w.add_head_count(heads)
w.add_head_count_kv(1)
w.add_key_length(hd_global)
w.add_value_length(hd_global)
w.add_key_length_swa(hd_local)
w.add_value_length_swa(hd_local)
w.add_rope_dimension_count(hd_global)
w.add_rope_dimension_count_swa(hd_local)
w.add_rope_freq_base(1_000_000.0)
w.add_rope_freq_base_swa(10_000.0)
w.add_layer_norm_rms_eps(1e-6)
w.add_sliding_window(window)
w.add_sliding_window_pattern(is_window)
w.add_shared_kv_layers(shared)
w.add_embedding_length_per_layer_input(ple)
w.add_final_logit_softcapping(30.0)
w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
copy_tokenizer(r, w)
vocab = len(r.fields["tokenizer.ggml.tokens"].data)
rnd = Random(1)
rng, normal, q8_0, norm = rnd.rng, rnd.normal, rnd.q8_0, rnd.norm
Q8 = gguf.GGMLQuantizationType.Q8_0





w.add_tensor("token_embd.weight", q8_0(vocab, hidden, 0.02), raw_dtype=Q8)
w.add_tensor("output_norm.weight", norm(hidden))
n_rot = hd_global // 4 // 2
w.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (hd_global // 2 - n_rot), dtype=np.float32))
if ple:
    # Entries of 1/√ple, so that the table's rows (× √ple in the model) are of unit size.
    w.add_tensor("per_layer_token_embd.weight", q8_0(vocab, layers * ple, 1 / np.sqrt(ple)), raw_dtype=Q8)
    w.add_tensor("per_layer_model_proj.weight", q8_0(layers * ple, hidden, 1 / np.sqrt(hidden)), raw_dtype=Q8)
    w.add_tensor("per_layer_proj_norm.weight", norm(ple))
for i in range(layers):
    p = f"blk.{i}"
    hd = hd_local if is_window[i] else hd_global
    for n in ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"] + ["post_norm"] * bool(ple):
        w.add_tensor(f"{p}.{n}.weight", norm(hidden))
    # q and k are RMS-normed and scores are not scaled: norm weights of 1.5/hd^¼ keep the scores'
    # spread near 2.25 (weights of 1 make it √hd, so sharp that where a tool rounds K to f16
    # moves the perplexity by percents).
    qk = 1.5 / hd ** 0.25
    w.add_tensor(f"{p}.attn_q_norm.weight", norm(hd) * qk)
    mats = [("attn_q", heads * hd, hidden, 1.5), ("attn_output", hidden, heads * hd, 1.0)]
    if i < own:
        w.add_tensor(f"{p}.attn_k_norm.weight", norm(hd) * qk)
        mats += [("attn_k", hd, hidden, 1.5), ("attn_v", hd, hidden, 1.0)]
    mats += [("ffn_gate", ffns[i], hidden, 1.0), ("ffn_up", ffns[i], hidden, 1.0),
             ("ffn_down", hidden, ffns[i], 1.0)]
    if ple:
        mats += [("inp_gate", ple, hidden, 1.0), ("proj", hidden, ple, 1.0)]
    for name, rows, cols, gain in mats:
        w.add_tensor(f"{p}.{name}.weight", q8_0(rows, cols, gain / np.sqrt(cols)), raw_dtype=Q8)
    w.add_tensor(f"{p}.layer_output_scale.weight", np.array([0.8], dtype=np.float32))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
