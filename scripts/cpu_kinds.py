"""Run chosen tests as other CPU kinds would: each under the instruction sets PyTorch's libraries may be held to.

    python scripts/cpu_kinds.py --bits                       # do the settings change float32 bits here?
    python scripts/cpu_kinds.py tests/test_generation.py::test_the_kv_cache_on_or_off_gives_the_same_answer

A test that holds "on every CPU kind" must not depend on which kernels a CPU runs: AVX2, AVX-512 and AMX machines
sum float32 products and reductions in other orders, and give other bits. One machine can run the kernels of a
*lower* instruction set than it has, which is how this script stands in for other kinds:

- ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``): which of ATen's vectorized kernels run (softmax,
  layer_norm, reductions, elementwise maths, SDPA's CPU kernel; PyTorch's README and
  ``aten/src/ATen/native/DispatchStub.cpp``);
- ``ONEDNN_MAX_CPU_ISA`` (``SSE41``, ``AVX2``, ``AVX512_CORE_BF16``, ``AVX512_CORE_AMX``, ...): oneDNN's
  kernels (convolutions); oneDNN's docs, "CPU Dispatcher Control";
- ``MKL_ENABLE_INSTRUCTIONS`` (``SSE4_2``, ``AVX2``, ``AVX512``): MKL's kernels; oneMKL's developer guide,
  "Instruction Set Specific Dispatching on Intel Architectures", which says the variable has no effect on
  non-Intel processors (on an AMD EPYC it changed no bit).

Each only lowers what the CPU has (asking for AVX-512 on an AVX2 CPU runs AVX2). ``--bits`` first shows whether a
setting changes float32 results at all on this machine (a hash of a few ops' outputs per setting): where it does
not, a test passing under it proves nothing more than the plain run. Then each test runs under each setting in a
fresh pytest process, and a table says which passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> the environment that holds the libraries to an instruction set ({}: as this CPU runs them)
SETTINGS: dict[str, dict[str, str]] = {
    "native": {},
    # an AVX-512 CPU without AMX, stood in for on an AMX one
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    # ATen's AVX-512 kernels beside MKL's AVX2 ones: MKL picks its code path by the CPU's vendor as well as its
    # instruction sets (oneMKL's developer guide, as above), so an AVX-512 CPU may run this mix
    "avx512-mkl-avx2": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "sse4": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    # one library at a time, to tell which one changes the bits
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "onednn-sse41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "mkl-sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
TEST_SETTINGS = ("native", "avx2", "sse4")
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")

# run in a child under each setting: a hash of each op's output bits (float32, and two float64 ones: the tests
# train in float64), and the capability ATen reports
_PROBE = r"""
import hashlib, json, torch
torch.manual_seed(0)
a, b = torch.randn(67, 301), torch.randn(301, 45)
x = torch.randn(4, 9, 64)
q, k, v = torch.randn(3, 2, 4, 17, 16).unbind(0)
img, weight = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
ops = {
    "mm": lambda: a @ b,
    "bmm": lambda: torch.bmm(x, x.transpose(1, 2)),
    "softmax": lambda: torch.softmax(x * 3, -1),
    "layer_norm": lambda: torch.nn.functional.layer_norm(x, (64,)),
    "sum": lambda: x.sum(-1),
    "exp, tanh": lambda: torch.exp(x) + torch.tanh(x),
    "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    "conv2d": lambda: torch.nn.functional.conv2d(img, weight),
    "mm float64": lambda: a.double() @ b.double(),
    "tanh float64": lambda: torch.tanh(x.double() * 3),
}
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  **{name: hashlib.sha256(op().contiguous().numpy().tobytes()).hexdigest()[:10]
                     for name, op in ops.items()}}))
"""


def _env(setting: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ISA_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return {**env, **SETTINGS[setting]}


def bits(settings: list[str]) -> dict[str, dict[str, str]]:
    """Each setting's hashes of a few float32 ops' outputs (a fresh interpreter each: the libraries read their
    variables once)."""
    found = {}
    for setting in settings:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=_env(setting), capture_output=True, text=True,
                              check=True)
        found[setting] = json.loads(done.stdout)
    return found


def print_bits(found: dict[str, dict[str, str]]) -> None:
    base = found["native"]
    names = list(base)
    print(f"{'op':<20}" + "".join(f"{s:>14}" for s in found))
    for name in names:
        cells = [found[s][name] if name == "capability" else
                 ("same" if found[s][name] == base[name] else "DIFFERS") for s in found]
        print(f"{name:<20}" + "".join(f"{c:>14}" for c in cells))


def run_tests(tests: list[str], settings: list[str]) -> dict[tuple[str, str], str]:
    """Each test under each setting, one fresh pytest process per pair: 'passed', 'failed' or 'skipped'."""
    results = {}
    for test in tests:
        for setting in settings:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                                   "no:randomly", test], env=_env(setting), capture_output=True, text=True,
                                  cwd=ROOT)
            last = (done.stdout.strip().splitlines() or ["?"])[-1]
            results[test, setting] = ("passed" if done.returncode == 0 and "skipped" not in last else
                                      "skipped" if done.returncode == 0 else f"FAILED (exit {done.returncode})")
            print(f"{setting:>12}  {results[test, setting]:<16} {test}  [{last}]", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", help="pytest node ids or files, each run under every setting")
    parser.add_argument("--bits", action="store_true", help="first show which settings change float32 bits")
    parser.add_argument("--settings", default=",".join(TEST_SETTINGS),
                        help=f"comma-separated, of: {', '.join(SETTINGS)} (default: %(default)s)")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {unknown[0]!r}: one of {', '.join(SETTINGS)}")
    import torch

    print(f"{platform.processor() or platform.machine()}, {_cpu_name()}, torch {torch.__version__}")
    if args.bits:
        print_bits(bits(["native", *[s for s in SETTINGS if s != "native"]]))
    if not args.tests:
        return 0
    results = run_tests(args.tests, settings)
    print()
    width = max(len(t) for t in args.tests)
    print(f"{'test':<{width}}" + "".join(f"  {s:<16}" for s in settings))
    for test in args.tests:
        print(f"{test:<{width}}" + "".join(f"  {results[test, s]:<16}" for s in settings))
    return 0 if all(r in ("passed", "skipped") for r in results.values()) else 1


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
