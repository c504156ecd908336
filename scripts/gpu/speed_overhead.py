"""What the speed model's fixed costs are on the GPU at hand: per forward of ``tf32lab.bench``, per eager kernel.

- a one-kernel workload (a 1x8 @ 8x8 product): ``bench``'s own cost per call (scope, inference mode, synchronize)
  plus one launch;
- chains of 1 and 201 tiny element-wise ops: the cost of one more eager op;
- the all-MiniLM-L6-v2-sized encoder of ``benchmarks/predict.py``: CUDA kernels per forward (profiler) beside the
  ops ``tf32lab.predict`` counts, and its measured time per kernel.

    PYTHONPATH=src python scripts/gpu/speed_overhead.py
"""

from __future__ import annotations

import sys

import torch

import tf32lab
from tf32lab.speed.counting import Counting

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Chain(torch.nn.Module):
    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = x + 1.0
        return x


def seconds(workload: tf32lab.Workload) -> float:
    return tf32lab.bench(workload, levels=("highest",), rounds=5).level("highest").seconds


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if DEV.type == 'cuda' else 'CPU'}")
    one = seconds(tf32lab.Workload(torch.nn.Linear(8, 8, bias=False).to(DEV), torch.randn(1, 8, device=DEV)))
    print(f"one-kernel workload: {one * 1e6:.1f} µs per bench call")
    x = torch.randn(1024, device=DEV)
    short, long = seconds(tf32lab.Workload(Chain(1), x)), seconds(tf32lab.Workload(Chain(201), x))
    print(f"element-wise chain: 1 op {short * 1e6:.1f} µs, 201 ops {long * 1e6:.1f} µs: "
          f"{(long - short) / 200 * 1e6:.2f} µs per extra eager op")
    try:
        from transformers import BertConfig, BertModel
    except ImportError:
        print("transformers missing: encoder skipped")
        return 0
    torch.manual_seed(0)
    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    model = BertModel(config).to(DEV).eval()
    ids = torch.randint(0, config.vocab_size, (64, 32), device=DEV)
    workload = tf32lab.Workload(model, {"input_ids": ids})
    with Counting(model) as counts, torch.inference_mode():
        workload.run()
    measured = seconds(workload)
    kernels = "n/a"
    if DEV.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.inference_mode():
            workload.run()
            torch.cuda.synchronize()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    per = f"{measured / kernels * 1e6:.1f} µs per kernel" if isinstance(kernels, int) and kernels else ""
    print(f"MiniLM-sized encoder: {len(counts.ops)} counted ops, {kernels} CUDA kernels, measured "
          f"{measured * 1e3:.3f} ms per forward {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
