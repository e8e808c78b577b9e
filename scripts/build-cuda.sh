#!/usr/bin/env bash
# Builds the CUDA kvchat: one stripped binary that starts and runs on the CPU where no CUDA library
# is installed, and runs on an NVIDIA GPU where the driver and CUDA 13's cuBLAS/cuRAND are.
#   scripts/build-cuda.sh [COMPUTE_CAP]     (default 90: H100/H200; 80: A100; 89: L4/L40)
# Prints the binary's path (target/cuda/kvchat-cuda). Not part of CI (too heavy); 22 min on 2 cores
# from clean (ptxas on candle's quantized-matmul kernels is most of it), ~1.5 min after a change.
#
# How (docs/gpu.md says why):
# - The toolkit is CUDA 13.0 from NVIDIA's own PyPI wheels (nvcc, cicc, headers, the static
#   runtime), pinned, unpacked once into ${KVCHAT_HOME:-~/.cache/kvchat}/cuda-13.0. 13 is the major
#   the GPU machines here carry (driver 580, PyTorch cu130); Debian's 11.8 cannot target sm_90a.
#   CUDA_HOME=/usr/local/cuda uses an installed toolkit instead.
# - The CUDA libraries are opened at run time (cudarc's `dynamic-loading`), not linked: candle-core
#   asks cudarc for `dynamic-linking`, so this script builds against a copy of candle-core 0.11.1
#   (the registry's, unchanged but for that one feature name), given to cargo by `--config patch`;
#   the build runs on a copy of the tree (target/cuda/tree), so the tree's Cargo.lock is never
#   rewritten, even for a moment.
# - candle-kernels links `-lcudart`; a folder holding only libcudart_static.a under that name makes
#   the linker take the static runtime, which itself opens libcuda only when a kernel is launched.
# - `-C target-cpu=x86-64-v3` (AVX2, FMA) instead of the tree's `native`: the binary is carried to
#   other machines. kvchat picks its AVX2 kernels at run time either way.
set -euo pipefail
cd "$(dirname "$0")/.."
cap="${1:-90}"
case "$cap" in
  [0-9][0-9] | [0-9][0-9][0-9]) ;;
  *) echo "build-cuda.sh: compute capability '$cap' is not a number like 80 or 90" >&2; exit 2 ;;
esac
home="${KVCHAT_HOME:-$HOME/.cache/kvchat}"
start=$(date +%s)
for tool in cargo g++ python3 strip ldd git tar; do
  command -v "$tool" >/dev/null || { echo "build-cuda.sh: '$tool' is needed and not installed" >&2; exit 1; }
done

# --- the toolkit -----------------------------------------------------------------------------
if [ -n "${CUDA_HOME:-}" ]; then
  tk="$CUDA_HOME"
else
  tk="$home/cuda-13.0"
  if [ ! -x "$tk/bin/nvcc" ]; then
    echo "installing CUDA 13.0 (nvcc, runtime, headers) from PyPI into $tk (once, ~120 MB)..." >&2
    rm -rf "$tk.tmp" && mkdir -p "$tk.tmp"
    python3 -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-deps --only-binary=:all: \
      --target "$tk.tmp" \
      nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-nvvm==13.0.88 \
      nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 >&2
    rm -rf "$tk" && mv "$tk.tmp/nvidia/cu13" "$tk" && rm -rf "$tk.tmp"
  fi
fi
[ -x "$tk/bin/nvcc" ] || { echo "build-cuda.sh: no nvcc in $tk/bin" >&2; exit 1; }
static_rt=$(ls "$tk"/lib/libcudart_static.a "$tk"/lib64/libcudart_static.a \
  "$tk"/targets/x86_64-linux/lib/libcudart_static.a 2>/dev/null | head -1 || true)
[ -n "$static_rt" ] || { echo "build-cuda.sh: no libcudart_static.a under $tk" >&2; exit 1; }
export PATH="$tk/bin:$PATH" CUDA_ROOT="$tk" CUDA_PATH="$tk" CUDA_COMPUTE_CAP="$cap"
echo "toolkit: $(nvcc --version | grep -o 'release [0-9.]*'), compute capability $cap" >&2

# --- candle-core asking for run-time loading ------------------------------------------------
work="$PWD/target/cuda/build-support"
mkdir -p "$work/link"
cp "$static_rt" "$work/link/libcudart.a"
cargo fetch --locked >/dev/null
registry_src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-core-0.11.1 2>/dev/null | head -1 || true)
[ -d "$registry_src" ] || { echo "build-cuda.sh: candle-core 0.11.1 not in cargo's registry" >&2; exit 1; }
patched="$work/candle-core-0.11.1"
if [ ! -f "$patched/.kvchat-patched" ]; then
  rm -rf "$patched" && cp -r "$registry_src" "$patched"
  n=$(grep -c '^    "dynamic-linking",$' "$patched/Cargo.toml" || true)
  [ "$n" = 1 ] || { echo "build-cuda.sh: candle-core's cudarc features are not as expected" >&2; exit 1; }
  sed -i 's/^    "dynamic-linking",$/    "dynamic-loading",/' "$patched/Cargo.toml"
  touch "$patched/.kvchat-patched"
fi

# --- the build, on a copy of the tree (the patch rewrites the copy's Cargo.lock) ---------------
# The copy's files are dated now (tar -m): with the originals' dates, an edit made while an
# earlier build was compiling was older than that build's outputs, and cargo kept a stale binary.
tree="$PWD/target/cuda/tree"
rm -rf "$tree" && mkdir -p "$tree"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -m -xf - -C "$tree"
RUSTFLAGS="-C target-cpu=x86-64-v3 -L native=$work/link" \
  cargo build --release --features cuda --manifest-path "$tree/Cargo.toml" \
  --target-dir "$PWD/target/cuda" --config "patch.crates-io.candle-core.path='$patched'" >&2
out=target/cuda/kvchat-cuda
strip -o "$out" target/cuda/release/kvchat
if ldd "$out" | grep -Eq 'libcu|libnv'; then
  echo "build-cuda.sh: $out still links a CUDA library:" >&2
  ldd "$out" | grep -E 'libcu|libnv' >&2
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s: $(du -h "$out" | cut -f1)" >&2
echo "$out"
