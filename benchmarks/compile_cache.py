"""Cold vs warm start of a compiled model in fresh processes: what autoconfig(compile_cache=PATH) buys.

Each round runs three fresh processes in turn:
- cold: an empty compile_cache folder; it compiles, then writes a Mega-Cache (tf32lab.save_compile_cache);
- warm folder: the same folder again (inductor's FX graph cache and compiled kernels are all there);
- Mega-Cache only: a new folder holding just the Mega-Cache file, as when the artifact is shipped to another
  machine; autoconfig loads it.
Wall seconds of the whole process, start to the first compiled call's result; medians over rounds.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _common import PROCESSES, header

ROUNDS = 2
CHILD = textwrap.dedent("""
    import sys, torch, tf32lab
    folder, save = sys.argv[1], sys.argv[2] == "save"
    tf32lab.autoconfig(compile_cache=folder)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 8))
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(torch.randn(16, 64))
    if save:
        tf32lab.save_compile_cache(folder)
""")


def run(folder: Path, save: bool) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, str(folder), "save" if save else "load"], check=True,
                   capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    header("compile cache: a fresh process's first compiled call, cold vs warm", PROCESSES)
    times: dict[str, list[float]] = {"cold (compile, save)": [], "warm folder": [], "Mega-Cache only": []}
    for _ in range(ROUNDS):
        with tempfile.TemporaryDirectory() as tmp:
            first, second = Path(tmp, "cold"), Path(tmp, "shipped")
            times["cold (compile, save)"].append(run(first, save=True))
            times["warm folder"].append(run(first, save=False))
            second.mkdir()
            for name in ("tf32lab-mega-cache.bin", "tf32lab-mega-cache.json"):  # only the artifact travels
                shutil.copy(first / name, second / name)
            times["Mega-Cache only"].append(run(second, save=False))
    medians = {name: statistics.median(values) for name, values in times.items()}
    cold = medians["cold (compile, save)"]
    for name, seconds in medians.items():
        print(f"{name:<24} {seconds:6.2f} s   {cold / seconds:5.2f}x vs cold")


if __name__ == "__main__":
    main()
