"""The speed model (`tf32lab.predict`) against published and measured timings.

Without a GPU:
1. every published pair of `tf32lab.speed.published.ROWS` (A100 GEMMs, convolutions, memory-bound ops, T5
   training steps on an A100 and an RTX 3090; this project's H100 and H200 GEMMs) against the prediction: the
   speedup, published and predicted, their ratio, the rows' role (fit / held-out). Goals: median
   |predicted / published - 1| <= 10% over the GEMM rows, every held-out GEMM row within +-15%, memory-bound rows
   <= 1.05x, the t5-base training row within +-30%; the convolutions inside their band. The fit of
   `tf32lab.know.peaks.GEMM_FITS` is recomputed and compared; then the held-out whole-model rows, each with its
   source, GPU, workload, published and predicted speedup and band, and their goals;
2. memory-bound workloads (a batch-of-one MLP, a chain of pointwise ops), goal: predicted speedup <= 1.05x;
3. what `predict` costs on all-MiniLM-L6-v2, as a ratio to one native forward on this machine (goal <= 2x;
   interleaved medians, torch.utils.benchmark).

`--gpu-data timings.json`: the measured rows of a GPU run (docs/gpu-results.md: a GEMM sweep, convolutions with
cuDNN's TF32 on and off, MiniLM-sized and BERT-base encoders, a ResNet-50, forward and training step) against
`predict` for `--gpu-target` (h200), printed as a table (time ratio and speedups).

With a CUDA GPU (run from the repository root: `PYTHONPATH=src python benchmarks/predict.py`): `bench` against
`predict` for the GPU's target on a GEMM sweep and the models above.

    .venv/bin/python benchmarks/predict.py [--rounds 7] [--skip-cost] [--gpu-data PATH] [--gpu-target h200]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from _common import header, interleaved

import tf32lab
from tf32lab import targets
from tf32lab.control import flags
from tf32lab.know import peaks
from tf32lab.know.peaks import CONV_BAND, GEMM_BAND
from tf32lab.speed import calibration, published
from tf32lab.speed.counting import Counting
from tf32lab.speed.prediction import predict_counts
from tf32lab.workloads import builtin


def _meta_counts(run, model: Optional[torch.nn.Module] = None, training: bool = False):
    with Counting(model, backward=training) as counts:
        out = run()
        if training:
            out.backward()
    return counts


def _row_speedup(row: published.Published) -> tuple[float, Optional[tuple[float, float]]]:
    """The predicted speedup of a published row (and its band)."""
    target = targets.get(row.target)
    meta = {"device": "meta"}
    if row.kind == "gemm":
        tf32 = calibration.MATHS.get(row.target, "tf32-rna")
        speedup = calibration.gemm_prediction(row, "ieee") / calibration.gemm_prediction(row, tf32)
        return speedup, (speedup * GEMM_BAND[0], speedup * GEMM_BAND[1])
    if row.kind == "conv":
        batch, cin = row.shape[:2]
        if len(row.shape) == 7:  # 2-d: batch, cin, h, w, cout, kh, kw
            _, _, h, w, cout, kh, kw = row.shape
            x, weight = torch.empty(batch, cin, h, w, **meta), torch.empty(cin, cout, kh, kw, **meta)
            counts = _meta_counts(lambda: torch.nn.functional.conv_transpose2d(x, weight))
        else:  # 3-d: batch, cin, d, h, w, cout, kd, kh, kw
            _, _, d, h, w, cout, kd, kh, kw = row.shape
            x, weight = torch.empty(batch, cin, d, h, w, **meta), torch.empty(cin, cout, kd, kh, kw, **meta)
            counts = _meta_counts(lambda: torch.nn.functional.conv_transpose3d(x, weight))
        ieee = predict_counts(counts, row.label, target, ("highest",), conv="ieee").level("highest").seconds
        tf32 = predict_counts(counts, row.label, target, ("highest",), conv="tf32").level("highest").seconds
        speedup = ieee / tf32
        return speedup, (speedup * CONV_BAND[0], speedup * CONV_BAND[1])
    if row.kind == "memory":
        x = torch.empty(*row.shape, **meta)
        op = {"relu": lambda: torch.relu(x), "softmax": lambda: torch.softmax(x, -1),
              "layer_norm": lambda: torch.nn.functional.layer_norm(x, x.shape[1:])}[row.label.split()[2].rstrip(":")]
        level = predict_counts(_meta_counts(op), row.label, target, ("high",)).level("high")
        return level.speedup, level.band
    name = row.label.split()[0]
    return _t5_step(name, row.shape[0], row.shape[1] if len(row.shape) > 1 else 1, target)


# the published T5 checkpoints' shapes (their config.json): d_model, d_ff, layers (encoder and decoder), heads
_T5_SIZES = {"t5-small": (512, 2048, 6, 8), "t5-base": (768, 3072, 12, 12)}


def _t5_step(name: str, batch: int, accumulation: int, target) -> tuple[float, Optional[tuple[float, float]]]:
    """A T5's training step (HF Trainer): ``accumulation`` forward and backward passes, then one AdamW update."""
    from transformers import T5Config, T5ForConditionalGeneration

    from tf32lab.speed.prediction import _training, optimizer_ops, training_loss

    d_model, d_ff, layers, heads = _T5_SIZES[name]
    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(d_model=d_model, d_ff=d_ff, num_layers=layers, num_heads=heads,
                                                    d_kv=64, decoder_start_token_id=0, pad_token_id=0))
    ids = torch.zeros(batch, 128, dtype=torch.long, device="meta")
    with _training(model), Counting(model, backward=True) as counts:
        for _ in range(accumulation):  # the second backward adds into the gradients (AccumulateGrad)
            training_loss(model(input_ids=ids, labels=ids), name).backward()
    counts.ops.extend(optimizer_ops(model, "adamw"))
    level = predict_counts(counts, name, target, ("high",), step="training", host=peaks.HOST_SECONDS)
    level = level.level("high")
    return level.speedup, level.band


