#!/usr/bin/env bash
# Speculative decoding's figures (issue 36): plain against drafted decode, alternated, on texts
# whose answer copies (a text to repeat, code to edit) and on one that does not (a story), for each
# cache mode given; the answers must be the same (greedy), and each pair's ratio is printed with
# the guesses kept and tokens a forward.
#
#   scripts/draft-check.sh MODEL [ROUNDS] [THREADS] [DRAFT] [MODE ...]
#
# MODEL: a GGUF file. ROUNDS (3): plain/drafted pairs per cell, alternated. THREADS (2).
# DRAFT (ngram): what --draft gets (ngram, or a draft model's file). MODE: cache flags as one
# word each, e.g. "--kv-type int8" "--kv-window 256 --kv-sinks 4" (default: the default cache).
# Environment: TEXTS ("copy code story"); COPY_N (300) tokens for copy and code, STORY_N (200);
# DRAFT_MAX (16).
#
# The 1B shape with real answers: scripts/widen-smollm2.py writes SmolLM2 into Llama-3.2-1B's
# matrix shapes (pip install gguf numpy):
#   python3 scripts/widen-smollm2.py ~/.cache/kvchat/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/wide.gguf
#   scripts/draft-check.sh /tmp/wide.gguf 3
#   scripts/draft-check.sh /tmp/wide.gguf 2 2 ~/.cache/kvchat/models/SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:?usage: scripts/draft-check.sh MODEL [ROUNDS] [THREADS] [DRAFT] [MODE ...]}"
rounds="${2:-3}"
threads="${3:-2}"
draft="${4:-ngram}"
shift $(($# < 4 ? $# : 4))
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=("")
[ -f "$model" ] || { echo "draft-check: no model file $model" >&2; exit 2; }
bin="$root/target/release/kvchat"
[ -x "$bin" ] || (cd "$root" && cargo build --release -q)
copy_n="${COPY_N:-300}"
story_n="${STORY_N:-200}"
draft_max="${DRAFT_MAX:-16}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

doc="$(head -c 2500 "$root/assets/gpl-3.txt")"
copy="Repeat the following text exactly, word for word:

$doc"
story="Write a long story about a dragon who learns to cook."
code="Rename the function lookup to find_continuation in this Rust code and output the whole code:

$(sed -n '/^pub fn lookup/,/^}/p; /^impl Drafter for Ngram/,/^}/p' "$root/src/session/draft.rs")"
texts="${TEXTS:-copy code story}"

# One run: prints "TOK_S DRAFTED ACCEPTED PER_FORWARD" and leaves the answer in $tmp/$2.
one() {
  local flags="$1" out="$2" prompt="$3" n="$4" extra="$5"
  # shellcheck disable=SC2086
  "$bin" run -m "$model" --threads "$threads" --temperature 0 --no-kv-store --stats -n "$n" \
    $flags $extra "$prompt" >"$tmp/$out" 2>"$tmp/$out.err" ||
    { cat "$tmp/$out.err" >&2; exit 1; }
  local tok_s d
  tok_s="$(sed -n 's/.*decode \([0-9.]*\) tok\/s.*/\1/p' "$tmp/$out.err" | head -1)"
  d="$(sed -n 's/.*draft: \([0-9]*\) tokens drafted, \([0-9]*\) accepted.*; \([0-9.]*\) tokens per decode forward.*/\1 \2 \3/p' "$tmp/$out.err" | head -1)"
  echo "$tok_s ${d:-0 0 1}"
}

median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

echo "model $(basename "$model"), draft $draft (--draft-max $draft_max), $threads threads, $rounds alternated rounds"
printf '%-34s %-6s %16s %16s %7s %8s %9s %5s\n' mode text "plain tok/s" "drafted tok/s" ratio kept "tok/fwd" same
for mode in "${modes[@]}"; do
  for text in $texts; do
    case "$text" in
      copy) prompt="$copy"; n="$copy_n"; extra="" ;;
      code) prompt="$code"; n="$copy_n"; extra="" ;;
      story) prompt="$story"; n="$story_n"; extra="--ignore-eos" ;;
      *) echo "draft-check: unknown text $text (copy, code, story)" >&2; exit 2 ;;
    esac
    : >"$tmp/ratios"; plain_all=""; fast_all=""; same=yes; kept=""; per=""
    for r in $(seq "$rounds"); do
      p="$(one "$mode" plain "$prompt" "$n" "$extra")"
      f="$(one "$mode" fast "$prompt" "$n" "$extra --draft $draft --draft-max $draft_max")"
      cmp -s "$tmp/plain" "$tmp/fast" || same=NO
      read -r pt _ _ _ <<<"$p"
      read -r ft fd fa fp <<<"$f"
      plain_all="$plain_all${plain_all:+/}$pt"; fast_all="$fast_all${fast_all:+/}$ft"
      awk -v a="$ft" -v b="$pt" 'BEGIN {printf "%.4f\n", a / b}' >>"$tmp/ratios"
      kept="$(awk -v a="$fa" -v d="$fd" 'BEGIN {printf "%d%%", d ? 100 * a / d : 0}')"; per="$fp"
    done
    printf '%-34s %-6s %16s %16s %6.2fx %8s %9s %5s\n' "${mode:-default}" "$text" "$plain_all" "$fast_all" \
      "$(median <"$tmp/ratios")" "$kept" "$per" "$same"
  done
done
