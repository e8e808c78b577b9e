#!/usr/bin/env bash
# kvchat against llama.cpp on the same GGUF, side by side, alternating, on this CPU.
#   scripts/bench-vs-llamacpp.sh [ROUNDS=3] [THREADS=2]
#       SmolLM2-135M Q4_1 in detail: prefill of 512 tokens and decode at contexts 128, 512, 2048,
#       4096, kvchat's full and int8 caches against llama-bench's f16 (flash attention) and q8_0.
#   scripts/bench-vs-llamacpp.sh [ROUNDS] [THREADS] FILE.gguf...
#       One row per file (issue 16's table): decode at each context of $CONTEXTS (default 128)
#       and prefill of 512 tokens, kvchat (full cache) ÷ llama.cpp (f16 KV, flash attention),
#       medians over ROUNDS; each round runs every file through both tools in turn.
#       Files from scripts/make-test-models.sh suit it.
# LLAMA_ARGS="…" adds flags to every llama-bench call: "--repack 0" where llama.cpp's repacked
# kernels crash on this CPU (one AMX VM segfaulted on IQ4_NL/IQ4_XS files; the Xeon of
# 2026-12-05 on every quantized file, Q4_K_M included).
# BUSY=N keeps N other processes spinning (`yes > /dev/null`) for the whole run: the "under load"
# case (issue 16: one core of two kept busy, BUSY=1).
# Builds llama.cpp's llama-bench once (scripts/llamacpp.sh: from the sources vendored in the PyPI sdist
# of llama-cpp-python, CPU only, into ${KVCHAT_HOME:-~/.cache/kvchat}/llama.cpp, outside the
# repository). Prints per-round figures, medians with min–max spread, and kvchat/llama.cpp ratios.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}"
threads="${2:-2}"
shift $(( $# < 2 ? $# : 2 ))
# Numbers only: each goes into a command line (a bad one would fail late, after minutes of runs).
for v in "rounds=$rounds" "threads=$threads" "BUSY=${BUSY:-0}" "LLAMA_REPS=${LLAMA_REPS:-3}"; do
  [[ "${v#*=}" =~ ^[0-9]+$ ]] || { echo "bench-vs-llamacpp.sh: ${v%%=*} '${v#*=}' is not a whole number" >&2; exit 2; }
done
[[ "${CONTEXTS:-128}" =~ ^[0-9]+(,[0-9]+)*$ ]] \
  || { echo "bench-vs-llamacpp.sh: CONTEXTS '${CONTEXTS}' is not a comma-separated list of numbers" >&2; exit 2; }
reps="${LLAMA_REPS:-3}"   # llama-bench repetitions per test, per round
home="${KVCHAT_HOME:-$HOME/.cache/kvchat}"
model="$home/models/SmolLM2-135M-Instruct.Q4_1.gguf"
out="${OUT:-$root/target/bench-vs-llamacpp}"
mkdir -p "$out"

"$root/scripts/fetch-models.sh" >&2
bench="$("$root/scripts/llamacpp.sh" llama-bench)/llama-bench"

cargo build --release --quiet --manifest-path "$root/Cargo.toml"
kvchat="$root/target/release/kvchat"

busy_pids=()
trap 'kill "${busy_pids[@]}" 2>/dev/null || true' EXIT
for _ in $(seq 1 "${BUSY:-0}"); do
  yes > /dev/null &
  busy_pids+=($!)
done
if [ "${BUSY:-0}" -gt 0 ]; then
  echo "under load: ${BUSY} busy process(es) for the whole run" >&2
fi

if [ $# -gt 0 ]; then
  contexts="${CONTEXTS:-128}"
  for f in "$@"; do
    [ -f "$f" ] || { echo "no such model file: $f" >&2; exit 2; }
  done
  for r in $(seq 1 "$rounds"); do
    i=0
    for f in "$@"; do
      i=$((i + 1))
      echo "round $r/$rounds: $(basename "$f")" >&2
      "$bench" -m "$f" ${LLAMA_ARGS:-} -t "$threads" -fa on -r "$reps" -p 512 -n 0 -o json > "$out/f$i-llama-pp-$r.json"
      "$bench" -m "$f" ${LLAMA_ARGS:-} -t "$threads" -fa on -r "$reps" -p 0 -n 32 -d "$contexts" -o json > "$out/f$i-llama-tg-$r.json"
      "$kvchat" bench -m "$f" --threads "$threads" --modes full --contexts "512,$contexts" \
        --gen 32 --repeat 1 --warmup 1 --no-summary --json "$out/f$i-kvchat-$r.json" > /dev/null
    done
  done
  python3 - "$out" "$rounds" "$contexts" "$@" <<'PY'
import json, os, statistics, sys
out, rounds, contexts, files = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
ctxs = [int(c) for c in contexts.split(",")]
def med(v):
    return statistics.median(v) if v else float("nan")
head = f"{'file':24}" + "".join(f" {'decode @'+str(c)+' (llama.cpp/kvchat tok/s)':>40}" for c in ctxs)
head += f" {'prefill 512 (llama.cpp/kvchat)':>36}"
print(head)
for i, f in enumerate(files, 1):
    dec = {c: ([], []) for c in ctxs}
    pp = ([], [])
    for r in range(1, rounds + 1):
        for e in json.load(open(f"{out}/f{i}-llama-pp-{r}.json")):
            pp[0].append(e["avg_ts"])
        for e in json.load(open(f"{out}/f{i}-llama-tg-{r}.json")):
            if e["n_depth"] in dec:
                dec[e["n_depth"]][0].append(e["avg_ts"])
        for c in json.load(open(f"{out}/f{i}-kvchat-{r}.json"))["cells"]:
            if c["context"] == 512:
                pp[1].append(c["prefill_tok_s"]["median"])
            if c["context"] in dec:
                dec[c["context"]][1].append(1000.0 / c["decode_ms_per_token"]["median"])
    row = f"{os.path.basename(f)[:24]:24}"
    for c in ctxs:
        a, b = med(dec[c][0]), med(dec[c][1])
        row += f" {a:12.1f} / {b:8.1f} = {b / a:5.2f}x{'':8}"
    a, b = med(pp[0]), med(pp[1])
    row += f" {a:10.1f} / {b:8.1f} = {b / a:5.2f}x"
    print(row)
PY
  exit 0
fi

for r in $(seq 1 "$rounds"); do
  echo "round $r/$rounds" >&2
  "$bench" -m "$model" ${LLAMA_ARGS:-} -t "$threads" -fa on -r "$reps" -p 512 -n 0 -o json > "$out/llama-pp-$r.json"
  "$bench" -m "$model" ${LLAMA_ARGS:-} -t "$threads" -fa on -r "$reps" -p 0 -n 64 -d 128,512,2048,4096 -o json > "$out/llama-tg-f16-$r.json"
  "$bench" -m "$model" ${LLAMA_ARGS:-} -t "$threads" -fa on -r "$reps" -ctk q8_0 -ctv q8_0 -p 0 -n 64 -d 2048,4096 -o json > "$out/llama-tg-q8-$r.json"
  "$kvchat" bench -m "$model" --threads "$threads" --modes full,int8 --contexts 128,512,2048,4096 \
    --gen 64 --repeat 1 --warmup 1 --no-summary --json "$out/kvchat-$r.json" > /dev/null
done

python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def llama(kind, r):
    return json.load(open(f"{out}/llama-{kind}-{r}.json"))
rows = {}  # (what) -> {"llama.cpp": [..], "kvchat": [..]}
def add(key, who, v):
    rows.setdefault(key, {"llama.cpp": [], "kvchat": []})[who].append(v)
for r in range(1, rounds + 1):
    for e in llama("pp", r):
        add("prefill 512 tok/s", "llama.cpp", e["avg_ts"])
    for e in llama("tg-f16", r):
        add(f"decode tok/s @{e['n_depth']} full/f16", "llama.cpp", e["avg_ts"])
    for e in llama("tg-q8", r):
        add(f"decode tok/s @{e['n_depth']} int8/q8_0", "llama.cpp", e["avg_ts"])
    k = json.load(open(f"{out}/kvchat-{r}.json"))
    for c in k["cells"]:
        dec = 1000.0 / c["decode_ms_per_token"]["median"]
        if c["mode"].startswith("full"):
            add(f"decode tok/s @{c['context']} full/f16", "kvchat", dec)
            if c["context"] == 512:
                add("prefill 512 tok/s", "kvchat", c["prefill_tok_s"]["median"])
        elif c["mode"].startswith("int8") and c["context"] in (2048, 4096):
            add(f"decode tok/s @{c['context']} int8/q8_0", "kvchat", dec)
print(f"{'measure':34} {'llama.cpp median (min-max)':>28} {'kvchat median (min-max)':>26} {'ratio':>6}")
for key, v in rows.items():
    a, b = v["llama.cpp"], v["kvchat"]
    if not a or not b:
        continue
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{key:34} {ma:10.1f} ({min(a):.1f}-{max(a):.1f}){'':6} {mb:9.1f} ({min(b):.1f}-{max(b):.1f}){'':5} {mb/ma:5.2f}x")
PY