def published_rows() -> bool:
    """Every published pair against the model; the goals the model is held to."""
    fitted = calibration.fit()
    def shown(fits):  # to the precision the constants are written in
        return {t: {k: (round(f.efficiency, 2), round(f.wave_seconds * 1e6, 1)) for k, f in kinds.items()}
                for t, kinds in fits.items()}

    same = shown(fitted) == shown(peaks.GEMM_FITS)
    print(f"fit of the GEMM constants on the 'fit' rows: {'equal to' if same else 'DIFFERENT from'} "
          f"tf32lab.know.peaks.GEMM_FITS")
    for target, kinds in fitted.items():
        print("  " + target + ": " + ", ".join(
            f"{kind} efficiency {f.efficiency:.2f}, wave {f.wave_seconds * 1e6:.1f} µs" for kind, f in kinds.items()))
    print(f"{'row':<58} {'target':<7} {'role':<9} {'published':>9} {'predicted':>10} {'likely':>13} {'ratio':>6}")
    off: dict[str, list[float]] = {"gemm": [], "held-out": []}
    whole: list[tuple[published.Published, float, Optional[tuple[float, float]]]] = []
    ok = same
    for row in published.ROWS:
        speedup, band = _row_speedup(row)
        ratio = speedup / row.speedup
        likely = f"{band[0]:.2f}-{band[1]:.2f}x" if band else "-"
        verdict = ""
        if row.kind == "gemm":
            off["gemm"].append(abs(ratio - 1))
            if row.role == "held-out":
                off["held-out"].append(abs(ratio - 1))
                verdict = "ok" if abs(ratio - 1) <= 0.15 else "OUTSIDE +-15%"
        elif row.kind == "memory":
            verdict = "ok" if speedup <= 1.05 else "ABOVE 1.05x"
        elif row.kind == "training":
            whole.append((row, speedup, band))
            verdict = "ok" if abs(ratio - 1) <= 0.25 else "OUTSIDE +-25%"
        elif row.kind == "conv":
            verdict = "in band" if band and band[0] <= row.speedup <= band[1] else "OUTSIDE its band"
        ok &= verdict in ("", "ok", "in band")
        print(f"{row.label[:58]:<58} {row.target:<7} {row.role:<9} {row.speedup:8.2f}x {speedup:9.2f}x "
              f"{likely:>13} {ratio:6.2f} {verdict}")
    median = statistics.median(off["gemm"])
    worst = max(off["held-out"])
    held = sum(x <= 0.15 for x in off["held-out"])
    print(f"GEMM rows: median |predicted/published - 1| = {median:.1%} over {len(off['gemm'])} (goal <= 10%): "
          f"{'met' if median <= 0.10 else 'NOT met'}")
    print(f"held-out GEMM rows: {held} of {len(off['held-out'])} within +-15% "
          f"(median {statistics.median(off['held-out']):.1%}, worst {worst:.0%})")
    ok &= median <= 0.10
    print("sources: " + "; ".join(sorted({row.source for row in published.ROWS})))
    return whole_models(whole) & ok


