"""What a precision() scope costs.

    python benchmarks/scope.py

1. enter+exit of one scope (main thread, no other scope live: the common case) as a ratio to a pair of
   torch.set_float32_matmul_precision calls timed in the same run, interleaved (goal: <= 15x; a verdict line,
   PASSED or FAILED, and the exit status 0 or 1);
2. the same in a worker thread, which pushes its guard (a TorchDispatchMode) at entry;
3. what the guard adds to an op: a small matmul inside a worker's scope, alone and while another thread holds a
   different level (contended: ops of the flag-sensitive families take the process lock).
"""

from __future__ import annotations

import sys
import threading

import torch
from _common import header, interleaved

from tf32lab import precision
from tf32lab.control import flags

GOAL = 15.0


def in_thread(fn):
    """Run fn in a fresh thread and return its result."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    return out["r"]


def main() -> int:
    before = flags.snapshot()
    p = precision("high")

    def scope() -> None:
        with p:
            pass

    def pair() -> None:
        torch.set_float32_matmul_precision("high")
        torch.set_float32_matmul_precision("highest")

    header("scope: interleaved, medians of 15 rounds")
    t = interleaved({"scope": scope, "set pair": pair}, rounds=15, number=20000)
    ratio = t["scope"] / t["set pair"]
    print(f"scope enter+exit        {t['scope'] * 1e6:6.2f} us")
    print(f"pair of set calls       {t['set pair'] * 1e6:6.2f} us")
    print(f"ratio                   {ratio:6.1f}x (goal <= {GOAL:g}x)")

    tw = in_thread(lambda: interleaved({"scope": scope, "set pair": pair}, rounds=7, number=5000))
    worker_ratio = tw["scope"] / tw["set pair"]
    print(f"in a worker thread      {tw['scope'] * 1e6:6.2f} us ({worker_ratio:.1f}x): the guard is pushed and popped")

    a, b = torch.randn(16, 64), torch.randn(64, 64)

    def plain_mm() -> None:
        torch.mm(a, b)

    def scoped_mm_worker() -> dict[str, float]:
        with precision("high"):
            return interleaved({"guarded": plain_mm}, rounds=7, number=2000)

    base = interleaved({"mm": plain_mm}, rounds=7, number=2000)["mm"]
    alone = in_thread(scoped_mm_worker)["guarded"]
    hold, release = threading.Event(), threading.Event()

    def other() -> None:
        with precision("medium"):
            hold.set()
            release.wait()

    holder = threading.Thread(target=other)
    holder.start()
    hold.wait()
    contended = in_thread(scoped_mm_worker)["guarded"]
    release.set()
    holder.join()
    print(f"16x64 @ 64x64 mm        {base * 1e6:6.2f} us unscoped")
    print(f"  in a worker's scope   {alone * 1e6:6.2f} us (+{(alone - base) * 1e6:.1f} us: guard, agreed)")
    extra = (contended - base) * 1e6
    print(f"  while levels differ   {contended * 1e6:6.2f} us (+{extra:.1f} us: guard, lock, two flag writes)")
    flags.restore(before)
    ok = ratio <= GOAL
    print(f"{'PASSED' if ok else 'FAILED'} | scope enter+exit: {ratio:.1f}x a pair of set calls (goal <= {GOAL:g}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
