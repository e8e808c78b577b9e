#!/usr/bin/env bash
# The safetensors fixture: the tests' SmolLM2 GGUF dequantized to f32 and written in the Hugging Face
# layout (Q/K rows back in HF's rotary order; config.json, tokenizer.json and tokenizer_config.json
# from the GGUF metadata). Then `kvchat run -m OUT_DIR ...` runs it through the safetensors path.
#   scripts/make-hf-fixture.sh [OUT_DIR]   (default: ${KVCHAT_HOME:-~/.cache/kvchat}/fixtures/smollm2-135m-hf)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-models.sh >/dev/null
home="${KVCHAT_HOME:-$HOME/.cache/kvchat}"
out="${1:-$home/fixtures/smollm2-135m-hf}"
cargo run --quiet --release --example gguf_to_hf -- "$home/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$out"
