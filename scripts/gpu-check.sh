#!/usr/bin/env bash
# The GPU check (issue 17) as one prepared script, for a lent GPU machine where device time is short
# (a quarter hour in all, every start counted) and nothing can be downloaded. Three verbs:
#
#   scripts/gpu-check.sh pack     here: builds nothing; puts what the GPU machine lacks into .gpu/
#                                 (git-ignored) in two pieces that each fit one call's 64 MiB: p1
#                                 the CUDA binary, xz-compressed (68 → 9.5 MB; scripts/build-cuda.sh
#                                 first) and the first half of SmolLM2 Q4_1 (98 MB in all); p2 its
#                                 second half, llama-quantize and the gguf wheel (to make the
#                                 1B-shaped model there). Prints the two calls to make.
#   scripts/gpu-check.sh stash    there, once per piece: moves the carried .gpu/pN into
#                                 /tmp/kvchat-gpu, which outlives the call while the machine is warm
#   scripts/gpu-check.sh run [cuda|cpu]
#                                 there: every check, on `cuda` against the same binary on the CPU;
#                                 with `cpu` (a dry run here) both sides are the CPU. Results in
#                                 ${OUT:-target/gpu-check}/gpu-check.txt, bench JSON beside it.
#
# What `run` checks (under 5 minutes on an H200 machine):
#   1. the device answers: `--stats` names cuda:0 (and `--device auto` picks it);
#   2. greedy tokens, first 16, real model, every cache combination (f32/f16/bf16/int8/int4 ×
#      full/window with sinks × in place/offload, and no cache): the GPU's text equals the CPU's;
#   3. perplexity on a ≥ 30 KB text (the repository's own docs): GPU within 0.5 % of the CPU;
#   4. `kvchat bench` full/int8/window at 128…8192 context for SmolLM2, full at 128 and 2048 for
#      the 1B-shaped Q4_K_M model; peak GPU memory (nvidia-smi, sampled) of each;
#   5. targets: SmolLM2 Q4_1 decode ≥ 400 tok/s and 1B-shaped Q4_K_M ≥ 150 tok/s at context 128.
# QUICK=1 shortens 3 and 4 (a dry run on a small CPU); L1B=0 skips the 1B-shaped model; DEV_ARGS
# are added to the device side's commands (a dry run: DEV_ARGS="--kernels gpu" runs the GPU's code
# path on the CPU against the CPU's own).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
home="${KVCHAT_HOME:-$HOME/.cache/kvchat}"
verb="${1:-}"

case "$verb" in
pack)
  bin=target/cuda/kvchat-cuda
  [ -x "$bin" ] || { echo "gpu-check.sh: no $bin; run scripts/build-cuda.sh first" >&2; exit 1; }
  model="$home/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -s "$model" ] || scripts/fetch-models.sh >&2
  rm -rf .gpu && mkdir -p .gpu/p1 .gpu/p2
  xz -T0 -6 -c "$bin" >.gpu/p1/kvchat-cuda.xz
  half=$(( ($(stat -c %s "$model") + 1) / 2 ))
  head -c "$half" "$model" >.gpu/p1/smollm2.part0
  tail -c +"$((half + 1))" "$model" >.gpu/p2/smollm2.part1
  sha256sum "$model" | cut -d' ' -f1 >.gpu/p1/smollm2.sha256
  # Built for any x86-64 CPU (llamacpp.sh's own build is for this CPU only).
  cp "$(PORTABLE=1 scripts/llamacpp.sh llama-quantize)/llama-quantize" .gpu/p2/
  python3 -m pip download --quiet --no-cache-dir --no-deps --only-binary=:all: -d .gpu/p2 gguf==0.19.0 >&2
  du -sh .gpu/p* >&2
  cat <<EOF
Two device calls, back to back (a machine goes back 30 s after a call), the second with time to
spare (the check takes under 5 minutes; a fresh machine takes a minute or more to start):
  run(command="scripts/gpu-check.sh stash", carry=[".gpu/p1"])
  run(command="scripts/gpu-check.sh stash && scripts/gpu-check.sh run cuda", carry=[".gpu/p2"], timeout_s=480)
EOF
  ;;

stash)
  mkdir -p /tmp/kvchat-gpu
  for p in .gpu/p*; do [ -d "$p" ] && cp -r "$p"/. /tmp/kvchat-gpu/; done
  ls -la /tmp/kvchat-gpu
  ;;

