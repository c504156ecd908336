"""The speed model (`tf32lab.predict`) against published and measured timings.

Without a GPU:
1. the PyTorch CUDA notes' A100 figures for a 10240x10240 float32 matmul (0.11 s IEEE, 0.016 s TF32), goal:
   predicted within +-25% (the model's GEMM efficiency is the midpoint of what this same example implies, so this
   checks the arithmetic more than the model: the real test is a GPU);
2. memory-bound workloads (a batch-of-one MLP, a chain of pointwise ops), goal: predicted speedup <= 1.05x;
3. what `predict` costs on all-MiniLM-L6-v2, as a ratio to one native forward on this machine (goal <= 2x;
   interleaved medians, torch.utils.benchmark).

With a CUDA GPU (run from the repository root: `PYTHONPATH=src python benchmarks/predict.py`): `bench` against
`predict` for the GPU's target (h100 or h200, from its name) on a GEMM sweep, all-MiniLM-L6-v2-sized and
BERT-base-sized encoders (random weights, batch 32 x 128 tokens for BERT) and a ResNet-50 (torchvision, random
weights): the median |predicted / measured - 1| (goal <= 25%).

    .venv/bin/python benchmarks/predict.py [--rounds 7] [--skip-cost]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from _common import header, interleaved

import tf32lab
from tf32lab import targets
from tf32lab.control import flags
from tf32lab.speed.counting import Counting
from tf32lab.speed.prediction import predict_counts
from tf32lab.workloads import builtin

# seconds: PyTorch's CUDA notes, "TensorFloat-32 (TF32) on Ampere devices" (A100, 10240²)
NOTES = {"highest": 0.11, "high": 0.016}


def notes_gemm() -> bool:
    a = torch.empty(10240, 10240, device="meta")  # shapes only: nothing is computed here
    with Counting() as counts:
        torch.mm(a, a)
    report = predict_counts(counts, "10240^2 matmul", targets.get("a100"), ("highest", "high"))
    ok = True
    for level, published in NOTES.items():
        predicted = report.level(level).seconds
        off = predicted / published - 1
        ok &= abs(off) <= 0.25
        print(f"a100 10240^2 mm {level:<8} predicted {predicted:.4f} s, published {published:.3f} s: {off:+.0%} "
              f"({'within' if abs(off) <= 0.25 else 'OUTSIDE'} +-25%)")
    return ok


def memory_bound() -> bool:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(4096, 4096), torch.nn.GELU())])
    pointwise = torch.nn.Sequential(torch.nn.LayerNorm(1024), torch.nn.GELU(), torch.nn.Dropout(0.0),
                                    torch.nn.LayerNorm(1024))
    ok = True
    for name, workload in (("batch-of-one MLP, 4 x 4096^2", tf32lab.Workload(mlp, torch.randn(1, 4096))),
                           ("pointwise chain, 4096 x 1024", tf32lab.Workload(pointwise, torch.randn(4096, 1024)))):
        for target in ("a100", "h100"):
            speedup = tf32lab.predict(workload, target).level("high").speedup
            ok &= speedup <= 1.05
            print(f"{name:<30} {target}: predicted {speedup:.3f}x at high (goal <= 1.05x): "
                  f"{'met' if speedup <= 1.05 else 'NOT met'}")
    return ok


def cost(rounds: int) -> bool:
    workload = builtin.minilm()

    def forward() -> None:
        with torch.inference_mode():
            workload.run()

    t = interleaved({"forward": forward, "predict": lambda: tf32lab.predict(workload, "a100")},
                    rounds=rounds, number=2)
    ratio = t["predict"] / t["forward"]
    print(f"predict on all-MiniLM-L6-v2: {t['predict'] * 1e3:.1f} ms, one native forward {t['forward'] * 1e3:.1f} ms:"
          f" {ratio:.2f}x (goal <= 2x): {'met' if ratio <= 2 else 'NOT met'}")
    return ratio <= 2


def on_gpu(rounds: int) -> None:
    name = torch.cuda.get_device_name()
    target = "h200" if "H200" in name else "h100" if "H100" in name else "a100" if "A100" in name else None
    if target is None:
        print(f"GPU {name}: no target of tf32lab.know.peaks matches it; nothing compared")
        return
    print(f"GPU {name}: bench against predict({target!r})")
    errors = []

    def compare(label: str, workload: tf32lab.Workload) -> None:
        predicted = tf32lab.predict(workload, target)
        measured = tf32lab.bench(workload, rounds=rounds)
        for lv in ("highest", "high"):
            p, m = predicted.level(lv).seconds, measured.level(lv).seconds
            errors.append(abs(p / m - 1))
            print(f"  {label:<28} {lv:<8} predicted {p * 1e3:9.3f} ms  measured {m * 1e3:9.3f} ms "
                  f"(±{measured.level(lv).spread:.0%})  ratio {p / m:5.2f}  speedup predicted "
                  f"{predicted.level(lv).speedup:4.2f}x measured {measured.level(lv).speedup:4.2f}x")

    device = torch.device("cuda")
    for m, n, k in ((256, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (1, 4096, 4096),
                    (32, 4096, 4096), (8192, 1024, 64), (128, 50000, 768)):
        layer = torch.nn.Linear(k, n, bias=False).to(device)
        compare(f"gemm {m}x{n}x{k}", tf32lab.Workload(layer, torch.randn(m, k, device=device), name="gemm"))
    try:
        from transformers import BertConfig, BertModel

        for label, config, batch, tokens in (
                ("MiniLM-L6-sized encoder", BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                                       intermediate_size=1536), 64, 32),
                ("BERT-base encoder", BertConfig(), 32, 128)):
            model = BertModel(config).to(device).eval()
            ids = torch.randint(0, config.vocab_size, (batch, tokens), device=device)
            compare(label, tf32lab.Workload(model, {"input_ids": ids}, name=label))
    except ImportError:
        print("  transformers missing: encoders skipped")
    try:
        import torchvision

        model = torchvision.models.resnet50().to(device).eval()
        compare("ResNet-50, batch 64", tf32lab.Workload(model, torch.randn(64, 3, 224, 224, device=device)))
    except ImportError:
        print("  torchvision missing: ResNet-50 skipped")
    print(f"median |predicted / measured - 1| = {statistics.median(errors):.0%} over {len(errors)} timings "
          f"(goal <= 25%)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-cost", action="store_true", help="without the MiniLM timing (needs the demo extra)")
    args = parser.parse_args()
    before = flags.snapshot()
    header("predict: the speed model against published and measured timings")
    ok = notes_gemm() & memory_bound()
    if not args.skip_cost:
        ok &= cost(args.rounds)
    if torch.cuda.is_available():
        on_gpu(args.rounds)
    else:
        print("no GPU here: bench against predict on a GPU is pending (docs/gpu-results.md)")
    assert flags.snapshot() == before
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