def _verdict(ok: bool, text: str) -> bool:
    print(f"{'PASSED' if ok else 'FAILED'} | {text}")
    return ok


def whole_models(rows) -> bool:
    """The held-out published whole-model rows (FP32 vs TF32, same batch): each, then their goals."""
    print("\nheld-out whole-model rows (published FP32 vs TF32 throughput, same batch):")
    print(f"{'source':<34} {'GPU':<7} {'workload':<56} {'published':>9} {'predicted':>9} {'likely':>12}")
    off, inside = [], 0
    for row, speedup, band in rows:
        off.append(abs(speedup / row.speedup - 1))
        inside += band is not None and band[0] <= row.speedup <= band[1]
        likely = f"{band[0]:.2f}-{band[1]:.2f}x" if band else "-"
        print(f"{row.source[:34]:<34} {row.target:<7} {row.label[:56]:<56} {row.speedup:8.2f}x {speedup:8.2f}x "
              f"{likely:>12}")
    models = sorted({row.label.split()[0] for row, _, _ in rows})
    gpus = sorted({row.target for row, _, _ in rows})
    asked = {row.label.split()[0] for row, _, _ in rows if row.target in ("a100", "h100", "h200")}
    ok = _verdict(len(asked) >= 6, f"{len(rows)} sourced held-out whole-model rows, {len(models)} models "
                                   f"({', '.join(models)}) on {', '.join(gpus)}; models on A100, H100 or H200: "
                                   f"{len(asked)} (goal: at least six across them; no more published FP32-vs-TF32 "
                                   f"pairs are at hand)")
    if rows:
        median = statistics.median(off)
        ok &= _verdict(median <= 0.15, f"median |predicted/published - 1| = {median:.1%} (goal <= 15%)")
        ok &= _verdict(max(off) <= 0.25, f"worst |predicted/published - 1| = {max(off):.1%} (goal: every row "
                                         f"within 25%)")
        ok &= _verdict(inside >= 0.8 * len(rows), f"band holds the published value in {inside} of {len(rows)} "
                                                   f"rows (goal >= 80%)")
    return ok


class _Loss(torch.nn.Module):
    """A model with the training loss the GPU run used, so that ``predict(training=True)`` differentiates it."""

    def __init__(self, model: torch.nn.Module, loss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *args, **kwargs):
        return self.loss(self.model(*args, **kwargs))


def _resnet50() -> torch.nn.Module:
    """torchvision's ResNet-50 (v1.5: stride in the 3x3 conv), rebuilt here: torchvision is not a dependency."""
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.down = None if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


