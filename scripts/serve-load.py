#!/usr/bin/env python3
"""Load test of `kvchat serve` with the official openai client, on 127.0.0.1 only, bounded in
count and time (each server is started with --exit-after and killed at the end).

  target/pyenv/bin/python scripts/serve-load.py MODEL [--clients 6] [--tokens 48] [--threads 2]
      [--parts concurrency,prefix,pressure,headroom] [--kvchat target/release/kvchat]
      [--serve-args "--device cuda"]
      [--llama-server "$(scripts/llamacpp.sh llama-server)/llama-server"]

(scripts/test.sh makes target/pyenv with the openai package.)

- concurrency: the same distinct prompts (~100-200 tokens), greedy, N tokens each, served one at
  a time and then all at once: aggregate tokens/s of both, their ratio, and whether every
  concurrent answer equals its answer alone. With --llama-server, the same load on llama-server
  (-np N -t THREADS), alternated round by round: kvchat's concurrent throughput over llama-server's.
- prefix: 8 requests in turn with the same ~1,500-token system prompt and different questions:
  cached_tokens and time to first token (streamed) of each, and the pool's bytes against one
  request's.
- pressure: --kv-pool 32MiB and 32 concurrent long requests (--pressure-requests; --pressure-max-tokens, 200;
  --pressure-answers long, or short for answers far under max_tokens): every
  request completes or gets a 429, /metrics' pool use and allocation never pass the bound,
  nothing hangs; the throughput, the most sequences running at once and the preemptions.
- headroom (only when asked for): --clients one-sentence questions with max_tokens 1000 in a
  32 MiB pool: the tokens/s, and how many answer at once.

Progress goes to stderr; stdout holds only the JSON report.
"""
import argparse
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# More `kvchat serve` flags for every server this run starts (--serve-args; the GPU check's
# "--device cuda").
SERVE_ARGS = []

TOPICS = ["the water cycle", "how a bicycle gear works", "why bread rises", "the phases of the moon",
          "how vaccines train the immune system", "what a compiler does", "how tides form",
          "why leaves change colour"]


def prompt_for(i):
    t = TOPICS[i % len(TOPICS)]
    return (f"I am preparing a short lesson for curious twelve-year-olds about {t}. "
            f"They already know some basic science words but get lost in long sentences. "
            f"Please explain {t} in plain words, step by step, with one everyday example "
            f"they can try or observe at home, and finish with a question they could "
            f"discuss in pairs. Keep it friendly and concrete, avoid jargon, and do not use "
            f"lists longer than four items. Lesson number {i}.")


class Server:
    def __init__(self, kvchat, model, threads, extra):
        # --no-kv-store: what is measured is one server's memory; the on-disk prefix store would
        # hand a later round (or server) the prompts an earlier one prefilled.
        args = [kvchat, "serve", "-m", model, "--port", "0", "--threads", str(threads),
                "--exit-after", "1800", "--no-kv-store"] + SERVE_ARGS + extra
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True)
        first = self.proc.stderr.readline()
        m = re.search(r" at (http://[0-9.:]+)/v1", first)
        if not m:
            self.proc.kill()
            sys.exit(f"serve-load: the server did not start: {first.strip()}")
        self.base = m.group(1)
        print(first.strip(), file=sys.stderr)
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0,
                                    timeout=900)

    def metric(self, name):
        text = urllib.request.urlopen(self.base + "/metrics", timeout=30).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def close(self):
        self.proc.kill()
        self.proc.wait()


class LlamaServer:
    """llama-server on a free port of 127.0.0.1, the reference of the side-by-side run."""

    def __init__(self, binary, model, threads, parallel, extra):
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.proc = subprocess.Popen(
            [binary, "-m", model, "-t", str(threads), "-np", str(parallel), "-c",
             str(1024 * parallel), "--host", "127.0.0.1", "--port", str(port)] + extra,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:
            try:
                if urllib.request.urlopen(self.base + "/health", timeout=5).status == 200:
                    break
            except Exception:
                pass
            if time.time() - t0 > 120 or self.proc.poll() is not None:
                self.proc.kill()
                sys.exit("serve-load: llama-server did not start")
            time.sleep(0.5)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0,
                                    timeout=900)

    def close(self):
        self.proc.kill()
        self.proc.wait()


def chat(server, messages, tokens, stream=False):
    """(text, completion tokens, cached tokens, seconds, seconds to the first token)."""
    t0 = time.perf_counter()
    if not stream:
        r = server.client.chat.completions.create(model="m", messages=messages, temperature=0,
                                                  max_tokens=tokens)
        dt = time.perf_counter() - t0
        details = getattr(r.usage, "prompt_tokens_details", None)
        return (r.choices[0].message.content, r.usage.completion_tokens,
                getattr(details, "cached_tokens", None), dt, None)
    first, parts, usage = None, [], None
    for ch in server.client.chat.completions.create(
            model="m", messages=messages, temperature=0, max_tokens=tokens, stream=True,
            stream_options={"include_usage": True}):
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    return ("".join(parts), usage.completion_tokens, usage.prompt_tokens_details.cached_tokens,
            time.perf_counter() - t0, first)


