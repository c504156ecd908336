"""Check tf32lab.numbers.formats on every float32 bit pattern against the integer reference (tests/reference.py).

    python scripts/sweep_formats.py                 # all 2**32 patterns, every function and mode
    python scripts/sweep_formats.py --start 0x7F7F0000 --count 0x20000 --workers 1   # a slice

Prints one line per function: mismatches (NaN matches NaN, whatever the payload) and the first few
mismatching patterns, then the time taken. Exit code 1 if anything mismatched.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import reference as R
from tf32lab.numbers import formats

CHUNK = 1 << 16  # patterns per step: numpy's temporaries stay in cache


def _cases():
    """name -> (implementation on a float32 tensor, reference on int64 patterns); splits give two outputs."""
    np_ops = R.NumpyOps
    cases = {}
    for mode in formats.ROUNDINGS:
        cases[f"round_tf32 {mode}"] = (
            lambda x, m=mode: (formats.round_tf32(x, m),),
            lambda u, m=mode: (R.ref_round_tf32(u, m, np_ops),),
        )
        cases[f"round_bf16 {mode}"] = (
            lambda x, m=mode: (formats.round_bf16(x, m),),
            lambda u, m=mode: (R.ref_round_bf16(u, m, np_ops),),
        )
    cases["round_fp16"] = (lambda x: (formats.round_fp16(x),), lambda u: (R.ref_round_fp16(u, np_ops),))
    cases["split_bf16x3"] = (formats.split_bf16x3, lambda u: R.ref_split_bf16x3(u, np_ops))
    cases["split_tf32x3"] = (formats.split_tf32x3, lambda u: R.ref_split_tf32x3(u, np_ops))
    cases["split_bf16x9"] = (formats.split_bf16x9, lambda u: R.ref_split_bf16x9(u, np_ops))
    return cases


CASES = _cases()


def _mismatches(got: torch.Tensor, want: np.ndarray) -> np.ndarray:
    bits = got.numpy().view(np.uint32).astype(np.int64)
    nan_got = (bits & 0x7FFFFFFF) > 0x7F800000
    nan_want = (want & 0x7FFFFFFF) > 0x7F800000
    return ~((bits == want) | (nan_got & nan_want))


def check_chunk(bounds: tuple[int, int]) -> dict[str, tuple[int, list[int]]]:
    start, stop = bounds
    u = np.arange(start, stop, dtype=np.int64)
    x = torch.from_numpy(u.astype(np.uint32).view(np.float32))
    out = {}
    for name, (impl, ref) in CASES.items():
        bad = np.zeros(u.shape, dtype=bool)
        for got, want in zip(impl(x), ref(u)):
            bad |= _mismatches(got, want)
        out[name] = (int(bad.sum()), [int(v) for v in u[bad][:3]])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=lambda s: int(s, 0), default=0)
    parser.add_argument("--count", type=lambda s: int(s, 0), default=1 << 32)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--only", default="", help="comma-separated cases, e.g. 'split_tf32x3,round_tf32 rne'")
    args = parser.parse_args(argv)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",")]
        unknown = [name for name in wanted if name not in CASES]
        if unknown:
            parser.error(f"unknown case {unknown[0]!r}; accepted: {', '.join(map(repr, CASES))}")
        for name in list(CASES):
            if name not in wanted:
                del CASES[name]
    stop = min(args.start + args.count, 1 << 32)
    if args.start < 0 or args.start >= stop:
        parser.error(f"empty range: --start {args.start:#x} --count {args.count:#x}")
    chunks = [(s, min(s + CHUNK, stop)) for s in range(args.start, stop, CHUNK)]
    torch.set_num_threads(1)
    totals = {name: 0 for name in CASES}
    examples: dict[str, list[int]] = {name: [] for name in CASES}
    began = time.perf_counter()
    with Pool(args.workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        for i, result in enumerate(pool.imap_unordered(check_chunk, chunks, chunksize=8), 1):
            for name, (count, first) in result.items():
                totals[name] += count
                examples[name] = (examples[name] + first)[:3]
            if i % 4096 == 0:
                done = i / len(chunks)
                elapsed = time.perf_counter() - began
                print(f"  {done:6.1%}  {elapsed:7.0f} s elapsed, ~{elapsed / done - elapsed:6.0f} s left", flush=True)
    elapsed = time.perf_counter() - began
    patterns = stop - args.start
    print(f"patterns {args.start:#010x}..{stop - 1:#010x} ({patterns} of each), torch {torch.__version__}")
    for name in CASES:
        shown = ", ".join(f"{v:#010x}" for v in examples[name])
        print(f"{name:<16} mismatches {totals[name]}" + (f"  e.g. {shown}" if shown else ""))
    print(f"time {elapsed:.0f} s with {args.workers} worker(s)")
    return 1 if any(totals.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
