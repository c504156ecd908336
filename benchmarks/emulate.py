"""What emulation costs, as ratios to the native float32 computation timed in the same run (A/B interleaved).

    python benchmarks/emulate.py [--quick]

1. TF32 emulation (``precision("high"), emulate("a100")``) of a 2048 x 2048 float32 GEMM (goal: <= 1.10x);
2. bf16x3 emulation of the same GEMM (``emulate(math="bf16x3")``: three GEMMs; goal: <= 3.3x);
3. all-MiniLM-L6-v2 encoding 64 sentences under TF32 emulation (goal: <= 1.15x);
4. an LSTM speaker encoder (3 layers, hidden 256, 8 x 160 frames of 40 mel bands) under TF32 emulation: cuDNN's
   RNN kernel rounds the hidden state at every step, so the recurrence is re-expressed step by step (goal: <= 1.5x),
   and its forward and backward (the sum of the output as the loss, the backward inside the block; goal: <= 1.5x);
5. a GRU of the same shape, likewise (goals: <= 1.5x);
6. ``accumulation="hardware"`` (each GEMM summed as the A100's tensor cores do, bit for bit): a 512 x 512 x 512
   TF32 GEMM (goal: <= 20x) and all-MiniLM-L6-v2 as in 3 (goal: <= 10x). Compiled kernels need numba
   (``pip install tf32lab[fast]``); the ratio is printed with which code ran. Every row is timed on one thread,
   numba's kernels included (before 2026-11-26 they ran on all cores against a one-thread native side). The
   GEMM's two compiled kernels (32-bit and float64) are also printed side by side.

``--hardware`` runs only 6, ``--rnn`` only 4 and 5, ``--minilm`` only 3. ``--cpu`` adds to 3, 4, 5 and 6 the CPU time
per call with one thread each (torch and numba; interleaved medians): the work itself, which a shared machine's load
does not inflate (informative, no goal).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch
from _common import header, interleaved

import tf32lab
from tf32lab.numbers import formats
from tf32lab.workloads import samples

GOALS = {"gemm tf32": 1.10, "gemm bf16x3": 3.3, "minilm tf32": 1.15, "lstm tf32": 1.5, "lstm tf32 fwd+bwd": 1.5,
         "gru tf32": 1.5, "gru tf32 fwd+bwd": 1.5, "gemm512 hardware": 20.0, "minilm hardware": 10.0}


def emulated(fn, **options):
    def run():
        with tf32lab.precision("high"), tf32lab.emulate("a100", **options):
            return fn()

    return run


def one_thread_cpu(variants: dict, rounds: int) -> dict[str, float]:
    """Median CPU seconds per call of each variant with one torch and one numba thread, timed in turn."""
    try:
        import numba
    except ImportError:  # the tensor code: torch's threads only
        numba = None
    threads = torch.get_num_threads(), numba.get_num_threads() if numba else 0
    torch.set_num_threads(1)
    if numba:
        numba.set_num_threads(1)
    try:
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                start = time.process_time()
                fn()
                seconds[name].append(time.process_time() - start)
    finally:
        torch.set_num_threads(threads[0])
        if numba:
            numba.set_num_threads(threads[1])
    return {name: statistics.median(values) for name, values in seconds.items()}


def print_cpu(what: str, variants: dict, rounds: int) -> None:
    if "--cpu" in sys.argv:
        cpu = one_thread_cpu(variants, rounds)
        name = next(name for name in variants if name != "native")
        print(f"{what}, CPU time with one thread each: {name} {cpu[name] * 1e3:.1f} ms / native "
              f"{cpu['native'] * 1e3:.2f} ms = {cpu[name] / cpu['native']:.2f}x")


@contextlib.contextmanager
def numba_threads(count: int):
    """numba's kernels on ``count`` threads, as the native side gets from the Timer: like against like."""
    try:
        import numba
    except ImportError:
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(count)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def hardware_rows(rounds: int, model=None) -> dict[str, float]:
    with numba_threads(1):
        return _hardware_rows(rounds, model)