def measure(server, msgs, tokens):
    """(tok/s one at a time, tok/s all at once, every answer the same)."""
    t0 = time.perf_counter()
    alone = [chat(server, m, tokens) for m in msgs]
    t_alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(msgs)) as ex:
        together = list(ex.map(lambda m: chat(server, m, tokens), msgs))
    t_together = time.perf_counter() - t0
    same = all(x[0] == y[0] for x, y in zip(alone, together))
    return (sum(x[1] for x in alone) / t_alone, sum(x[1] for x in together) / t_together, same)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def concurrency(a):
    servers = [("kvchat", Server(a.kvchat, a.model, a.threads, ["--parallel", str(a.clients)]))]
    try:
        if a.llama_server:
            servers.append(("llama-server",
                            LlamaServer(a.llama_server, a.model, a.threads, a.clients,
                                        a.llama_args.split())))
        msgs = [[{"role": "user", "content": prompt_for(i)}] for i in range(a.clients)]
        for _, s in servers:
            chat(s, msgs[0], 4)  # warm up
        rounds = {name: [] for name, _ in servers}
        for r in range(a.rounds):
            for name, s in servers:
                one, many, same = measure(s, msgs, a.tokens)
                rounds[name].append((one, many, same))
                print(f"  round {r + 1}, {name}: one at a time {one:.1f} tok/s, {a.clients} at "
                      f"once {many:.1f} tok/s ({many / one:.2f}x); same answers: {same}", file=sys.stderr)
        report = {"clients": a.clients, "tokens": a.tokens}
        for name, rs in rounds.items():
            report[name] = {"alone_tok_s": [round(x, 1) for x, _, _ in rs],
                            "together_tok_s": [round(b, 1) for _, b, _ in rs],
                            "median_ratio": round(median([b / x for x, b, _ in rs]), 2),
                            "same_answers": all(x for _, _, x in rs)}
        if a.llama_server:
            report["kvchat_over_llama_server"] = round(median(
                [k[1] / l[1] for k, l in zip(rounds["kvchat"], rounds["llama-server"])]), 2)
        return report
    finally:
        for _, s in servers:
            s.close()


def long_system():
    rules = [f"{i}. Books in section {i} are lent for {7 + i % 5} days, renewed at most "
             f"{i % 3 + 1} times, and a late book costs {10 + i} cents a day; members of the "
             f"reading club may ask the desk for one extra week." for i in range(1, 30)]
    return "You are the help desk of a public library. The lending rules:\n" + "\n".join(rules)


def prefix(a):
    s = Server(a.kvchat, a.model, a.threads, [])
    try:
        system = long_system()
        rows = []
        used = []
        for i in range(8):
            msgs = [{"role": "system", "content": system},
                    {"role": "user", "content": f"What does a late book of section {i + 3} cost?"}]
            text, n, cached, dt, first = chat(s, msgs, 16, stream=True)
            rows.append({"cached": cached, "ttft_s": round(first or dt, 3)})
            used.append(s.metric("kvchat_kv_pool_used_bytes"))
            print(f"  request {i + 1}: cached_tokens {cached}, time to first token "
                  f"{(first or dt) * 1e3:.0f} ms, pool used {used[-1] / 2**20:.1f} MiB", file=sys.stderr)
        # After the first request the pool holds its prompt's blocks: one request's KV.
        return {"requests": rows,
                "ttft_ratio": round(sum(r["ttft_s"] for r in rows[1:]) / 7 / rows[0]["ttft_s"], 3),
                "pool_used_after_first": int(used[0]), "pool_used_after_8": int(used[-1]),
                "pool_ratio": round(used[-1] / used[0], 3),
                "shared_blocks": int(s.metric("kvchat_kv_shared_blocks"))}
    finally:
        s.close()


def pressure(a):
    s = Server(a.kvchat, a.model, a.threads, ["--kv-pool", "32MiB", "--parallel", "8",
                                               "--queue", "16"])
    try:
        most = [0.0, 0.0, 0.0]
        done = threading.Event()

        def watch():
            while not done.is_set():
                most[0] = max(most[0], s.metric("kvchat_kv_pool_used_bytes"))
                most[1] = max(most[1], s.metric("kvchat_kv_allocated_bytes"))
                most[2] = max(most[2], s.metric("kvchat_running_sequences"))
                time.sleep(0.05)

        w = threading.Thread(target=watch)
        w.start()

        def one(i):
            try:
                text = prompt_for(i) * 2
                if a.pressure_answers == "short":
                    text += f" But first, in one short sentence only: what is {TOPICS[i % 8]}?"
                r = chat(s, [{"role": "user", "content": text}], a.pressure_max_tokens)
                return "ok", r[1]
            except openai.RateLimitError:
                return "429", 0

        t0 = time.perf_counter()
        n = a.pressure_requests
        with cf.ThreadPoolExecutor(n) as ex:
            results = list(ex.map(one, range(n)))
        elapsed = time.perf_counter() - t0
        done.set()
        w.join()
        ok = sum(1 for r, _ in results if r == "ok")
        busy = sum(1 for r, _ in results if r == "429")
        tokens = sum(n for _, n in results)
        preempted = s.metric("kvchat_preemptions_total")
        refed = s.metric("kvchat_recomputed_tokens_total")
        print(f"  {n} requests: {ok} answered, {busy} got 429, in {elapsed:.1f} s "
              f"({tokens / elapsed:.1f} tokens/s); pool use peaked at {most[0] / 2**20:.1f} MiB "
              f"of 32 MiB (allocated {most[1] / 2**20:.1f} MiB), at most {most[2]:.0f} "
              f"sequences at once, {preempted:.0f} preempted ({refed:.0f} positions refed)",
              file=sys.stderr)
        return {"answered": ok, "busy": busy, "seconds": round(elapsed, 1),
                "tokens_per_second": round(tokens / elapsed, 2),
                "peak_pool_bytes": int(most[0]), "peak_allocated_bytes": int(most[1]),
                "bound": 32 << 20, "within_bound": max(most[0], most[1]) <= 32 << 20,
                "most_running": int(most[2]), "preempted": int(preempted),
                "recomputed_tokens": int(refed)}
    finally:
        s.close()


