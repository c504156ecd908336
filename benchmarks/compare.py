"""What comparing one large output costs: `metrics.output_error` on a language model's logits (16 sentences of
60 tokens over GPT-2's 50,257 entries: 48 M numbers, a float32 output against its float64 reference), in time
as a multiple of one float64 pass over the output (the reference's norm), and in memory beyond the two tensors
(peak RSS of a fresh child process over the same process before the compare). Goal: no buffer the output's size,
i.e. at most 0.25x the float64 output's bytes more. The compare runs over chunks of whole rows
(`metrics.CHUNK`); ``--chunk`` tries another size.

    .venv/bin/python benchmarks/compare.py [--rows 960] [--vocab 50257] [--threads 1] [--chunk N]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from _common import WALL, header

GOAL = 0.25


def _child(rows: int, vocab: int, threads: int, chunk: int) -> dict:
    torch.set_num_threads(threads)
    from tf32lab.numbers import metrics

    if chunk:
        metrics.CHUNK = chunk
    g = torch.Generator().manual_seed(0)
    r = torch.randn(rows, vocab, dtype=torch.float64, generator=g)
    y = (r + 1e-4 * torch.randn(rows, vocab, dtype=torch.float64, generator=g)).float()
    float(torch.linalg.vector_norm(r))  # pages of both touched before the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = {"pass": [], "compare": []}
    for _ in range(3):
        start = time.perf_counter()
        float(torch.linalg.vector_norm(r))
        times["pass"].append(time.perf_counter() - start)
        start = time.perf_counter()
        metrics.output_error("logits", y, r)
        times["compare"].append(time.perf_counter() - start)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"pass": min(times["pass"]), "compare": min(times["compare"]), "grown": grown, "bytes": r.numel() * 8}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=960)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.rows, args.vocab, args.threads, args.chunk)))
        return 0
    torch.set_num_threads(args.threads)  # as the child runs
    header(f"output compare: {args.rows} x {args.vocab} logits, in a fresh process", WALL)
    done = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], capture_output=True, text=True,
                          check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    grown = found["grown"] / found["bytes"]
    ok = grown <= GOAL
    print(f"compare {found['compare']:.2f} s = {found['compare'] / found['pass']:.0f}x one float64 pass over the "
          f"output ({found['pass'] * 1e3:.0f} ms)")
    print(f"{'PASSED' if ok else 'FAILED'} | memory beyond the output and its reference: "
          f"{found['grown'] / 2**20:.0f} MiB = {grown:.2f}x the float64 output's {found['bytes'] / 2**20:.0f} MiB "
          f"(goal <= {GOAL}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
