#!/usr/bin/env bash
# Constrained decoding's cost (issue 63), measured with `kvchat run --stats` on the default model:
#   1. decode speed with a JSON schema against the same prompt unconstrained (`--ignore-eos`), both
#      256 tokens, alternated ROUNDS times; the medians and their ratio;
#   2. the grammar's start-up for a 50-field schema (compiled with its first mask), and the
#      vocabulary's trie, built once per model.
# Usage: scripts/grammar-bench.sh [ROUNDS] [extra kvchat flags, e.g. -m MODEL --threads 2]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}"
shift || true
kvchat=target/release/kvchat
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
person = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "email"],
          "properties": {"name": {"type": "string"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "enum": ["Paris", "London", "Berlin", "Madrid", "Rome"]},
                         "email": {"type": "string"}}}
# minItems keeps the answer going for all 256 tokens, as --ignore-eos does unconstrained.
json.dump({"type": "object", "required": ["people"], "additionalProperties": False,
           "properties": {"people": {"type": "array", "minItems": 60, "items": person}}},
          open(f"{d}/long.json", "w"))
kinds = [{"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 1000},
         {"type": "number"}, {"type": "boolean"}, {"type": "string", "enum": ["a", "b", "c"]},
         {"type": "array", "items": {"type": "string"}, "maxItems": 3}]
props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(50)}
json.dump({"type": "object", "properties": props, "required": list(props)[:30],
           "additionalProperties": False}, open(f"{d}/fifty.json", "w"))
PY

prompt="List people with their name, age, city and email as JSON."
decode() { grep -o 'decode [0-9.]* tok/s' | grep -o '[0-9.]*'; }
free=() constrained=() startup=() vocab=()
for r in $(seq 1 "$rounds"); do
    f=$("$kvchat" run "$@" --stats -n 256 --ignore-eos "$prompt" 2>&1 >/dev/null | decode)
    c=$("$kvchat" run "$@" --stats -n 256 --json-schema "$tmp/long.json" "$prompt" 2>&1 >/dev/null | decode)
    line=$("$kvchat" run "$@" --stats -n 8 --json-schema "$tmp/fifty.json" "Fill in the form." 2>&1 >/dev/null | grep 'grammar:')
    v=$(echo "$line" | grep -o 'read in [0-9.]*' | grep -o '[0-9.]*')
    s=$(echo "$line" | grep -o 'first mask in [0-9.]*' | grep -o '[0-9.]*$')
    echo "round $r: unconstrained $f tok/s, constrained $c tok/s; 50-field start-up $s ms (vocabulary $v ms)" >&2
    free+=("$f") constrained+=("$c") startup+=("$s") vocab+=("$v")
done
python3 - "${free[*]}" "${constrained[*]}" "${startup[*]}" "${vocab[*]}" <<'PY'
import statistics as st, sys
f, c, s, v = ([float(x) for x in a.split()] for a in sys.argv[1:5])
ratios = [b / a for a, b in zip(f, c)]
print(f"decode tok/s median: unconstrained {st.median(f):.1f}, constrained {st.median(c):.1f}; "
      f"ratio median {st.median(ratios):.3f} (per round: {', '.join(f'{r:.3f}' for r in ratios)})")
print(f"50-field schema start-up: median {st.median(s):.1f} ms, max {max(s):.1f} ms; "
      f"vocabulary trie (once per model): median {st.median(v):.0f} ms")
PY
