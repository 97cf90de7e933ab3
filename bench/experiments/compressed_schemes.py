"""The two designs of a compressed all-reduce that issue 29 offered, compared on what differs between them.

Both put the same bytes on the wire (2(p-1)/p of the compressed vector per rank) and run about the same codec passes,
so what decides is the error of the result and how the passes sit on the critical path (the ring's p-1 steps each
wait for a decode-add-encode). This replays, in one process, the per-rank work of p ranks
on p random 64 MiB float32 vectors (a gradient-like spread of magnitudes):

* ``exchange`` (mpcomm/algorithms/compressed.py): encode the vector once; decode and add the p parts of one's own
  chunk; encode that sum once; decode the p gathered chunks.
* ``ring`` (recompress per hop): p-1 reduce-scatter steps of decode-the-partial, add one's own chunk, encode the new
  partial; then the all-gather's p-1 decodes (the finished chunk encoded once).

    python bench/experiments/compressed_schemes.py [--p 4] [--mib 64]

It prints the seconds of one rank's passes (min of 3) and the error of each result against the float64 sum.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from mpcomm.compression import WIRES, codec


def exchange(c, xs, p):
    """(seconds of rank 0's passes, the result every rank gets)."""
    n = xs[0].size
    bounds = np.linspace(0, n, p + 1).astype(int)
    chunk = slice(bounds[0], bounds[1])
    received = [c.encode(x[chunk]) for x in xs[1:]]  # (made by the other ranks: not timed)
    payload, acc, out = c.encode(xs[0]), np.empty(bounds[1], np.float32), np.empty(n, np.float32)
    own, finished = payload[: c.wire_nbytes(bounds[1])], np.empty(c.wire_nbytes(bounds[1]), np.uint8)
    start = time.perf_counter()  # (buffers made before, as the algorithm's scratch is)
    for (lo, hi) in zip(bounds[:-1], bounds[1:]):
        c.encode(xs[0][lo:hi], payload[c.wire_nbytes(lo):c.wire_nbytes(hi)] if c.block == 1 else None)
    c.decode(own, acc)
    for part in received:
        c.accumulate(part, acc)
    c.encode(acc, finished)
    c.decode(payload, out)  # the gathered chunks' decode
    seconds = time.perf_counter() - start
    result = np.concatenate([c.roundtrip(sum(c.roundtrip(x[bounds[k]:bounds[k + 1]]) for x in xs))
                             for k in range(p)])
    return seconds, result


def ring(c, xs, p):
    """(seconds of one rank's passes, the result): p-1 steps of decode the partial, add one's chunk, encode."""
    n = xs[0].size
    bounds = np.linspace(0, n, p + 1).astype(int)
    step = slice(bounds[0], bounds[1])
    partials = [c.encode(xs[0][step])] * (p - 1)  # (received: not timed)
    gathered, acc, out = c.encode(xs[0]), np.empty(bounds[1], np.float32), np.empty(n, np.float32)
    sent = np.empty(c.wire_nbytes(bounds[1]), np.uint8)
    start = time.perf_counter()
    c.encode(xs[0][step], sent)  # the first step sends one's own chunk
    for partial, x in zip(partials, xs[1:]):
        c.decode(partial, acc)
        acc += x[step]
        c.encode(acc, sent)
    c.decode(gathered, out)  # the all-gather's decodes
    seconds = time.perf_counter() - start
    result = []
    for k in range(p):
        chunk = slice(bounds[k], bounds[k + 1])
        acc = xs[0][chunk].copy()
        for x in xs[1:]:
            acc = c.roundtrip(acc) + x[chunk]
        result.append(c.roundtrip(acc))
    return seconds, np.concatenate(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.mib * 2**20 // 4
    xs = [(rng.standard_normal(n) * np.exp(rng.uniform(-4, 4, n))).astype(np.float32) for _ in range(args.p)]
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    scale = np.abs(exact).mean()
    print(f"p = {args.p}, {args.mib} MiB float32 per rank; error = mean |result - exact| / mean |exact|")
    for wire in WIRES:
        c = codec(wire)
        for name, scheme in (("exchange", exchange), ("ring", ring)):
            runs = [scheme(c, xs, args.p) for _ in range(3)]
            error = np.abs(runs[0][1] - exact).mean() / scale
            print(f"{wire:5s} {name:9s} one rank's passes {min(r[0] for r in runs) * 1e3:7.1f} ms   error {error:.2e}")


if __name__ == "__main__":
    main()