run)
  dev="${2:-cuda}"
  [[ "$dev" == cuda || "$dev" == cpu ]] || { echo "gpu-check.sh run: device '$dev' is not cuda or cpu" >&2; exit 2; }
  out="${OUT:-$root/target/gpu-check}"
  mkdir -p "$out"
  res="$out/gpu-check.txt"
  : >"$res"
  say() { echo "$*" | tee -a "$res"; }
  stash=/tmp/kvchat-gpu
  if [ "$dev" = cuda ]; then
    bin="${BIN:-$stash/kvchat-cuda}"
    if [ ! -x "$bin" ] && [ -s "$stash/kvchat-cuda.xz" ]; then
      python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$stash/kvchat-cuda.xz" "$bin"
    fi
    model="$stash/smollm2.gguf"
    if [ ! -s "$model" ]; then
      cat "$stash"/smollm2.part0 "$stash"/smollm2.part1 >"$model.part" \
        || { say "FAIL: a half of the model is missing from $stash"; exit 1; }
      [ "$(sha256sum "$model.part" | cut -d' ' -f1)" = "$(cat "$stash"/smollm2.sha256)" ] \
        || { say "FAIL: the model's halves do not join into the packed file"; exit 1; }
      mv "$model.part" "$model"
    fi
    # cuBLAS and cuRAND 13 from the machine's Python packages (PyTorch's nvidia-* wheels).
    libs=$(python3 - <<'PY'
import glob, site
dirs = set()
for sp in site.getsitepackages():
    for lib in glob.glob(sp + "/nvidia/**/libcu*.so*", recursive=True):
        dirs.add(lib.rsplit("/", 1)[0])
print(":".join(sorted(dirs)))
PY
)
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    chmod +x "$bin" "$stash"/llama-quantize 2>/dev/null || true
  else
    bin="${BIN:-$root/target/release/kvchat}"
    model="$home/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  say "# kvchat GPU check: $(date -u +%FT%TZ), device $dev, binary $bin"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$res"
  fails=0
  fail() { say "FAIL: $*"; fails=$((fails + 1)); }

  # 1. The device answers and names itself.
  stats=$(echo hi | "$bin" run -m "$model" --device "$dev" --raw -n 4 --temperature 0 --stats --no-kv-store 2>&1 >/dev/null || true)
  line=$(grep -o 'device [a-z0-9:]*' <<<"$stats" | head -1 || true)
  say "1. --device $dev: $line"
  if [ "$line" != "device ${dev/cuda/cuda:0}" ]; then
    fail "device not used: $(tail -1 <<<"$stats")"
    say "result: stopped, the device does not answer (nothing else is worth its time)"
    exit 1
  fi
  auto=$(echo hi | "$bin" run -m "$model" --raw -n 1 --temperature 0 --stats --no-kv-store 2>&1 >/dev/null | grep -o 'device [a-z0-9:]*' | head -1 || true)
  say "   --device auto: $auto"

  # 2. Greedy text, every cache combination, this device against the CPU.
  say "2. greedy, 16 tokens, '$dev' vs cpu:"
  q="What is the capital of France? Answer in one sentence, then name two rivers of France."
  combos=("--no-cache --kv-type f32")
  for p in f32 f16 bf16 int8 int4; do
    for ret in "" "--kv-window 24 --kv-sinks 4"; do
      for off in "" "--kv-offload"; do combos+=("--kv-type $p $ret $off"); done
    done
  done
  same=0
  for c in "${combos[@]}"; do
    # shellcheck disable=SC2086
    a=$("$bin" run -m "$model" --device "$dev" ${DEV_ARGS:-} -n 16 --temperature 0 --no-kv-store $c "$q" 2>&1) || a="error: $a"
    # shellcheck disable=SC2086
    b=$("$bin" run -m "$model" --device cpu -n 16 --temperature 0 --no-kv-store $c "$q" 2>&1) || b="error: $b"
    if [ "$a" = "$b" ] && [[ "$a" != error:* ]]; then
      same=$((same + 1)); say "   same  $c"
    else
      fail "greedy differs for '$c': [$a] vs cpu [$b]"
    fi
  done
  say "   $same of ${#combos[@]} combinations identical"

  # 3. Perplexity on >= 30 KB of text.
  text="$out/ppl-text.txt"
  cat README.md DEVELOPERS.md docs/*.md >"$text.all"
  head -c "${PPL_BYTES:-32768}" "$text.all" >"$text"
  chunks=0; [ "${QUICK:-0}" = 1 ] && chunks=4
  ppl_of() { # DEVICE [ARGS...] -> perplexity, or nothing
    local d=$1; shift
    "$bin" ppl -m "$model" --device "$d" "$@" --chunks "$chunks" --json "$text" 2>>"$out/ppl.log" \
      | python3 -c 'import json,sys; print(json.load(sys.stdin)["ppl"])' 2>>"$out/ppl.log" || true
  }
  # shellcheck disable=SC2086
  pg=$(ppl_of "$dev" ${DEV_ARGS:-})
  pc=$(ppl_of cpu)
  if [ -n "$pg" ] && [ -n "$pc" ]; then
    rel=$(python3 -c "print(f'{($pg / $pc - 1) * 100:+.3f}')")
    say "3. perplexity, $(stat -c %s "$text") bytes: $dev $pg, cpu $pc ($rel %)"
    python3 -c "import sys; sys.exit(abs($pg / $pc - 1) > 0.005)" || fail "perplexity differs by more than 0.5 %"
  else
    fail "perplexity: no figure ($dev '$pg', cpu '$pc'; see ppl.log)"
  fi

  # 4. bench, with peak GPU memory sampled while each runs.
  bench() { # NAME MODEL ARGS...
    local name=$1 m=$2; shift 2
    local mem="$out/mem-$name.txt"
    : >"$mem"
    local sampler=""
    if command -v nvidia-smi >/dev/null && [ "$dev" = cuda ]; then
      (while :; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >>"$mem"; sleep 0.2; done) &
      sampler=$!
    fi
    # shellcheck disable=SC2086
    "$bin" bench -m "$m" --device "$dev" ${DEV_ARGS:-} --no-summary --json "$out/bench-$name.json" "$@" >/dev/null 2>"$out/bench-$name.log" \
      || fail "bench $name: $(tail -1 "$out/bench-$name.log")"
    [ -z "$sampler" ] || kill "$sampler" 2>/dev/null || true
    [ -s "$out/bench-$name.json" ] || return 0
    local peak
    peak=$(sort -n "$mem" | tail -1)
    python3 - "$out/bench-$name.json" "$name" "${peak:-n/a}" <<'PY' | tee -a "$res"
import json, sys
path, name, peak = sys.argv[1:]
doc = json.load(open(path))
print(f"   {name}: peak GPU memory {peak} MiB")
for c in doc["cells"]:
    d = c.get("decode_ms_per_token", {}).get("median")
    p = c.get("prefill_tok_s", {}).get("median")
    tok = f"{1000 / d:8.1f} tok/s" if d else "       —"
    pre = f"{p:9.1f}" if p else "        —"
    print(f"     {c['mode']:>12} @ {c['context']:>5}: decode {tok}, prefill {pre} tok/s")
PY
  }
  decode128() { # JSON MODE -> tok/s, or nothing
    [ -s "$1" ] || return 0
    python3 - "$1" "$2" <<'PY' || true
import json, sys
doc = json.load(open(sys.argv[1]))
c = [c for c in doc["cells"] if c["mode"] == sys.argv[2] and c["context"] == 128][0]
print(f"{1000 / c['decode_ms_per_token']['median']:.1f}")
PY
  }
  ctxs=128,1024,4096,8192; rep=(--gen 32 --repeat 3 --warmup 1)
  [ "${QUICK:-0}" = 1 ] && ctxs=128,1024 && rep=(--gen 8 --repeat 1 --warmup 0)
  say "4. bench ($dev):"
  bench smollm2 "$model" --modes full,int8,window:256 --contexts "$ctxs" "${rep[@]}"
  t_small=$(decode128 "$out/bench-smollm2.json" full)
  if [ "${L1B:-1}" = 1 ]; then
    l1b="$stash/l1b-Q4_K_M.gguf"
    [ "$dev" = cpu ] && l1b="$home/test-models/l1b-Q4_K_M.gguf"
    if [ ! -s "$l1b" ] && [ "$dev" = cuda ]; then
      # (pyyaml and numpy, which gguf needs, are on that machine.)
      { python3 -m pip install --quiet --no-index --no-deps --no-cache-dir --target /tmp/kvchat-gpu/py \
          "$stash"/gguf-*.whl \
        && PYTHONPATH=/tmp/kvchat-gpu/py python3 scripts/write-random-llama.py "$model" "$stash/l1b-F16.gguf" \
        && "$stash/llama-quantize" "$stash/l1b-F16.gguf" "$l1b.part" Q4_K_M "$(nproc)" \
        && mv "$l1b.part" "$l1b"; } >"$out/l1b.log" 2>&1 || fail "making the 1B-shaped model: $(tail -1 "$out/l1b.log")"
      rm -f "$stash/l1b-F16.gguf"
    fi
    if [ -s "$l1b" ]; then
      l1b_ctx=128,2048; [ "${QUICK:-0}" = 1 ] && l1b_ctx=128
      bench l1b-q4km "$l1b" --modes full --contexts "$l1b_ctx" "${rep[@]}"
      t_big=$(decode128 "$out/bench-l1b-q4km.json" full)
    else
      say "   (no 1B-shaped model at $l1b: skipped)"
    fi
  fi

  # 5. Targets.
  say "5. decode @128: SmolLM2 Q4_1 $t_small tok/s (target 400), 1B-shaped Q4_K_M ${t_big:-skipped} tok/s (target 150)"
  if [ "$dev" = cuda ]; then
    python3 -c "import sys; sys.exit(${t_small:-0} < 400)" || fail "SmolLM2 decode below 400 tok/s"
    [ -z "${t_big:-}" ] || python3 -c "import sys; sys.exit(${t_big} < 150)" || fail "1B-shaped decode below 150 tok/s"
  fi
  say "result: $fails failure(s)"
  [ "$fails" = 0 ]
  ;;

*)
  echo "usage: scripts/gpu-check.sh pack | stash | run [cuda|cpu]" >&2
  exit 2
  ;;
esac
