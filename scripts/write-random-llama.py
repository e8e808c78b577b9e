#!/usr/bin/env python3
"""A random-weight GGUF with Llama-3.2-1B's dims (hidden 2048, 16 layers, 32 heads, 8 KV heads, ffn
8192), F16, with the tokenizer of the GGUF given as SRC: a real model's shape for speed and kernel
checks (scripts/make-test-models.sh, scripts/gpu-check.sh), quantized afterwards by llama-quantize.
    write-random-llama.py SRC.gguf DST.gguf      (needs the gguf and numpy Python packages)
"""
import sys
import numpy as np
import gguf
from gguf_tokenizer import copy_tokenizer

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
copy_tokenizer(r, w)
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