def _gpu_workload(name: str, mode: str) -> tf32lab.Workload:
    """The workload a GPU run's row timed (scripts that produced timings.json: docs/gpu-results.md), on meta."""
    meta = torch.device("meta")
    words = name.split()
    if words[0] == "gemm":
        m, k, n = (int(v) for v in words[1].split("x"))
        return tf32lab.Workload(_Fn(torch.mm), (torch.empty(m, k, device=meta), torch.empty(k, n, device=meta)),
                                name=name)
    if words[0] == "conv":
        batch, cin, hw, _ = (int(v) for v in words[1].split("x"))
        kernel, stride = (int(v) for v in words[3][1:].split("s"))
        conv = torch.nn.Conv2d(cin, int(words[2]), kernel, stride, kernel // 2, bias=False, device=meta)
        return tf32lab.Workload(conv, torch.empty(batch, cin, hw, hw, device=meta), name=name)
    if name.startswith(("MiniLM", "BERT")):
        from transformers import BertConfig, BertModel

        small = name.startswith("MiniLM")
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536) \
            if small else BertConfig()
        model = BertModel(config)  # on the CPU: its attention mask is read (.item()), which meta tensors cannot
        batch, tokens = (64, 32) if small else (32, 128)
        ids = torch.zeros(batch, tokens, dtype=torch.long)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if mode == "train":
            model = _Loss(model, lambda out: out.last_hidden_state.square().mean())
        return tf32lab.Workload(model, inputs, name=name)
    if name.startswith("ResNet-50"):
        with meta:
            model = _resnet50()
        images = torch.empty(64, 3, 224, 224, device=meta)
        if mode == "train":
            labels = torch.zeros(64, dtype=torch.long, device=meta)
            model = _Loss(model, lambda out: torch.nn.functional.cross_entropy(out, labels))
        return tf32lab.Workload(model, images, name=name)
    raise ValueError(f"no workload for GPU row {name!r}")


