#!/usr/bin/env bash
# Perplexity of each GGUF by kvchat and by llama.cpp's llama-perplexity, same file, same text, same
# context (issue 16: within 0.5 %).
#   scripts/ppl-vs-llamacpp.sh [CTX=512] FILE.gguf...
# Text: assets/bench-text.txt. llama-perplexity comes from scripts/llamacpp.sh (built once, outside
# the repository); kvchat scores chunks of CTX tokens as llama-perplexity does (second halves).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ctx=512
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then ctx="$1"; shift; fi
[ $# -gt 0 ] || { echo "usage: $0 [CTX] FILE.gguf..." >&2; exit 2; }
text="$root/assets/bench-text.txt"
perplexity="$("$root/scripts/llamacpp.sh" llama-perplexity)/llama-perplexity"
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
kvchat="$root/target/release/kvchat"
printf '%-28s %12s %12s %9s\n' file llama.cpp kvchat diff
for f in "$@"; do
  [ -f "$f" ] || { echo "no such model file: $f" >&2; exit 2; }
  ref="$("$perplexity" -m "$f" -f "$text" -c "$ctx" -t 2 2>&1 | sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p')"
  ours="$("$kvchat" ppl -m "$f" --chunk "$ctx" --threads 2 "$text" 2>/dev/null | sed -n 's/.*ppl \([0-9.]*\).*/\1/p' | tail -1)"
  [ -n "$ref" ] && [ -n "$ours" ] || { echo "$(basename "$f"): no figure (llama.cpp '$ref', kvchat '$ours')" >&2; exit 1; }
  python3 -c "import sys; a,b=float(sys.argv[2]),float(sys.argv[3]); print(f'{sys.argv[1]:28} {a:12.4f} {b:12.4f} {100*(b/a-1):+8.2f}%')" "$(basename "$f")" "$ref" "$ours"
done
