#!/usr/bin/env bash
# The house's counts (issue 62), printed one per line, so that a change's before and after can be
# compared: code lines under src/commands/, source files over 700 code lines, architecture names
# compared outside the architecture table, layer-index scans in the forward pass, README lines.
# A code line is neither blank nor only a comment; a file's `#[cfg(test)] mod tests { … }` at its
# end is not counted (test files named tests.rs are skipped).
set -euo pipefail
cd "$(dirname "$0")/.."

code_lines() {
    awk '
        prev ~ /^#\[cfg\(test\)\]/ && /^mod tests/ { intest = 1; n-- }
        { prev = $0 }
        intest { next }
        /^[[:space:]]*$/ { next }
        /^[[:space:]]*\/\// { next }
        { n++ }
        END { print n + 0 }
    ' "$1"
}

commands=0
while IFS= read -r f; do
    commands=$((commands + $(code_lines "$f")))
done < <(find src/commands -name '*.rs' ! -name tests.rs)
echo "code lines in src/commands/: $commands"

echo "files over 700 code lines (grids.rs is data):"
over=0
while IFS= read -r f; do
    n=$(code_lines "$f")
    if [ "$n" -gt 700 ]; then
        echo "  $n $f"
        over=$((over + 1))
    fi
done < <(find src -name '*.rs' ! -name tests.rs ! -name grids.rs | sort)
echo "files over 700: $over"

# Places outside the architecture table (src/model/arch.rs) that decide by an architecture's
# name or by a size standing for one: `arch == "…"`, a `match` on the name, a literal list of
# names, `n_layer == N`.
stray=$(grep -rnE 'arch(\.as_str\(\))? *[!=]= *"|match [a-z_.]*arch[a-z_.()]* *\{|(\[|\(| )"llama", "mistral"|n_layer == [1-9]|"qwen35moe"' \
    src --include=*.rs | grep -v '^src/model/arch.rs' | grep -v '/tests.rs:' | grep -v '^src/tokenizer/' | wc -l || true)
echo "arch names compared outside the table: $stray"

scans=$(grep -nE "\.(kv_source|kv_block|state_index)\(" src/model/llama.rs src/model/decoder.rs 2>/dev/null | wc -l || true)
echo "layer-index scans in the forward pass: $scans"

echo "README lines: $(wc -l < README.md)"