class _Fn(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _step_counts(workload: tf32lab.Workload, training: bool):
    """What ``predict`` counts of one forward or training step (AdamW), once, to be timed many ways."""
    import contextlib

    from tf32lab.speed.prediction import _training, optimizer_ops, training_loss
    from tf32lab.workloads.workload import eval_mode

    mode = _training(workload.model) if training else eval_mode(workload.model)
    with mode, Counting(workload.model, backward=training) as counts, \
            (contextlib.nullcontext() if training else torch.inference_mode()):
        output = workload.run()
        if training:
            training_loss(output, str(workload.name)).backward()
    if training:
        counts.ops.extend(optimizer_ops(workload.model, "adamw"))
    return counts


def _op_times(counts, target: str, conv: str) -> dict[str, list[float]]:
    from tf32lab.speed.prediction import level_maths, op_seconds

    t = targets.get(target)
    p, maths = t.speed_peaks(), level_maths(t, ("highest", "high"), conv)
    return {level: [op_seconds(op, maths[level].get(op.family or "", "ieee"), p) for op in counts.ops]
            for level in ("highest", "high")}


def fit_host(whole: dict, target: str) -> tuple[float, float]:
    """The host cost per op and the achievable share of the bandwidth that best predict the whole-model rows' times
    (squared log error; cuDNN's TF32 flag on, as PyTorch's default): ``peaks.HOST_SECONDS`` and
    ``peaks.MEMORY_EFFICIENCIES[target]``."""
    from tf32lab.speed.prediction import queued_seconds

    saved = dict(peaks.MEMORY_EFFICIENCIES)
    best, best_error = (peaks.HOST_SECONDS, peaks.memory_efficiency(target)), float("inf")
    try:
        for efficiency in [round(0.50 + 0.05 * i, 2) for i in range(10)]:
            peaks.MEMORY_EFFICIENCIES[target] = efficiency
            per_op = [(counts, _op_times(counts, target, conv), seconds)
                      for (counts, conv), seconds in whole.items() if conv == "tf32"]
            for micro in range(5, 61):
                error = sum(math.log(queued_seconds(counts.ops, times[lv], micro * 1e-6) / seconds[lv]) ** 2
                            for counts, times, seconds in per_op for lv in times)
                if error < best_error - 1e-12:
                    best, best_error = (micro * 1e-6, efficiency), error
    finally:
        peaks.MEMORY_EFFICIENCIES.clear()
        peaks.MEMORY_EFFICIENCIES.update(saved)
    return best


def gpu_data(path: str, target: str) -> bool:
    """A GPU run's measured rows (timings.json) against ``predict(target)``: times and speedups, per row; the fit
    of the host cost and bandwidth share on its whole-model rows; its training steps within 15%."""
    with open(path) as f:
        data = json.load(f)
    print(f"\n{data['meta']['device']} (torch {data['meta']['torch']}, {data['meta']['timer']}) against "
          f"predict({target!r}, host=peaks.HOST_SECONDS):")
    measured: dict[tuple[str, str, str], dict[str, float]] = {}
    for row in data["rows"]:
        measured.setdefault((row["workload"], row["mode"], row["conv"]), {})[row["level"]] = row["ms"] * 1e-3
    print(f"{'workload':<34} {'step':<8} {'conv':<5} {'highest ms pred/meas':>21} {'high ms pred/meas':>19} "
          f"{'speedup pred (likely)':>26} {'meas':>6}")
    times, speedups, ok = [], [], True
    counted: dict[tuple[str, str], object] = {}
    whole: dict[tuple[object, str], dict[str, float]] = {}
    residuals = []
    for (name, mode, conv), seconds in measured.items():
        if (name, mode) not in counted:
            counted[name, mode] = _step_counts(_gpu_workload(name, mode), mode == "train")
        counts = counted[name, mode]
        report = predict_counts(counts, name, targets.get(target), ("highest", "high"), conv,
                                "training" if mode == "train" else "forward", peaks.HOST_SECONDS)
        hi, lo = report.level("highest"), report.level("high")
        times += [hi.seconds / seconds["highest"], lo.seconds / seconds["high"]]
        measured_speedup = seconds["highest"] / seconds["high"]
        speedups.append(lo.speedup / measured_speedup)
        verdict = ""
        if not name.startswith("gemm") and not name.startswith("conv"):
            whole[counts, conv] = seconds
            if conv == "tf32":
                residuals += [seconds["highest"] / hi.seconds, seconds["high"] / lo.seconds]
        if mode == "train":
            good = abs(lo.speedup / measured_speedup - 1) <= 0.15
            ok &= good
            verdict = "PASSED (+-15%)" if good else "FAILED (+-15%)"
        print(f"{name:<34} {mode:<8} {conv:<5} {hi.seconds * 1e3:9.3f}/{seconds['highest'] * 1e3:<9.3f}  "
              f"{lo.seconds * 1e3:8.3f}/{seconds['high'] * 1e3:<9.3f}  {lo.likely():>26} {measured_speedup:5.2f}x "
              f"{verdict}")
    print("cuDNN's TF32 flag at highest (ieee time / tf32 time), predicted (likely) vs measured:")
    for (name, mode, conv), seconds in measured.items():
        other = measured.get((name, mode, "ieee"))
        if conv != "tf32" or other is None:
            continue
        report = predict_counts(counted[name, mode], name, targets.get(target), ("highest",), "tf32",
                                host=peaks.HOST_SECONDS)
        note = next(n for n in report.notes if n.startswith("convolutions"))
        print(f"  {name:<34} {mode:<8} measured {other['highest'] / seconds['highest']:5.2f}x; predicted "
              f"{note.split(': ', 1)[1].split(' (')[0]}")
    print(f"median |predicted/measured - 1|: times {statistics.median(abs(t - 1) for t in times):.0%} over "
          f"{len(times)}, speedups {statistics.median(abs(s - 1) for s in speedups):.0%} over {len(speedups)}")
    host, efficiency = fit_host(whole, target)
    same = (round(host * 1e6), efficiency) == (round(peaks.HOST_SECONDS * 1e6), peaks.memory_efficiency(target))
    ok &= _verdict(same, f"fit on the whole-model rows: host {host * 1e6:.0f} µs per op, bandwidth share "
                         f"{efficiency:.2f} ({'equal to' if same else 'DIFFERENT from'} peaks.HOST_SECONDS, "
                         f"peaks.memory_efficiency({target!r}))")
    band = (math.floor(min(residuals) * 100) / 100, math.ceil(max(residuals) * 100) / 100)
    ok &= _verdict(band == peaks.HOST_BAND, f"measured / predicted times of the whole-model rows: {band[0]:.2f}-"
                                            f"{band[1]:.2f} (peaks.HOST_BAND {peaks.HOST_BAND})")
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
    parser.add_argument("--gpu-data", metavar="PATH", help="a GPU run's timings.json, compared with predict")
    parser.add_argument("--gpu-target", default="h200", help="the target of --gpu-data's GPU (h200)")
    args = parser.parse_args()
    before = flags.snapshot()
    header("predict: the speed model against published and measured timings")
    ok = published_rows() & memory_bound()
    if args.gpu_data:
        ok &= gpu_data(args.gpu_data, args.gpu_target)
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
