"""The sharded check's memory per rank: `tf32lab check` of one transformer (examples/sharded/model.py:large, 12
blocks of width 512, ~40M parameters, built on the meta device and sharded with FSDP2) on N = 1, 2 and 4 CPU
processes (gloo), each rank a fresh process started as torchrun starts it, the check's levels highest and high on
a100.

Printed per N: each rank's peak resident memory over the same process idle (torch and tf32lab imported, the process
group joined, a check of a small layer run: VmHWM minus VmRSS before the model is built), its largest, the ratio to
N = 1's, and the wall time of the whole job. Goal: the largest per-rank peak at N = 4 <= 0.4x N = 1's.

    .venv/bin/python benchmarks/check_distributed.py [--sizes 1,2,4] [--depth 12] [--width 512] [--malloc-default]

The ranks run with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``): by default glibc raises
the threshold to the size of each large block freed, after which blocks of that size come from the heap and stay
in the process when freed, so resident memory follows the largest blocks ever freed (FSDP2 frees every gathered
module) rather than what is live. ``--malloc-default`` measures with glibc's default instead.

On a machine with fewer cores than ranks the wall time grows with N (the ranks share the cores); the memory does
not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sharded" / "model.py"


def _status(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(depth: int, width: int) -> None:
    """One rank: join the job, note the idle memory, build the sharded model, check it, print the peak."""
    import datetime
    import importlib.util

    import torch

    import tf32lab

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    spec = importlib.util.spec_from_file_location("sharded_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # what any check costs once (imports, the emulator's tables, the collectives' buffers) counts as idle
    tf32lab.check(tf32lab.Workload(torch.nn.Linear(64, 64), torch.randn(8, 64)), levels=("highest", "high"),
                  speed=False)
    idle = _status("VmRSS")
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as refs:  # the peak from here on (Linux >= 4.0)
        refs.write("5")
    workload = module.large(depth=depth, width=width)
    parameters = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in workload.model.parameters())
    tf32lab.check(workload, levels=("highest", "high"), speed=False)
    print(json.dumps({"peak": _status("VmHWM") - idle, "idle": idle, "parameters": parameters}), flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


def _job(n: int, depth: int, width: int, malloc_default: bool) -> tuple[list[dict], float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, (os.cpu_count() or 1) // n)
    fixed = {} if malloc_default else {"MALLOC_MMAP_THRESHOLD_": "131072"}
    env = {**os.environ, **fixed, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", "--depth", str(depth), "--width", str(width)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, text=True)
             for r in range(n)]
    found = []
    for proc in procs:
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode:
            raise SystemExit(f"N={n}: a rank exited with {proc.returncode}")
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--malloc-default", action="store_true",
                        help="glibc's own mmap threshold (resident memory keeps freed blocks)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args.depth, args.width)
        return 0
    import torch

    print(f"the sharded check's peak memory per rank: examples/sharded/model.py:large (depth {args.depth}, width "
          f"{args.width}), levels highest and high on a100, gloo on CPU, glibc mmap threshold "
          f"{'default' if args.malloc_default else '128 KiB'}\ntorch {torch.__version__}, {os.cpu_count()} CPUs")
    base = None
    for n in (int(part) for part in args.sizes.split(",")):
        ranks, seconds = _job(n, args.depth, args.width, args.malloc_default)
        peak = max(r["peak"] for r in ranks)
        base = peak if base is None else base
        each = ", ".join(f"{r['peak']:.0f}" for r in ranks)
        print(f"N={n}: per-rank peak over idle {each} MiB (largest {peak:.0f} MiB, {peak / base:.2f}x N=1's); "
              f"parameters per rank {ranks[0]['parameters'] / 1e6:.1f}M; wall {seconds:.1f} s")
        if n == 4:
            ratio = peak / base
            print(f"goal: per-rank peak at N=4 <= 0.4x N=1's: {ratio:.2f}x: {'met' if ratio <= 0.4 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