def headroom(a):
    """Short answers under a long max_tokens in a small pool: what a server holds for tokens
    that are never generated decides how many answer at once."""
    s = Server(a.kvchat, a.model, a.threads, ["--kv-pool", "32MiB", "--parallel", "8"])
    try:
        most = [0.0]
        done = threading.Event()

        def watch():
            while not done.is_set():
                most[0] = max(most[0], s.metric("kvchat_running_sequences"))
                time.sleep(0.05)

        w = threading.Thread(target=watch)
        w.start()
        n = a.clients

        def one(i):
            q = f"In one short sentence, what is {TOPICS[i % len(TOPICS)]}? (question {i})"
            return chat(s, [{"role": "user", "content": q}], 1000)[1]

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(n) as ex:
            lengths = list(ex.map(one, range(n)))
        elapsed = time.perf_counter() - t0
        done.set()
        w.join()
        print(f"  {n} one-sentence answers (max_tokens 1000, 32 MiB pool): {sum(lengths)} tokens "
              f"in {elapsed:.1f} s ({sum(lengths) / elapsed:.1f} tokens/s), at most "
              f"{most[0]:.0f} at once", file=sys.stderr)
        return {"requests": n, "tokens": sum(lengths), "seconds": round(elapsed, 2),
                "tokens_per_second": round(sum(lengths) / elapsed, 2),
                "most_running": int(most[0])}
    finally:
        s.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default="concurrency,prefix,pressure")
    p.add_argument("--pressure-max-tokens", type=int, default=200,
                   help="max_tokens of the pressure part's requests (default: 200; their answers "
                        "may end sooner, and the memory a server holds for what they do not use "
                        "shows at larger values)")
    p.add_argument("--pressure-requests", type=int, default=32,
                   help="concurrent requests of the pressure part (default: 32; at most 16 wait "
                        "and 8 run, the rest get 429; 16 or fewer are all answered, the same "
                        "load for every server)")
    p.add_argument("--pressure-answers", choices=["long", "short"], default="long",
                   help="the pressure part's requests ask for a lesson (long: SmolLM2's greedy "
                        "answers run to max_tokens) or, after the same text, for one sentence "
                        "(short: 60-80 words)")
    p.add_argument("--kvchat", default=os.path.join(ROOT, "target/release/kvchat"))
    p.add_argument("--llama-server", help="llama-server's binary, for the side-by-side run")
    # -nr: on the 2-core VM this was written on, llama.cpp's AMX matmul (an "extra buffer type",
    # like the repacked weights) crashes at load (SIGSEGV in ggml_backend_amx_mul_mat); Q4_1, the
    # default model's type, has no repacked path, so -nr costs it nothing else.
    p.add_argument("--llama-args", default="-nr", help="more llama-server flags (default: -nr)")
    p.add_argument("--serve-args", default="",
                   help="more `kvchat serve` flags for every kvchat server (e.g. \"--device cuda\")")
    a = p.parse_args()
    SERVE_ARGS.extend(a.serve_args.split())
    for flag in ["clients", "pressure_requests", "pressure_max_tokens"]:
        if getattr(a, flag) < 1:
            sys.exit(f"serve-load: --{flag.replace('_', '-')} {getattr(a, flag)} is not a positive count")
    if not os.path.isfile(a.model):
        sys.exit(f"serve-load: no model file {a.model}")
    if not os.access(a.kvchat, os.X_OK):
        sys.exit(f"serve-load: no kvchat binary at {a.kvchat} (cargo build --release)")
    if a.llama_server and not os.access(a.llama_server, os.X_OK):
        sys.exit(f"serve-load: no llama-server binary at {a.llama_server} (scripts/llamacpp.sh llama-server)")
    parts = {"concurrency": concurrency, "prefix": prefix, "pressure": pressure,
             "headroom": headroom}
    report = {}
    for name in a.parts.split(","):
        if name not in parts:
            sys.exit(f"serve-load: unknown part {name} ({', '.join(parts)})")
        print(f"{name}:", file=sys.stderr)
        report[name] = parts[name](a)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
