#!/usr/bin/env bash
# Builds llama.cpp's tools once, CPU only, from the sources vendored in the PyPI sdist of
# llama-cpp-python, into ${KVCHAT_HOME:-~/.cache/kvchat}/llama.cpp (outside the repository), and
# prints the directory holding the binaries. The reference for speed (llama-bench) and correctness
# (llama-perplexity, llama-tokenize) that scripts/bench-vs-llamacpp.sh and
# scripts/check-vs-llamacpp.sh compare kvchat with; llama-quantize makes test files of other types.
#   scripts/llamacpp.sh [TARGET...]   (default: llama-bench llama-perplexity llama-tokenize llama-quantize;
#                                     llama-server for scripts/serve-load.py --llama-server)
#   PORTABLE=1 scripts/llamacpp.sh …  a build for any x86-64 CPU (GGML_NATIVE=OFF) in its own folder,
#                                     to be carried to another machine (scripts/gpu-check.sh)
set -euo pipefail
ver=0.3.36
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
home="${KVCHAT_HOME:-$HOME/.cache/kvchat}"
cache="$home/llama.cpp"
build="$cache/build-$ver"
native=ON
if [ "${PORTABLE:-0}" = 1 ]; then build="$cache/build-$ver-portable"; native=OFF; fi
bin="$build/bin"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(llama-bench llama-perplexity llama-tokenize llama-quantize)
mkdir -p "$cache"

missing=()
for t in "${targets[@]}"; do [ -x "$bin/$t" ] || missing+=("$t"); done
if [ ${#missing[@]} -gt 0 ]; then
  tarball="$cache/llama_cpp_python-$ver.tar.gz"
  if [ ! -f "$tarball" ]; then
    # The sdist's URL from the index's simple API (pip download --no-binary would build a wheel's
    # build environment, cmake included, from source).
    index="${PIP_INDEX_URL:-https://pypi.org/simple}"
    url=$(curl -fsSL "$index/llama-cpp-python/" | grep -o "https://[^\"#]*llama_cpp_python-$ver.tar.gz" | head -1)
    curl -fsSL -o "$tarball.part" "$url"
    echo "$sdist_sha  $tarball.part" | sha256sum --check --status || { echo "sha256 mismatch: $url" >&2; exit 1; }
    mv "$tarball.part" "$tarball"
  fi
  src="$cache/src-$ver"
  if [ ! -d "$src" ]; then
    mkdir -p "$src.tmp" && tar -xzf "$tarball" -C "$src.tmp" && mv "$src.tmp" "$src"
  fi
  lsrc="$src/llama_cpp_python-$ver/vendor/llama.cpp"
  cmake_bin=$(command -v cmake || true)
  if [ -z "$cmake_bin" ]; then
    python3 -m pip install --quiet --no-cache-dir --target "$cache/tools" cmake >&2
    cmake_bin="$cache/tools/bin/cmake"
    export PYTHONPATH="$cache/tools${PYTHONPATH:+:$PYTHONPATH}"
  fi
  echo "building llama.cpp ${missing[*]} (once; several minutes on 2 cores)..." >&2
  "$cmake_bin" -S "$lsrc" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE="$native" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DGGML_OPENMP=ON >&2
  "$cmake_bin" --build "$build" --target "${missing[@]}" -j "$(nproc)" >&2
fi
echo "$bin"
