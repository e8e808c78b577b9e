#!/usr/bin/env bash
# What --kv-offload costs on this machine: each cache combination X against X+offload, alternated
# cell by cell (X, X+offload, X, X+offload, ...) so that drift in the machine's speed hits both alike.
#   scripts/kv-offload-check.sh [ROUNDS=5] [CONTEXT=1024] [THREADS=2]
# On a CPU device offload keeps the same rows in the same memory (bit-identical output, tested), so
# the ratio measures only what the placement axis adds to the step. Raw outputs: target/kv-offload/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-5}"
ctx="${2:-1024}"
threads="${3:-2}"
out="$root/target/kv-offload"
mkdir -p "$out"
"$root/scripts/fetch-models.sh" >&2
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
kv="$root/target/release/kvchat"
modes="full full+int8 window:512+4+int4"
for r in $(seq 1 "$rounds"); do
  for m in $modes; do
    for p in "$m" "$m+offload"; do
      "$kv" bench --threads "$threads" --modes "$p" --contexts "$ctx" --gen 32 --repeat 1 \
        --warmup 1 --no-summary --json "$out/bench-$p-$r.json" >/dev/null
    done
  done
done
python3 - "$out" "$rounds" "$modes" "$ctx" <<'PY'
import json, statistics, sys
out, rounds, modes, ctx = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4]
def ms(m):
    return [json.load(open(f"{out}/bench-{m}-{r}.json"))["cells"][0]["decode_ms_per_token"]["median"]
            for r in range(1, rounds + 1)]
print(f"decode ms/token at context {ctx}, {rounds} alternated rounds (medians)")
print(f"{'mode':<24} {'without':>9} {'+offload':>9} {'ratio':>7}  per-round ratios")
for m in modes:
    a, b = ms(m), ms(m + "+offload")
    per = [y / x for x, y in zip(a, b)]
    print(f"{m:<24} {statistics.median(a):>9.2f} {statistics.median(b):>9.2f} "
          f"{statistics.median(b) / statistics.median(a):>7.3f}  {' '.join(f'{p:.3f}' for p in per)}")
PY
