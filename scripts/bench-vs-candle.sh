#!/usr/bin/env bash
# Side-by-side speed of kvchat and candle-transformers' quantized_llama on the same GGUF (interleaved
# in one process): decode tok/s at context 128 and 2048, prefill tok/s for 512 tokens; then the peak
# RSS of a 128-token one-shot `kvchat run`.
#   scripts/bench-vs-candle.sh [REPEATS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
repeats="${1:-3}"
export RAYON_NUM_THREADS="${2:-2}"
scripts/fetch-models.sh >&2
model="${KVCHAT_MODEL:-${KVCHAT_HOME:-$HOME/.cache/kvchat}/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
cargo build --release --quiet --features bench-candle --example vs_quantized_llama --bin kvchat
target/release/examples/vs_quantized_llama "$model" "$repeats"
rss_kb=$( { /usr/bin/time -f '%M' target/release/kvchat run -m "$model" --temperature 0 --ignore-eos -n 128 \
  "Tell me about caches" >/dev/null; } 2>&1 | tail -n 1)
echo "peak RSS of 'kvchat run -n 128': $((rss_kb / 1024)) MiB ($rss_kb KiB)"
