"""Raw data from a CUDA GPU, compared with tf32lab's models later on a CPU.

Three sections, each saved under ``--out`` (default ``$OUT``):

- ``gemm_bits``: cuBLAS products of fixed float32 inputs at ``highest`` and ``high`` (and ``bfx9`` where this torch
  and GPU take it), K from 8 to 16384, zero-mean (``randn``) and same-sign (``uniform`` [0, 1)) inputs, for a small
  output (64 x 64, which cuBLAS may split along K) and the top-left 64 x 64 corner of a 2048 x 2048 output (the
  other rows and columns are filler: no output element depends on them). Saved: the outputs' bits and the kernels
  that ran (``gemm_bits.pt``). The accumulation model's "hardware" mode is compared with them bit for bit.
- ``mma_bits``: single tensor-core instructions, through a Triton kernel that computes one 64 x 64 tile with
  ``tl.dot(..., input_precision="tf32")`` for K = 8, 16, 32 (one, two, four instructions chained), on random,
  same-sign, cancellation-heavy and exponent-spread inputs, with and without an accumulator input; the PTX
  instructions used are recorded (``mma_bits.pt``).
- ``training``: examples/value_head's actor-critic trained 50 steps at ``highest``, ``high`` and in float64 from one
  initial state and one batch stream: loss per step, first gradients, final weights (``training_paths.pt``).
- ``timings``: CUDA-event medians of interleaved rounds (ms) of a GEMM sweep, convolutions with cuDNN's TF32 on and
  off, a MiniLM-sized and a BERT-base-sized encoder, a torchvision ResNet-50 and a T5-base-sized model, forward
  and training step (forward, backward, AdamW step), at ``highest`` and ``high`` (``timings.json``).

The inputs are made on a CPU first (``--make-inputs DIR``: seeded, saved as tensors, so that both machines read the
same bits) and carried to the GPU machine:

    python scripts/gpu/raw_data.py --make-inputs .gpu-in            # here, once
    PYTHONPATH=src python3 scripts/gpu/raw_data.py --inputs .gpu-in --out $OUT   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Callable

import torch

KS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MMA_KS = (8, 16, 32)
SIDE = 64  # rows of A and columns of B kept (the output corner compared)


# -- inputs, made on a CPU ------------------------------------------------------------------------------------------
def make_inputs(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(20261126)
    kmax = max(KS)
    gemm = {
        "randn": (torch.randn(SIDE, kmax, generator=g), torch.randn(kmax, SIDE, generator=g)),
        "uniform": (torch.rand(SIDE, kmax, generator=g), torch.rand(kmax, SIDE, generator=g)),
    }
    torch.save(gemm, os.path.join(folder, "gemm_inputs.pt"))
    mma: dict[str, Any] = {}
    for k in MMA_KS:
        a, b = torch.randn(SIDE, k, generator=g), torch.randn(k, SIDE, generator=g)
        mma[f"randn/K{k}"] = (a, b, torch.zeros(SIDE, SIDE))
        a, b = torch.rand(SIDE, k, generator=g), torch.rand(k, SIDE, generator=g)
        mma[f"uniform/K{k}"] = (a, b, torch.zeros(SIDE, SIDE))
        # cancellation: each pair of products nearly cancels, leaving terms far below the largest
        a = torch.randn(SIDE, k, generator=g)
        b = torch.randn(k, SIDE, generator=g)
        b[1::2] = -b[0::2] * (1 + torch.randn(k // 2, SIDE, generator=g) * 2.0**-10)
        a[:, 1::2] = a[:, 0::2]
        mma[f"cancel/K{k}"] = (a, b, torch.zeros(SIDE, SIDE))
        # exponents spread over 2**-30 .. 2**30
        spread_a = torch.randn(SIDE, k, generator=g)  # each factor drawn in this order: the inputs the H200 read
        spread_a = spread_a * torch.exp2(torch.randint(-30, 31, (SIDE, k), generator=g).float())
        spread_b = torch.randn(k, SIDE, generator=g)
        spread_b = spread_b * torch.exp2(torch.randint(-30, 31, (k, SIDE), generator=g).float())
        mma[f"spread/K{k}"] = (spread_a, spread_b, torch.zeros(SIDE, SIDE))
        # with an accumulator input of the products' size, and one far smaller than them
        a, b = torch.randn(SIDE, k, generator=g), torch.randn(k, SIDE, generator=g)
        mma[f"randn-acc/K{k}"] = (a, b, torch.randn(SIDE, SIDE, generator=g) * 4)
        mma[f"uniform-tinyacc/K{k}"] = (torch.rand(SIDE, k, generator=g), torch.rand(k, SIDE, generator=g),
                                        -torch.rand(SIDE, SIDE, generator=g) * 1e-6)
    # MMA-Sim's paper, section VI-C: a = [2048, 2048], b = [2048, -2048], c = -1e-6 (hardware: -0.25)
    a, b, c = torch.zeros(SIDE, 8), torch.zeros(8, SIDE), torch.full((SIDE, SIDE), -1e-6)
    a[:, 0], a[:, 1], b[0, :], b[1, :] = 2048.0, 2048.0, 2048.0, -2048.0
    mma["paper-vi-c/K8"] = (a, b, c)
    torch.save(mma, os.path.join(folder, "mma_inputs.pt"))
    print(f"inputs written to {folder}")


# -- helpers on the GPU ---------------------------------------------------------------------------------------------
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware_checks import RESULTS, say, section  # noqa: E402  (the same log lines and failure bookkeeping)


def set_level(level: str) -> None:
    """The matmul math through the per-backend cell (no mixing of the two flag APIs)."""
    torch.backends.cuda.matmul.fp32_precision = {"highest": "ieee", "high": "tf32"}.get(level, level)


def set_conv(math: str) -> None:
    torch.backends.cudnn.conv.fp32_precision = math


def kernels_of(fn: Callable[[], Any]) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sorted({e.name for e in prof.events() if "CUDA" in str(e.device_type)})
    except Exception as e:  # the profiler is a nicety here: the bits matter more
        return [f"profiler failed: {type(e).__name__}"]


# -- gemm_bits ------------------------------------------------------------------------------------------------------
def gemm_bits(inputs: str, out: str) -> None:
    data = torch.load(os.path.join(inputs, "gemm_inputs.pt"))
    saved: dict[str, Any] = {"outputs": {}, "kernels": {}, "levels": []}
    levels = ["highest", "high"]
    try:
        set_level("bfx9")
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
        torch.cuda.synchronize()
        levels.append("bfx9")
    except Exception as e:  # this torch or GPU has no bfx9
        say(f"bfx9 not taken: {type(e).__name__}: {e}")
    saved["levels"] = levels
    fill = torch.Generator(device="cuda").manual_seed(1)
    for kind, (a_all, b_all) in data.items():
        for k in KS:
            a, b = a_all[:, :k].cuda(), b_all[:k, :].cuda()
            for side in (SIDE, 2048):
                if side > SIDE:  # filler rows and columns: other output tiles, the corner's sums unchanged
                    a_f = torch.cat([a, torch.randn(side - SIDE, k, device="cuda", generator=fill)])
                    b_f = torch.cat([b, torch.randn(k, side - SIDE, device="cuda", generator=fill)], dim=1)
                else:
                    a_f, b_f = a, b
                for level in levels:
                    set_level(level)
                    c = a_f @ b_f
                    again = a_f @ b_f
                    key = f"{kind}/K{k}/M{side}/{level}"
                    saved["outputs"][key] = c[:SIDE, :SIDE].clone().cpu()
                    if kind == "randn":  # the kernel follows the shape, not the values
                        saved["kernels"][key] = kernels_of(lambda a_f=a_f, b_f=b_f: a_f @ b_f)
                    if not torch.equal(c, again):
                        say(f"{key}: two runs differ")
                        saved.setdefault("nondeterministic", []).append(key)
            if kind == "randn":
                say(f"K={k}: {saved['kernels'][f'{kind}/K{k}/M{SIDE}/high']} | "
                    f"{saved['kernels'][f'{kind}/K{k}/M2048/high']}")
    set_level("highest")
    torch.save(saved, os.path.join(out, "gemm_bits.pt"))


# -- mma_bits -------------------------------------------------------------------------------------------------------
def mma_bits(inputs: str, out: str) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def tile(a_ptr, b_ptr, c_ptr, o_ptr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rm = tl.arange(0, BM)
        rn = tl.arange(0, BN)
        rk = tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
        c = tl.load(c_ptr + rm[:, None] * BN + rn[None, :])
        acc = tl.dot(a, b, acc=c, input_precision="tf32")
        tl.store(o_ptr + rm[:, None] * BN + rn[None, :], acc)

    data = torch.load(os.path.join(inputs, "mma_inputs.pt"))
    saved: dict[str, Any] = {"outputs": {}, "ptx": {}}
    for key, (a, b, c) in data.items():
        if a.shape[1] < 16:  # Triton's tl.dot wants K >= 16: a second instruction of zero products adds nothing
            a = torch.cat([a, torch.zeros_like(a)], dim=1)
            b = torch.cat([b, torch.zeros_like(b)])
        a, b, c = a.contiguous().cuda(), b.contiguous().cuda(), c.contiguous().cuda()
        o = torch.full_like(c, float("nan"))
        k = a.shape[1]
        try:
            compiled = tile[(1,)](a, b, c, o, K=k, BM=SIDE, BN=SIDE, num_warps=4)
            torch.cuda.synchronize()
        except Exception as e:  # e.g. a K this Triton refuses for tf32: that one input is skipped
            say(f"{key}: not run: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            saved.setdefault("refused", {})[key] = repr(e)[:500]
            continue
        saved["outputs"][key] = o.cpu()
        asm = getattr(compiled, "asm", {}) or {}
        ptx = asm.get("ptx", "") if isinstance(asm, dict) else ""
        instr = {name: ptx.count(name) for name in ("wgmma.mma_async", "mma.sync", "cvt.rna.tf32", "cvt.rn.tf32")}
        saved["ptx"][key] = instr
        if key.endswith("K8") or key.startswith("paper"):
            saved.setdefault("ptx_text", {})[key] = ptx[-20000:]
        say(f"{key}: {instr}; o[0,0] = {float(o[0, 0])!r}")
    torch.save(saved, os.path.join(out, "mma_bits.pt"))


# -- timings --------------------------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any], convs: tuple[str, ...], rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """Median and spread (ms per call) of interleaved rounds of ``fn`` at each level (and cuDNN conv math): A B A B
    ..., each round ``calls`` calls, the flags set before a round starts (never inside the timed region)."""
    settings = [(level, conv) for conv in convs for level in ("highest", "high")]
    for level, conv in settings:
        set_level(level)
        set_conv(conv)
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    samples: dict[tuple[str, str], list[float]] = {s: [] for s in settings}
    for _ in range(rounds):
        for level, conv in settings:
            set_level(level)
            set_conv(conv)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples[(level, conv)].append(start.elapsed_time(end) / calls)
    out = {}
    for (level, conv), xs in samples.items():
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        out[f"{level}/conv-{conv}"] = {"ms": statistics.median(xs), "iqr": q[2] - q[0], "rounds": len(xs)}
    set_level("highest")
    set_conv("tf32")
    return out


def train_step(model: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timings(out: str, rounds: int, only: str = "") -> None:
    rows: list[dict[str, Any]] = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "rounds": rounds,
            "timer": "CUDA events, interleaved rounds, median ms per call"}

    def add(workload: str, mode: str, result: dict[str, dict[str, float]], **extra: Any) -> None:
        for variant, r in result.items():
            level, conv = variant.split("/conv-")
            rows.append({"workload": workload, "mode": mode, "level": level, "conv": conv, **r, **extra})
        say(f"{workload:<34} {mode:<8} " + "  ".join(f"{v} {r['ms']:.4f} ms (±{r['iqr']:.4f})"
                                                   for v, r in result.items()))
        with open(os.path.join(out, "timings.json"), "w") as f:  # after each row: a later failure keeps these
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    g = torch.Generator(device="cuda").manual_seed(0)
    if only == "t5":
        _t5(add, g, rounds)
        return
    for m, k, n in ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
                    (8192, 8192, 8192), (1, 4096, 4096), (32, 4096, 4096), (8192, 1024, 64), (128, 50000, 768),
                    (4096, 4096, 16384), (16384, 4096, 1024)):
        a = torch.randn(m, k, device="cuda", generator=g)
        b = torch.randn(k, n, device="cuda", generator=g)
        flops = 2 * m * n * k
        calls = max(1, min(200, int(2e11 / flops)))
        add(f"gemm {m}x{k}x{n}", "forward", timed(lambda a=a, b=b: a @ b, ("tf32",), rounds, calls), flops=flops)

    import torch.nn.functional as F

    for batch, cin, cout, hw, ksize, stride in ((64, 64, 64, 56, 3, 1), (64, 64, 256, 56, 1, 1),
                                                (64, 128, 128, 28, 3, 1), (64, 256, 256, 14, 3, 1),
                                                (64, 512, 512, 7, 3, 1), (64, 3, 64, 224, 7, 2),
                                                (64, 1024, 256, 14, 1, 1)):
        x = torch.randn(batch, cin, hw, hw, device="cuda", generator=g)
        w = torch.randn(cout, cin, ksize, ksize, device="cuda", generator=g)
        hw_out = (hw + 2 * (ksize // 2) - ksize) // stride + 1
        flops = 2 * batch * cout * hw_out * hw_out * cin * ksize * ksize
        calls = max(1, min(100, int(5e10 / flops)))

        def fn(x: torch.Tensor = x, w: torch.Tensor = w, s: int = stride, p: int = ksize // 2) -> torch.Tensor:
            return F.conv2d(x, w, stride=s, padding=p)

        add(f"conv {batch}x{cin}x{hw}x{hw} {cout} k{ksize}s{stride}", "forward",
            timed(fn, ("tf32", "ieee"), rounds, calls), flops=flops)

    from transformers import BertConfig, BertModel

    def encoder(hidden: int, layers: int, heads: int, inter: int, batch: int, tokens: int, label: str) -> None:
        torch.manual_seed(0)
        model = BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                     intermediate_size=inter)).cuda()
        ids = torch.randint(1000, 30000, (batch, tokens), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        model.eval()

        def forward() -> Any:
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask).last_hidden_state

        add(label, "forward", timed(forward, ("tf32",), rounds, 10))
        model.train()
        step = train_step(model, lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean())
        add(label, "train", timed(step, ("tf32",), rounds, 5))

    encoder(384, 6, 12, 1536, 64, 32, "MiniLM-L6-sized encoder 64x32")
    encoder(768, 12, 12, 3072, 32, 128, "BERT-base encoder 32x128")

    import torchvision

    torch.manual_seed(0)
    resnet = torchvision.models.resnet50().cuda()
    images = torch.randn(64, 3, 224, 224, device="cuda", generator=g)
    labels = torch.randint(0, 1000, (64,), device="cuda", generator=g)
    resnet.eval()

    def resnet_forward() -> Any:
        with torch.no_grad():
            return resnet(images)

    add("ResNet-50 batch 64", "forward", timed(resnet_forward, ("tf32", "ieee"), rounds, 5))
    resnet.train()
    step = train_step(resnet, lambda: F.cross_entropy(resnet(images), labels))
    add("ResNet-50 batch 64", "train", timed(step, ("tf32", "ieee"), rounds, 3))

    _t5(add, g, rounds)


def _t5(add: Callable[..., None], g: torch.Generator, rounds: int) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, decoder_start_token_id=0,
                      pad_token_id=0)
    t5 = T5ForConditionalGeneration(config).cuda()
    src = torch.randint(100, 30000, (16, 256), device="cuda", generator=g)
    tgt = torch.randint(100, 30000, (16, 64), device="cuda", generator=g)
    t5.train()
    step = train_step(t5, lambda: t5(input_ids=src, labels=tgt).loss)
    add("T5-base-sized 16x256->64", "train", timed(step, ("tf32",), rounds, 3))


# -- training paths -------------------------------------------------------------------------------------------------
def training_paths(out: str, steps: int = 50) -> None:
    """examples/value_head's actor-critic trained for ``steps`` steps on the GPU at each level and in float64, from
    one initial state and one batch stream: the loss per step, and the gradients' distance at step 1."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("value_head", "examples/value_head/train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    initial = example.ActorCritic().state_dict()
    generator = torch.Generator().manual_seed(0)
    batches = [example.batch(256, generator) for _ in range(steps)]
    paths: dict[str, Any] = {}
    for name, level, dtype in (("float64", "highest", torch.float64), ("highest", "highest", torch.float32),
                               ("high", "high", torch.float32)):
        model = example.ActorCritic()
        model.load_state_dict(initial)
        model = model.to("cuda", dtype)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        set_level(level)
        losses, first_grads = [], None
        for obs, actions, returns in batches:
            out_ = model(obs.to("cuda", dtype))
            loss = torch.nn.functional.cross_entropy(out_["logits"], actions.cuda()) + \
                0.5 * torch.nn.functional.mse_loss(out_["value"], returns.to("cuda", dtype))
            optimizer.zero_grad()
            loss.backward()
            if first_grads is None:
                first_grads = {n: p.grad.double().cpu() for n, p in model.named_parameters()}
            optimizer.step()
            losses.append(loss.item())
        paths[name] = {"losses": losses, "grads": first_grads,
                       "weights": {n: p.detach().double().cpu() for n, p in model.named_parameters()}}
        say(f"value_head {name}: loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    set_level("highest")
    torch.save(paths, os.path.join(out, "training_paths.pt"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-inputs", metavar="DIR")
    parser.add_argument("--inputs", metavar="DIR", default=".gpu-in")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    parser.add_argument("--sections", default="gemm_bits,mma_bits,training,timings")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default="", help="timings: 't5' for the T5 row alone")
    args = parser.parse_args()
    if args.make_inputs:
        make_inputs(args.make_inputs)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    say(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu",
                        "--format=csv"], capture_output=True, text=True).stdout)
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
        f"{torch.cuda.get_device_name()}")
    wanted = args.sections.split(",")
    if "gemm_bits" in wanted:
        section("gemm_bits", lambda: gemm_bits(args.inputs, args.out))
    if "mma_bits" in wanted:
        section("mma_bits", lambda: mma_bits(args.inputs, args.out))
    if "training" in wanted:
        section("training", lambda: training_paths(args.out))
    if "timings" in wanted:
        section("timings", lambda: timings(args.out, args.rounds, args.only))
    failures = RESULTS.get("failures", [])
    say(f"failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