def _hardware_rows(rounds: int, model=None) -> dict[str, float]:
    from tf32lab.numbers import accumulation

    code = "compiled (numba, one thread)" if accumulation.compiled() else "tensor code (no numba)"
    torch.manual_seed(0)
    a, b = torch.randn(512, 512), torch.randn(512, 512)

    def gemm():
        return a @ b

    emulated(gemm, accumulation="hardware")()  # compiles the kernels once, outside the timing
    times = interleaved({"native": gemm, "hardware": emulated(gemm, accumulation="hardware")}, rounds=rounds,
                        number=1)
    ratios = {"gemm512 hardware": times["hardware"] / times["native"]}
    print(f"512^3 GEMM native {times['native'] * 1e3:.2f} ms, hardware accumulation: {code}")
    if accumulation.compiled():
        print_kernels(a, b, rounds)
    print_cpu("512^3 GEMM", {"native": gemm, "hardware": emulated(gemm, accumulation="hardware")}, rounds)
    model = model or samples.minilm()
    sentences = list(samples.SENTENCES)

    def encode():
        return model.encode(sentences, batch_size=64, convert_to_tensor=True)

    times = interleaved({"native": encode, "hardware": emulated(encode, accumulation="hardware")},
                        rounds=max(2, rounds // 3), number=1)
    ratios["minilm hardware"] = times["hardware"] / times["native"]
    print(f"MiniLM 64 sentences native {times['native'] * 1e3:.1f} ms, hardware accumulation: {code}")
    print_cpu("MiniLM", {"native": encode, "hardware": emulated(encode, accumulation="hardware")}, max(2, rounds // 3))
    return ratios


def rnn_rows(rounds: int) -> dict[str, float]:
    """The LSTM and GRU speaker encoders, forward alone (inference mode) and forward and backward."""
    torch.manual_seed(0)
    frames = torch.randn(8, 160, 40)
    ratios = {}
    for name, rnn in (("lstm", torch.nn.LSTM(40, 256, 3, batch_first=True).eval()),
                      ("gru", torch.nn.GRU(40, 256, 3, batch_first=True).eval())):
        def speaker(rnn=rnn):
            with torch.inference_mode():
                return rnn(frames)

        def trained(rnn=rnn):
            x = frames.clone().requires_grad_()
            rnn(x)[0].sum().backward()
            rnn.zero_grad(set_to_none=True)

        for row, fn in ((f"{name} tf32", speaker), (f"{name} tf32 fwd+bwd", trained)):
            variants = {"native": fn, "tf32": emulated(fn)}
            times = interleaved(variants, rounds=rounds * 2, number=1)
            ratios[row] = times["tf32"] / times["native"]
            what = f"{name.upper()} 3x256, 8 x 160 frames{' forward and backward' if 'bwd' in row else ''}"
            print(f"{what} native {times['native'] * 1e3:.1f} ms")
            print_cpu(what, variants, rounds * 2)
    return ratios


def print_kernels(a: torch.Tensor, b: torch.Tensor, rounds: int) -> None:
    """The 512^3 GEMM's two compiled kernels side by side (TF32 operands, the A100's unit): the 32-bit one that
    the emulator's rounded operands reach, and the float64 one that unrounded operands and values outside the
    32-bit range fall back on (informative, no goal)."""
    from tf32lab.numbers import accumulation, accumulation_kernels, formats

    x, y = formats.round_tf32(a)[None].numpy(), formats.round_tf32(b)[None].numpy()
    c = torch.zeros(1, 512, 512).numpy()
    model = accumulation.AMPERE
    kernels = {"32-bit": lambda: accumulation_kernels.nvidia_gemm_narrow(x, y, c, 4, model.fraction_bits, 512, 512),
               "float64": lambda: accumulation_kernels.nvidia_gemm(x, y, c, 4, model.fraction_bits, 512, 512, True)}
    times = interleaved(kernels, rounds=rounds, number=1)
    print(f"512^3 GEMM kernels: 32-bit {times['32-bit'] * 1e3:.1f} ms ({times['32-bit'] / 512**3 * 1e9:.3f} ns a "
          f"product), float64 {times['float64'] * 1e3:.1f} ms: {times['float64'] / times['32-bit']:.2f}x")


def main() -> int:
    quick = "--quick" in sys.argv
    header("emulate(): cost against native float32")
    # the steady state of a long run: the compiled rounding kernel loaded (a short run rounds with the tensor code)
    print("operand rounding: " + ("compiled (numba)" if formats.load_compiled() else "tensor code (no numba)"))
    rounds = 3 if quick else 9
    if "--hardware" in sys.argv:
        return verdicts(hardware_rows(rounds))
    if "--rnn" in sys.argv:
        return verdicts(rnn_rows(rounds))
    if "--minilm" in sys.argv:
        return verdicts(minilm_rows(rounds)[0])
    torch.manual_seed(0)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)

    def gemm():
        return a @ b

    times = interleaved({"native": gemm, "tf32": emulated(gemm), "bf16x3": emulated(gemm, math="bf16x3")},
                        rounds=rounds, number=1)
    ratios = {"gemm tf32": times["tf32"] / times["native"], "gemm bf16x3": times["bf16x3"] / times["native"]}
    print(f"2048^2 GEMM native {times['native'] * 1e3:.1f} ms")

    minilm, model = minilm_rows(rounds)
    ratios.update(minilm)
    ratios.update(rnn_rows(rounds))
    ratios.update(hardware_rows(rounds, model))
    return verdicts(ratios)


def minilm_rows(rounds: int) -> tuple[dict[str, float], object]:
    """all-MiniLM-L6-v2 encoding 64 sentences, native and under TF32 emulation; the ratio, and the model."""
    model = samples.minilm()
    sentences = list(samples.SENTENCES)

    def encode():
        return model.encode(sentences, batch_size=64, convert_to_tensor=True)

    times = interleaved({"native": encode, "tf32": emulated(encode)}, rounds=rounds, number=1)
    print(f"MiniLM 64 sentences native {times['native'] * 1e3:.1f} ms")
    print_cpu("MiniLM 64 sentences", {"native": encode, "tf32": emulated(encode)}, rounds)
    return {"minilm tf32": times["tf32"] / times["native"]}, model


def verdicts(ratios: dict[str, float]) -> int:
    failed = 0
    for name, ratio in ratios.items():
        ok = ratio <= GOALS[name]
        failed += not ok
        print(f"{'PASSED' if ok else 'FAILED'} | {name}: {ratio:.3f}x native (goal <= {GOALS[name]}x)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
