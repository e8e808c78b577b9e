#!/usr/bin/env python3
"""Perplexities of logits files of the same text, and each pair's difference with two error bars.

    scripts/kld-chunks.py NAME=FILE.kld NAME=FILE.kld [...]

Each FILE is a logits file (llama-perplexity --kl-divergence-base FILE, or kvchat ppl
--kl-divergence-base FILE) over the same tokens: the script checks that their headers and tokens
agree. For every file it prints the perplexity of the stored distributions (each token's
log-probability as stored: rounded to 16/65,535 nats, and floored 16 nats below the top one, as
llama-perplexity's --kl-divergence reads it), and for every pair the difference
ln(PPL(a)/PPL(b)) in percent with two standard errors:

- per token: the tokens as independent samples (what llama-perplexity's and kvchat's paired
  figures assume);
- per chunk: the chunks' mean differences as the samples. A rounding flipped early in a chunk
  changes every later token of that chunk, so the tokens of one chunk are not independent; the
  chunk-level error bar counts that.

Reads only each scored token's own entry (seeks), so it needs no numpy and little memory.
"""
import math
import struct
import sys


def read(path):
    with open(path, "rb") as f:
        head = f.read(20)
        if len(head) < 20 or head[:8] != b"_logits_":
            sys.exit(f"{path}: not a logits file")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", head[8:])
        tokens = struct.unpack(f"<{n_chunk * n_ctx}i", f.read(4 * n_chunk * n_ctx))
        nv = 2 * ((n_vocab + 1) // 2) + 4
        first = n_ctx // 2
        per_chunk = n_ctx - 1 - first
        start = 20 + 4 * n_chunk * n_ctx
        chunks = []
        for c in range(n_chunk):
            nll = []
            for j in range(per_chunk):
                row = start + 2 * nv * (c * per_chunk + j)
                f.seek(row)
                scale, floor = struct.unpack("<ff", f.read(8))
                tok = tokens[c * n_ctx + first + j + 1]
                f.seek(row + 8 + 2 * tok)
                (q,) = struct.unpack("<H", f.read(2))
                nll.append(-(scale * q + floor))
            chunks.append(nll)
    return (n_ctx, n_vocab, n_chunk, tokens), chunks


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    runs = []
    for arg in sys.argv[1:]:
        name, _, path = arg.rpartition("=")
        header, chunks = read(path)
        if runs and header != runs[0][1]:
            sys.exit(f"{path}: another text, chunking or vocabulary than {runs[0][0]}")
        runs.append((name or path, header, chunks))
    n_ctx, _, n_chunk, _ = runs[0][1]
    print(f"{n_chunk} chunks of {n_ctx}, {n_chunk * (n_ctx - 1 - n_ctx // 2)} scored tokens")
    for name, _, chunks in runs:
        allnll = [x for c in chunks for x in c]
        print(f"  {name:28} ppl {math.exp(sum(allnll) / len(allnll)):10.4f}")
    print(f"  {'a vs b':40} {'ln(PPL a/PPL b)':>16} {'± per token':>12} {'± per chunk':>12}")
    for i, (a, _, ca) in enumerate(runs):
        for b, _, cb in runs[i + 1 :]:
            d_tok = [x - y for u, v in zip(ca, cb) for x, y in zip(u, v)]
            d_chunk = [sum(x - y for x, y in zip(u, v)) / len(u) for u, v in zip(ca, cb)]
            m, se_tok = mean_se(d_tok)
            _, se_chunk = mean_se(d_chunk)
            print(f"  {a + ' vs ' + b:40} {100 * m:+15.3f}% {100 * se_tok:11.3f}% {100 * se_chunk:11.3f}%")


if __name__ == "__main__":
    main()
