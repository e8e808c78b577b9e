#!/usr/bin/env bash
# What each KV precision, and each combination with a window and offload, costs and buys on the
# default model, measured here:
#   scripts/kv-precision-check.sh [ROUNDS=2] [THREADS=2]   (about 40 minutes on 2 cores)
# 1. Bytes per token of every precision (kvchat kv-size on the model's own dimensions).
# 2. Perplexity, c512, on a >= 30 KB English text (the license texts Debian ships in
#    /usr/share/common-licenses, concatenated; the same text every run), for every precision, and
#    for a window of 256 + 4 sinks alone and with int8; then f16 and int8 against f32 paired over the
#    same tokens (`kvchat ppl --against`), which tells a small difference from noise.
# 3. Decode ms/token at 4096 context for every precision and for the combinations with offload and
#    a window, alternated round by round (each round one `kvchat bench` cell per mode, in the same
#    order), medians and ratios to f32 (and of each +offload mode to the same mode without).
# Prints tables; raw outputs go to target/kv-precision/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-2}"
threads="${2:-2}"
out="$root/target/kv-precision"
mkdir -p "$out"
"$root/scripts/fetch-models.sh" >&2
# SmolLM2-135M, the figures' model, unless KVCHAT_MODEL names another (the registry's default is
# the 0.5B Qwen2.5-Coder since issue 61).
export KVCHAT_MODEL="${KVCHAT_MODEL:-$("$root/scripts/fetch-models.sh" | sed -n 's/^model ok: //p')}"
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
kv="$root/target/release/kvchat"

text="$out/english.txt"
cat /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/GFDL-1.3 \
  /usr/share/common-licenses/Artistic /usr/share/common-licenses/CC0-1.0 >"$text"
echo "text: $(wc -c <"$text") bytes of English prose ($text)"

echo "== bytes per token (kv-size, SmolLM2-135M dimensions)"
"$kv" kv-size --ctx 4096 | tee "$out/kv-size.txt"

ppl_modes="full+f32 full full+bf16 full+int8 full+int4 window:256+4 window:256+4+int8"
echo "== perplexity, chunks of 512"
for m in $ppl_modes; do
  args=()
  IFS=+ read -r -a parts <<<"$m"
  for p in "${parts[@]}"; do
    case "$p" in
      window:*) args+=(--kv-window "${p#window:}") ;;
      f32 | bf16 | int8 | int4) args+=(--kv-type "$p") ;;
      [0-9]*) args+=(--kv-sinks "$p") ;;
    esac
  done
  "$kv" ppl "$text" --threads "$threads" "${args[@]}" --json >"$out/ppl-$m.json"
  echo "$m $(cat "$out/ppl-$m.json")"
done

echo "== f16 and int8 against f32, paired over the same tokens (kvchat ppl --against)"
for t in f16 int8; do
  "$kv" ppl "$text" --threads "$threads" --kv-type "$t" --against full+f32 --json >"$out/paired-$t.json"
  echo "$t $(cat "$out/paired-$t.json")"
done

speed_modes="full+f32 full full+int8 full+int4 full+offload full+int8+offload window:1024+4+int4 window:1024+4+int4+offload"
echo "== decode at 4096 context, $rounds rounds alternated"
for r in $(seq 1 "$rounds"); do
  for m in $speed_modes; do
    "$kv" bench --threads "$threads" --modes "$m" --contexts 4096 --gen 32 --repeat 1 --warmup 1 \
      --no-summary --json "$out/bench-$m-$r.json" >/dev/null
  done
done

python3 - "$out" "$rounds" "$ppl_modes" "$speed_modes" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ppl_modes, speed_modes = sys.argv[3].split(), sys.argv[4].split()
ppl = {m: json.load(open(f"{out}/ppl-{m}.json"))["ppl"] for m in ppl_modes}
print(f"{'mode':<22} {'ppl c512':>10} {'vs f32':>9}")
for m in ppl_modes:
    print(f"{m:<22} {ppl[m]:>10.4f} {100 * (ppl[m] / ppl['full+f32'] - 1):>+8.3f}%")
w, wq = ppl["window:256+4"], ppl["window:256+4+int8"]
print(f"window:256+4+int8 vs window:256+4: {100 * (wq / w - 1):+.3f}%")
for t in ["f16", "int8"]:
    a = json.load(open(f"{out}/paired-{t}.json"))["against"]
    print(f"{t} vs f32, paired: {a['diff_pct']:+.3f}% ± {a['diff_stderr_pct']:.3f}%")
ms = {}
for m in speed_modes:
    xs = [json.load(open(f"{out}/bench-{m}-{r}.json"))["cells"][0]["decode_ms_per_token"]["median"]
          for r in range(1, rounds + 1)]
    ms[m] = (statistics.median(xs), min(xs), max(xs))
print(f"\n{'mode':<28} {'decode ms @4096':>22} {'vs f32':>7} {'vs no offload':>14}")
for m in speed_modes:
    med, lo, hi = ms[m]
    base = m.removesuffix("+offload")
    off = f"{med / ms[base][0]:.3f}x" if m.endswith("+offload") and base in ms else ""
    print(f"{m:<28} {med:>9.2f} ({lo:.2f}-{hi:.2f}) {med / ms['full+f32'][0]:>6.2f}x {off:>14}")
PY
