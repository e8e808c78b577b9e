#!/usr/bin/env bash
# The prefix store's targets (issue 15), measured on the default model, each in a fresh store under
# target/prefix-store-bench/ (the user's store is never touched):
#   1. a 2,000-token system prompt asked two different questions: time to first token of the second
#      run against the first (cold), ROUNDS alternated pairs, and the second answer against a run
#      without the store (greedy, identical);
#   2. one ~2,000-token document with 5 different questions in 5 processes: the share of each
#      prompt reused from the store;
#   3. a cold run with the store against --no-kv-store: the store's own time as a share of the run,
#      and wall and CPU time, max(ROUNDS, 8) pairs, alternating which goes first;
#   4. 50 distinct ~600-token prompts under a 64 MiB budget: bytes on disk after each run.
#   scripts/prefix-store-bench.sh [ROUNDS=3] [THREADS=2]      (PARTS=1,3 runs only those parts)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}"
threads="${2:-2}"
out="$root/target/prefix-store-bench"
rm -rf "$out"
mkdir -p "$out"
"$root/scripts/fetch-models.sh" >&2
# SmolLM2-135M, the figures' model, unless KVCHAT_MODEL names another (the registry's default is
# the 0.5B Qwen2.5-Coder since issue 61).
export KVCHAT_MODEL="${KVCHAT_MODEL:-$("$root/scripts/fetch-models.sh" | sed -n 's/^model ok: //p')}"
cargo build --release --quiet --manifest-path "$root/Cargo.toml"
python3 - "$root/target/release/kvchat" "$out" "$rounds" "$threads" <<'PY'
import os, random, re, resource, statistics, subprocess, sys, time
kv, out, rounds, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
words = ("the keeper wrote the weather every morning and the ships that passed the harbour "
         "in winter storms came from the north while the lamp burned through long nights and "
         "the sea turned grey green or silver under a low sky with gulls over the rocks").split()

def text(seed, n):
    r = random.Random(seed)
    sent = []
    for i in range(n):
        sent.append(r.choice(words))
        if i % 12 == 11:
            sent[-1] += "."
    return " ".join(sent)

def run(store, args, stdin=None):
    env = dict(os.environ, KVCHAT_KV_STORE=store)
    t0 = time.perf_counter()
    p = subprocess.run([kv, "run", "--threads", threads, "--temperature", "0", "-n", "16",
                        "--stats", *args], env=env, capture_output=True, text=True, input=stdin)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"kvchat failed: {p.stderr}")
    m = re.search(r"prefix store: (?:(\d+) of (\d+) prompt tokens reused.*?)?.*time to first token ([\d.]+) ms", p.stderr)
    ttft = float(m.group(3))
    reused = (int(m.group(1)), int(m.group(2))) if m.group(1) else None
    problems = [l for l in p.stderr.splitlines() if l.startswith("kvchat: prefix store:")]
    # The store's own time: its lookup, copying the new blocks' rows, and writing them.
    own = 0.0
    for pat in (r"MiB read in ([\d.]+) ms", r"in ([\d.]+) ms on its own thread", r"after ([\d.]+) ms copying"):
        m = re.search(pat, p.stderr)
        own += float(m.group(1)) / 1e3 if m else 0.0
    return dict(out=p.stdout, ttft=ttft, reused=reused, wall=wall, own=own, problems=problems,
                err=p.stderr)

fresh = iter(range(10**6))
def new_store():
    return f"{out}/store-{next(fresh)}"

parts = os.environ.get("PARTS", "1,2,3,4").split(",")

# 1. Time to first token, cold and warm, on a ~2,000-token system prompt.
system = "You answer questions about this logbook. " + text(1, 1650)
cold, warm, same = [], [], True
for r in range(rounds if "1" in parts else 0):
    s = new_store()
    a = run(s, ["--system", system, f"What came from the north? ({r})"])
    b = run(s, ["--system", system, f"What did the keeper write? ({r})"])
    ref = run(s, ["--no-kv-store", "--system", system, f"What did the keeper write? ({r})"])
    same &= b["out"] == ref["out"]
    cold.append(a["ttft"]); warm.append(b["ttft"])
    print(f"round {r + 1}: prompt {a['reused'][1]} tokens; cold TTFT {a['ttft']:.0f} ms, "
          f"warm {b['ttft']:.0f} ms ({a['ttft'] / b['ttft']:.1f}x), warm reused "
          f"{b['reused'][0]} of {b['reused'][1]}; warm answer == no-store answer: "
          f"{b['out'] == ref['out']}")
