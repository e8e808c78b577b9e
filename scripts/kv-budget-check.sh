#!/usr/bin/env bash
# What a KV budget (--kv-budget, issue 38) buys and costs on the default model, against a window
# of the same bytes and the full cache:
#   1. speed: decode ms/token at a CONTEXT-token prompt for the window and each policy, and
#      prefill tok/s of each policy against the full cache (the scoring's cost), cells
#      alternated round by round (window, budgets, full, window, ...) so drift hits all alike;
#   2. quality: `kvchat ppl --against full` on assets/gpl-3.txt in chunks of 2048 for budgets of 25 %
#      and 50 % (512 and 1024 positions) and the window of equal bytes: ΔPPL, KL divergence, top-1;
#   3. retrieval: `kvchat needle` (2,048 tokens, depths 5–95 %, 3 keys each) with the question in
#      the prompt and in the next turn (--ask-later), budget 512 and the window of equal bytes.
#   4. compaction: a scripted 300-turn chat at --ctx 1024 --on-full compact (the exit status, the
#      turns answered, the compactions said; that the system message stays first is tested in
#      tests/suite/chat.rs).
#   scripts/kv-budget-check.sh [ROUNDS=3] [CONTEXT=2048] [THREADS=2] [PARTS="speed ppl needle compact"]
# Raw outputs: target/kv-budget/. MODEL (a -m value) picks another model for parts 1 and 3.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}"
ctx="${2:-2048}"
threads="${3:-2}"
parts="${4:-speed ppl needle compact}"
out="$root/target/kv-budget"
mkdir -p "$out"
"$root/scripts/fetch-models.sh" >&2
# SmolLM2-135M, the figures' model, unless KVCHAT_MODEL names another (the registry's default is
# the 0.5B Qwen2.5-Coder since issue 61).
export KVCHAT_MODEL="${KVCHAT_MODEL:-$("$root/scripts/fetch-models.sh" | sed -n 's/^model ok: //p')}"
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
kv="$root/target/release/kvchat"
model=(); [ -n "${MODEL:-}" ] && model=(-m "$MODEL")
# The window holds 508 + 4 sinks: the bytes of a budget of 512.
modes="window:508+4 budget:512:snapkv+4 budget:512:tova+4 budget:512:h2o+4 full"

if [[ " $parts " == *" speed "* ]]; then
  for r in $(seq 1 "$rounds"); do
    for m in $modes; do
      "$kv" bench "${model[@]}" --threads "$threads" --modes "$m" --contexts "$ctx" --gen 128 \
        --repeat 1 --warmup 1 --no-summary --json "$out/bench-$m-$r.json" >/dev/null
    done
  done
  python3 - "$out" "$rounds" "$modes" "$ctx" <<'PY'
import json, statistics, sys
out, rounds, modes, ctx = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4]
def cell(m, r):
    return json.load(open(f"{out}/bench-{m}-{r}.json"))["cells"][0]
def med(m, key):
    return [cell(m, r)[key]["median"] for r in range(1, rounds + 1)]
win, full = modes[0], modes[-1]
print(f"context {ctx}, 128 tokens decoded, {rounds} alternated rounds (medians; per-round ratios)")
print(f"{'mode':<22} {'decode ms/tok':>13} {'vs window':>9} {'prefill tok/s':>13} {'vs full':>8} {'KV MiB':>7}")
for m in modes:
    d, p = med(m, "decode_ms_per_token"), med(m, "prefill_tok_s")
    dw = [x / y for x, y in zip(d, med(win, "decode_ms_per_token"))]
    pf = [x / y for x, y in zip(p, med(full, "prefill_tok_s"))]
    kib = cell(m, 1)["kv_bytes"] / 2**20
    print(f"{m:<22} {statistics.median(d):>13.2f} {statistics.median(dw):>9.3f} "
          f"{statistics.median(p):>13.1f} {statistics.median(pf):>8.3f} {kib:>7.1f}"
          f"   ({' '.join(f'{x:.3f}' for x in dw)} | {' '.join(f'{x:.3f}' for x in pf)})")
PY
fi

if [[ " $parts " == *" ppl "* ]]; then
  echo "against the full cache: assets/gpl-3.txt, chunks of 2048 (first half prefilled, second half decoded)"
  for b in 512 1024; do
    for m in "--kv-window $((b - 4))" "--kv-budget $b --kv-evict snapkv" "--kv-budget $b --kv-evict tova" "--kv-budget $b --kv-evict h2o"; do
      read -ra flags <<<"$m"
      name="${m// /_}"
      "$kv" ppl --threads "$threads" "$root/assets/gpl-3.txt" --chunk 2048 "${flags[@]}" --against full \
        --json >"$out/ppl$name.json" 2>"$out/ppl$name.log" || { cat "$out/ppl$name.log"; exit 1; }
      python3 - "$out/ppl$name.json" "$m" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
a, d = j["against"], j["divergence"]
print(f"{sys.argv[2]:<34} ppl {j['ppl']:.4f} ({a['diff_pct']:+.2f} % ± {a['diff_stderr_pct']:.2f} vs full {a['against_ppl']:.4f})"
      f"  KL mean {d['kl_mean']:.5f}  p99 {d['kl_p99']:.4f}  top-1 {d['same_top_pct']:.2f} %")
PY
    done
  done
fi

if [[ " $parts " == *" needle "* ]]; then
  for later in "" "--ask-later"; do
    for m in full "--kv-window 508" "--kv-budget 512 --kv-evict snapkv" "--kv-budget 512 --kv-evict tova" "--kv-budget 512 --kv-evict h2o"; do
      [ "$m" = full ] && flags=() || read -ra flags <<<"$m"
      found=$("$kv" needle "${model[@]}" --threads "$threads" $later "${flags[@]}" 2>&1 | tail -1)
      echo "needle ${later:-(question in the prompt)} | $m: $found"
    done
  done
fi

if [[ " $parts " == *" compact "* ]]; then
  python3 -c '
for i in range(300):
    print(f"Question {i}: tell me one short fact about the number {1000 + i}.")
' >"$out/chat-300.txt"
  start=$(date +%s)
  set +e
  "$kv" chat --threads "$threads" --ctx 1024 --on-full compact --temperature 0 -n 24 --stats \
    --system "You are a terse assistant who always signs as Captain Kv." \
    <"$out/chat-300.txt" >"$out/chat-300.out" 2>"$out/chat-300.err"
  status=$?
  set -e
  echo "300-turn chat at --ctx 1024 --on-full compact: exit $status in $(( $(date +%s) - start )) s;" \
    "$(grep -c '^\[stats\] turn' "$out/chat-300.err") turns answered," \
    "$(grep -c '^(compacted' "$out/chat-300.err") compactions, $(grep -c '^error' "$out/chat-300.err") errors"
  grep '^(compacted' "$out/chat-300.err" | head -3
fi
