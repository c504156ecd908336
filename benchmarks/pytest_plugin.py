"""What the pytest plugin costs a project that does not use it: `pytest --help` with the plugin installed (loaded
through its entry point, off) against the same run with it blocked (`-p no:tf32lab`, as if not installed);
interleaved, medians of fresh processes (goal: < 50 ms more).

    .venv/bin/python benchmarks/pytest_plugin.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_MS = 50.0


def seconds(args: list[str], cwd: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, capture_output=True, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
        variants = {"installed, off": ["--help"], "blocked": ["-p", "no:tf32lab", "--help"]}
        samples: dict[str, list[float]] = {name: [] for name in variants}
        seconds(["--help"], folder)  # warm the file cache
        for _ in range(args.rounds):
            for name, argv in variants.items():
                samples[name].append(seconds(argv, folder))
        median = {name: statistics.median(values) for name, values in samples.items()}
        extra = (median["installed, off"] - median["blocked"]) * 1e3
        print(f"pytest --help, interleaved medians of {args.rounds} fresh processes")
        for name, value in median.items():
            print(f"  {name:<16} {value * 1e3:7.1f} ms")
        print(f"  the plugin adds {extra:+.1f} ms (goal < {GOAL_MS:g} ms): {'met' if extra < GOAL_MS else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
