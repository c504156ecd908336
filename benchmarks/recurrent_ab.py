"""An older ``emulation/recurrent.py`` against the current one, in one process: the LSTM rows of ``emulate.py --rnn``.

    python benchmarks/recurrent_ab.py OLD_RECURRENT_PY [--rounds N]

``OLD_RECURRENT_PY`` is the older module's file (``git show REV:src/tf32lab/emulation/recurrent.py > old.py``); it
is loaded beside the current one and put in the emulator's place for its turns. Native, old and new run in turn,
``N`` rounds (default 25), each call timed by its CPU time on one thread and by the wall clock; the median and the
minimum of each are printed as ratios to native. On a shared machine the ratios of separate runs (``emulate.py``)
scatter by several tenths; here all three meet the same load, and the minimum is the least disturbed call.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch
from _common import header

import tf32lab
from tf32lab.emulation import recurrent, rules
from tf32lab.numbers import formats


def load(path: str):
    spec = importlib.util.spec_from_file_location("recurrent_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__)
        return 2
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 25
    before = load(sys.argv[1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        header("emulate(): an older recurrent.py against the current one", "wall")
        print("operand rounding: " + ("compiled (numba)" if formats.load_compiled() else "tensor code (no numba)"))
        torch.manual_seed(0)
        frames = torch.randn(8, 160, 40)
        lstm = torch.nn.LSTM(40, 256, 3, batch_first=True).eval()

        def forward():
            with torch.inference_mode():
                return lstm(frames)

        def trained():
            x = frames.clone().requires_grad_()
            lstm(x)[0].sum().backward()
            lstm.zero_grad(set_to_none=True)

        def emulated(fn, module):
            def run():
                rules.recurrent = module
                with tf32lab.precision("high"), tf32lab.emulate("a100"):
                    return fn()

            return run

        for row, fn in (("LSTM forward", forward), ("LSTM forward and backward", trained)):
            variants = {"native": fn, "old": emulated(fn, before), "new": emulated(fn, recurrent)}
            for run in variants.values():  # warm up
                run()
            cpu: dict[str, list[float]] = {name: [] for name in variants}
            wall: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(rounds):
                for name, run in variants.items():
                    start, clock = time.thread_time(), time.perf_counter()
                    run()
                    cpu[name].append(time.thread_time() - start)
                    wall[name].append(time.perf_counter() - clock)
            for stat in (statistics.median, min):
                c = {name: stat(v) for name, v in cpu.items()}
                w = {name: stat(v) for name, v in wall.items()}
                print(f"{row}, {stat.__name__}: CPU time native {c['native'] * 1e3:.1f} ms, old "
                      f"{c['old'] / c['native']:.3f}x, new {c['new'] / c['native']:.3f}x; wall native "
                      f"{w['native'] * 1e3:.1f} ms, old {w['old'] / w['native']:.3f}x, "
                      f"new {w['new'] / w['native']:.3f}x")
    finally:
        rules.recurrent = recurrent
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
