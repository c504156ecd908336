"""Where MiniLM's TF32 emulation cost goes: the same run with parts of the emulation switched off in turn.

    python benchmarks/emulate_budget.py [--rounds N]

all-MiniLM-L6-v2 encoding 64 sentences under ``precision("high"), emulate("a100")`` as ``benchmarks/emulate.py``
row 3 times it, against native float32, and with (a) the linear layers' operand rounding switched off, (b) the
attention rules switched off (PyTorch's fused kernel runs natively), (c) both. The differences are what each part
costs; what is left in (c) is every op's way through the emulator's modes. A diagnostic, no goal: it reaches into
the emulator's private tables (its rounding functions, its rules and their cache), which it restores on exit.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

import tf32lab
from tf32lab.emulation import emulator, rules
from tf32lab.numbers import formats
from tf32lab.workloads import samples


@contextlib.contextmanager
def switched_off(rounding: bool, attention: bool):
    """The emulator with the linear layers' TF32 rounding and/or its attention rules left out, put back after."""
    saved_round = dict(emulator._SINGLE_ROUND)
    ops = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, torch.ops.aten.scaled_dot_product_attention,
           torch.ops.tf32lab.scaled_dot_product_attention]
    saved_rules = {op: rules.RULES[op] for op in ops if op in rules.RULES}
    try:
        if rounding:
            emulator._SINGLE_ROUND["tf32"] = lambda x, rounding=None, out=None: x
        if attention:
            for op in saved_rules:
                del rules.RULES[op]
        emulator._TREATMENTS.clear()  # the rules each op gets are cached per op
        yield
    finally:
        emulator._SINGLE_ROUND.update(saved_round)
        rules.RULES.update(saved_rules)
        emulator._TREATMENTS.clear()


def main() -> int:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 7
    torch.set_num_threads(1)
    print(f"emulate(): where MiniLM's TF32 emulation cost goes\ntorch {torch.__version__}; one torch thread, wall "
          f"clock, interleaved medians of {rounds}")
    formats.load_compiled()
    model, sentences = samples.minilm(), list(samples.SENTENCES)

    def encode():
        return model.encode(sentences, batch_size=64, convert_to_tensor=True)

    variants = {"native": None, "emulated": (False, False), "no rounding": (True, False),
                "no attention": (False, True), "neither": (True, True)}

    def run(parts):
        if parts is None:
            return encode()
        with switched_off(*parts), tf32lab.precision("high"), tf32lab.emulate("a100"):
            return encode()

    for parts in variants.values():  # warm up
        run(parts)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, parts in variants.items():
            started = time.perf_counter()
            run(parts)
            times[name].append(time.perf_counter() - started)
    native = statistics.median(times["native"])
    for name, values in times.items():
        print(f"{name:<14} {statistics.median(values) * 1e3:8.1f} ms  {statistics.median(values) / native:6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
