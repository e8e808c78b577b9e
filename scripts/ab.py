#!/usr/bin/env python3
"""Two kvchat binaries side by side, alternated round by round (A, B, A, B, …), so that this
VM's drift falls on both: `kvchat bench` cells and `scripts/serve-load.py`'s throughput and time
to first token, each as B over A per round and the median of those ratios.

  target/pyenv/bin/python scripts/ab.py A_BINARY B_BINARY MODEL [--rounds 3] [--threads 2]
      [--parts bench,serve] [--modes full,int8] [--contexts 256,1024] [--gen 32]

(A refactor's check: B/A near 1.00 in every row. scripts/test.sh makes target/pyenv.)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def median(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def bench(binary, a):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [binary, "bench", "-m", a.model, "--threads", str(a.threads), "--modes", a.modes,
               "--contexts", a.contexts, "--gen", str(a.gen), "--no-summary", "--json", f.name]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cells = json.load(open(f.name))["cells"]
    out = {}
    for c in cells:
        key = f"{c['mode']} @ {c['context']}"
        out[f"bench {key} decode ms/token"] = c["decode_ms_per_token"]["median"]
        out[f"bench {key} prefill tok/s"] = c["prefill_tok_s"]["median"]
    return out


def serve(binary, a):
    cmd = [sys.executable, os.path.join(ROOT, "scripts/serve-load.py"), a.model,
           "--kvchat", binary, "--threads", str(a.threads), "--rounds", "1",
           "--parts", "concurrency,prefix,pressure"]
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    k = r["concurrency"]["kvchat"]
    return {
        "serve one at a time tok/s": k["alone_tok_s"][0],
        "serve all at once tok/s": k["together_tok_s"][0],
        "serve same answers (1 = yes)": float(k["same_answers"]),
        "serve prefix ttft ratio (cached / cold)": r["prefix"]["ttft_ratio"],
        "serve pressure tok/s": r["pressure"]["tokens_per_second"],
        "serve pressure within bound (1 = yes)": float(r["pressure"]["within_bound"]),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default="bench,serve")
    p.add_argument("--modes", default="full,int8")
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--gen", type=int, default=32)
    a = p.parse_args()
    for b in (a.a, a.b):
        if not os.access(b, os.X_OK):
            sys.exit(f"ab: no binary at {b}")
    parts = {"bench": bench, "serve": serve}
    runs = {"A": [], "B": []}
    for r in range(a.rounds):
        for side, binary in (("A", a.a), ("B", a.b)):
            got = {}
            for name in a.parts.split(","):
                if name not in parts:
                    sys.exit(f"ab: unknown part {name} ({', '.join(parts)})")
                got.update(parts[name](binary, a))
            runs[side].append(got)
            print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()),
                  file=sys.stderr)
    rows = []
    for key in runs["A"][0]:
        av = [x[key] for x in runs["A"]]
        bv = [x[key] for x in runs["B"]]
        ratios = [y / x for x, y in zip(av, bv) if x]
        rows.append({"figure": key, "A_median": median(av), "B_median": median(bv),
                     "B_over_A_median": round(median(ratios), 3),
                     "B_over_A_each_round": [round(x, 3) for x in ratios]})
    print(json.dumps({"a": a.a, "b": a.b, "model": a.model, "rounds": a.rounds, "rows": rows},
                     indent=1))
    for row in rows:
        print(f"{row['figure']:<46} A {row['A_median']:>9.2f}  B {row['B_median']:>9.2f}  "
              f"B/A {row['B_over_A_median']:.3f}  {row['B_over_A_each_round']}", file=sys.stderr)


if __name__ == "__main__":
    main()
