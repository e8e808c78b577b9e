#!/usr/bin/env bash
# What each KV precision costs and buys on the default model, measured here:
#   scripts/kv-precision-check.sh [ROUNDS=3] [THREADS=2]
# 1. Bytes per token of every precision (kvchat kv-size on the model's own dimensions).
# 2. Perplexity, c512, on a >= 30 KB English text (the license texts Debian ships in
#    /usr/share/common-licenses, concatenated; the same text every run), for f32, f16, bf16 and int8.
# 3. Decode ms/token at 4096 context, f32 / f16 / bf16 / int8 alternated round by round (each round
#    one `kvchat bench` cell per precision, in the same order), medians and ratios to f32.
# Prints a table; raw outputs go to target/kv-precision/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}"
threads="${2:-2}"
out="$root/target/kv-precision"
mkdir -p "$out"
"$root/scripts/fetch-models.sh" >&2
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
kv="$root/target/release/kvchat"

text="$out/english.txt"
cat /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/GFDL-1.3 \
  /usr/share/common-licenses/Artistic /usr/share/common-licenses/CC0-1.0 >"$text"
echo "text: $(wc -c <"$text") bytes of English prose ($text)"

echo "== bytes per token (kv-size, SmolLM2-135M dimensions)"
"$kv" kv-size --ctx 4096 | tee "$out/kv-size.txt"

echo "== perplexity, chunks of 512"
for t in f32 f16 bf16 int8; do
  "$kv" ppl "$text" --threads "$threads" --kv-type "$t" --json >"$out/ppl-$t.json"
  echo "$t $(cat "$out/ppl-$t.json")"
done

echo "== decode at 4096 context, $rounds rounds alternated"
for r in $(seq 1 "$rounds"); do
  for m in full+f32 full full+bf16 int8; do
    "$kv" bench --threads "$threads" --modes "$m" --contexts 4096 --gen 32 --repeat 1 --warmup 1 \
      --no-summary --json "$out/bench-$m-$r.json" >/dev/null
  done
done

python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ppl = {t: json.load(open(f"{out}/ppl-{t}.json"))["ppl"] for t in ["f32", "f16", "bf16", "int8"]}
ms = {}
for m in ["full+f32", "full", "full+bf16", "int8"]:
    xs = []
    for r in range(1, rounds + 1):
        c = json.load(open(f"{out}/bench-{m}-{r}.json"))["cells"][0]
        xs.append(c["decode_ms_per_token"]["median"])
    ms[m] = (statistics.median(xs), min(xs), max(xs))
names = {"full+f32": "f32", "full": "f16", "full+bf16": "bf16", "int8": "int8"}
print(f"{'precision':<10} {'ppl c512':>10} {'vs f32':>8} {'decode ms @4096':>22} {'vs f32':>7}")
for m, t in names.items():
    med, lo, hi = ms[m]
    print(f"{t:<10} {ppl[t]:>10.4f} {100 * (ppl[t] / ppl['f32'] - 1):>+7.3f}% "
          f"{med:>9.2f} ({lo:.2f}-{hi:.2f}) {med / ms['full+f32'][0]:>6.2f}x")
PY
