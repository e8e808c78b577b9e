#!/usr/bin/env bash
# How close kvchat's and llama.cpp's next-token distributions each come to the exact ones, per
# GGUF file: the exact run is kvchat's with every matrix dequantized to f32 and an f32 cache
# (`--dtype f32 --kv-type f32`: no activation rounding), saved as a logits file; kvchat (its
# defaults) and llama-perplexity (its defaults, --no-repack) are each compared with it through the
# same file (KL divergence, same top token), and with each other (ln PPL ratio with its per-token
# and per-chunk standard errors, scripts/kld-chunks.py). Perplexity alone cannot tell a kernel error
# from rounding noise on 1- and 2-bit files; a divergence from the exact distributions can.
#   scripts/kld-vs-llamacpp.sh [CTX=512] FILE.gguf...
# Text: TEXT=FILE (default assets/gpl-3.txt). Logits files (≈ 100 KB per scored token with a 49k
# vocabulary) go to a temporary directory, removed per model; WORK=DIR keeps them there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ctx=512
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then ctx="$1"; shift; fi
[ $# -gt 0 ] || { echo "usage: $0 [CTX] FILE.gguf..." >&2; exit 2; }
text="${TEXT:-$root/assets/gpl-3.txt}"
[ -f "$text" ] || { echo "TEXT='$text' is not a file" >&2; exit 2; }
perplexity="$("$root/scripts/llamacpp.sh" llama-perplexity)/llama-perplexity"
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
kvchat="$root/target/release/kvchat"
keep="${WORK:-}"
work="${WORK:-$(mktemp -d)}"
mkdir -p "$work"
[ -n "$keep" ] || trap 'rm -rf "$work"' EXIT

# kvchat's JSON figure $2 (a jq-like path of two keys) from the JSON in $1.
field() { python3 -c "import json,sys; j=json.loads(sys.argv[1]); print(j[sys.argv[2]][sys.argv[3]] if len(sys.argv)>3 else j[sys.argv[2]])" "$@"; }
# llama-perplexity --kl-divergence's figure on the line starting with $2 in log $1.
llama_stat() { sed -n "s/^.*$2 *: *\([-0-9.]*\).*/\1/p" "$1" | head -1; }

printf '%-24s %9s | %9s %9s %7s | %9s %9s %7s | %9s %8s %8s\n' file exact kvchat KLD same% llama.cpp KLD same% 'kv/llama' '±tok' '±chunk'
for f in "$@"; do
  [ -f "$f" ] || { echo "no such model file: $f" >&2; exit 2; }
  name="$(basename "$f" .gguf)"
  x="$work/$name.exact.kld" k="$work/$name.kvchat.kld" l="$work/$name.llama.kld"
  rm -f "$x" "$k" "$l"
  exact="$("$kvchat" ppl -m "$f" --chunk "$ctx" --threads 2 --dtype f32 --kv-type f32 --json --kl-divergence-base "$x" "$text" 2>/dev/null)"
  "$kvchat" ppl -m "$f" --chunk "$ctx" --threads 2 --kl-divergence-base "$k" "$text" >/dev/null 2>&1
  "$perplexity" -m "$f" -f "$text" -c "$ctx" -t 2 --no-repack --kl-divergence-base "$l" > "$work/log" 2>&1 || { tail -3 "$work/log" >&2; exit 1; }
  ours="$("$kvchat" ppl -m "$f" --threads 2 --json --kl-divergence-base "$x" --kl-divergence 2>/dev/null)"
  "$perplexity" -m "$f" -t 2 --no-repack --kl-divergence-base "$x" --kl-divergence > "$work/log" 2>&1 || { tail -3 "$work/log" >&2; exit 1; }
  pair="$(python3 "$root/scripts/kld-chunks.py" kvchat="$k" llama="$l" | tail -1)"
  printf '%-24s %9.4f | %9.4f %9.6f %7.2f | %9.4f %9.6f %7.2f | %9s %8s %8s\n' "$name" \
    "$(field "$exact" ppl)" \
    "$(field "$ours" ppl)" "$(field "$ours" divergence kl_mean)" "$(field "$ours" divergence same_top_pct)" \
    "$(llama_stat "$work/log" 'Mean PPL(Q)')" "$(llama_stat "$work/log" 'Mean    KLD')" "$(sed -n 's/^.*Same top p: *\([0-9.]*\).*/\1/p' "$work/log")" \
    $(echo "$pair" | awk '{print $(NF-2), $(NF-1), $NF}')
  [ -n "$keep" ] || rm -f "$x" "$k" "$l"
done