if "1" in parts:
  print(f"1. time to first token, median of {rounds}: cold {statistics.median(cold):.0f} ms, "
      f"warm {statistics.median(warm):.0f} ms: {statistics.median(cold) / statistics.median(warm):.1f}x "
      f"shorter (target >= 20x); answers identical: {same}")

# 2. Hit rate: one document, five questions, five processes.
s = new_store()
doc = text(2, 1650)
rates = []
for i, q in enumerate([] if "2" not in parts else ["Which birds are named?", "What colour is the sea?", "When do storms come?",
                       "What burns at night?", "Who wrote every morning?"]):
    o = run(s, [f"Read this document.\n\n{doc}\n\nQuestion: {q}"])
    n, m = o["reused"]
    rates.append(100 * n / m)
    print(f"   process {i + 1}: {n} of {m} prompt tokens reused ({100 * n / m:.1f} %)")
if "2" in parts:
  print(f"2. hit rate from the second process on: min {min(rates[1:]):.1f} % (target >= 90 %)")

# 3. The store's cost on a cold run: wall time with a fresh store against --no-kv-store.
on, off, own, cpu = [], [], [], []
pairs = max(rounds, 8) if "3" in parts else 0
for r in range(pairs):
    prompt = ["--system", "You answer questions about this logbook. " + text(100 + r, 1650), "What is it?"]
    # Which goes first alternates, so that drift in the machine's speed hits both alike.
    order = [False, True] if r % 2 == 0 else [True, False]
    got = {}
    for with_store in order:
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        o = run(new_store(), prompt if with_store else ["--no-kv-store", *prompt])
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        o["cpu"] = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
        got[with_store] = o
    a, b = got[False], got[True]
    off.append(a["wall"]); on.append(b["wall"])
    own.append(b["own"] / b["wall"])
    cpu.append(b["cpu"] / a["cpu"])
    print(f"   pair {r + 1}: cold run {a['wall']:.2f} s without the store, {b['wall']:.2f} s with it "
          f"({100 * (b['wall'] / a['wall'] - 1):+.1f} %), CPU time {100 * (cpu[-1] - 1):+.1f} %; "
          f"the store's own work (lookup, copying, writing) {1e3 * b['own']:.0f} ms = "
          f"{100 * own[-1]:.2f} % of the run")
ratios = [b / a for a, b in zip(off, on)]
if "3" in parts:
  print(f"3. cold-run overhead: the store's own work is {100 * statistics.median(own):.2f} % of a cold "
      f"run (median); median over {pairs} alternated pairs of the with/without ratio: wall time "
      f"{100 * (statistics.median(ratios) - 1):+.1f} %, CPU time {100 * (statistics.median(cpu) - 1):+.1f} % "
      f"(target <= 5 %)")

# 4. Budget: 50 distinct prompts under 64 MiB.
s = new_store()
budget = 64 << 20
most = 0
for i in range(50 if "4" in parts else 0):
    subprocess.run([kv, "run", "--threads", threads, "-n", "1", "--kv-store-budget", "64MiB",
                    "--raw", text(1000 + i, 500)], env=dict(os.environ, KVCHAT_KV_STORE=s),
                   capture_output=True, check=True)
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(s) for f in fs
               if f.endswith(".kvb"))
    most = max(most, disk)
st = subprocess.run([kv, "cache", "stats"], env=dict(os.environ, KVCHAT_KV_STORE=s),
                    capture_output=True, text=True).stdout
if "4" in parts:
  print(f"4. after 50 distinct prompts: most block bytes on disk after any run {most / 2**20:.1f} MiB, "
      f"budget {budget / 2**20:.0f} MiB: {'within' if most <= budget else 'OVER'}")
  print("   " + st.strip().replace("\n", "\n   "))
PY
