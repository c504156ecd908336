"""`tf32lab check hf:DIR --generate N` as a multiple of the native generation of the same tokens: the generation
check of a small GPT-2 (levels highest, high and medium on a100: the float64 reference, float32's floor and `high`,
`medium` computed as `high`) against native float32 greedy decoding of the same tokens from the same prompts once per
level asked (a user generating at each of the levels: all levels together), with the key/value cache. The check's own
float64 and float32 rows are its cost, not counted on the native side.

Goals: time <= 6x (interleaved medians, this process); peak extra memory <= 2.5x (peak RSS over an idle interpreter
that has imported torch and tf32lab and loaded the model; fresh child processes, VmHWM, medians of --rounds).

    .venv/bin/python benchmarks/generation.py [--rounds 3] [--tokens 32] [--prompts 8]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import WALL, header

import tf32lab
from tf32lab.workloads import hf, samples

LEVELS = ("highest", "high", "medium")


def folder(path: Path) -> Path:
    """A small GPT-2 (4 layers, width 256, random weights) and a byte-level BPE tokenizer without a pad token."""
    if (path / "config.json").exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(list(samples.SENTENCES), trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(fast), n_embd=256, n_layer=4, n_head=4, n_positions=256,
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def native(lm: hf.CausalLM, prompts: list[str], tokens: int, rows: int) -> None:
    """Greedy decoding of ``tokens`` tokens from ``prompts`` with the cache, ``rows`` times, as a user's own
    ``generate`` runs it."""
    batch = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        for _ in range(rows):
            lm.model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=lm.tokenizer.pad_token_id)


def check(lm: hf.CausalLM, prompts: list[str], tokens: int) -> tf32lab.GenerationReport:
    return tf32lab.check_generation(lm, new_tokens=tokens, prompts=prompts, levels=LEVELS, target="a100")


def rows_native(report: tf32lab.GenerationReport) -> int:
    """One native generation per level the report shows (the levels asked)."""
    return len(report.levels)


def _child(what: str, path: str, tokens: int, n: int) -> None:
    import rich.console  # noqa: F401  (what a check imports, in the idle figure too)

    import tf32lab.measure.generation  # noqa: F401

    lm = hf.causal_lm(path)
    prompts = list(samples.SENTENCES[:n])
    if what == "native":
        native(lm, prompts, tokens, 1)
    elif what == "check":
        check(lm, prompts, tokens)
    print(_high_water_mib())


def _high_water_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _peak(what: str, path: Path, tokens: int, n: int) -> float:
    done = subprocess.run([sys.executable, __file__, "--child", what, "--folder", str(path), "--tokens", str(tokens),
                           "--prompts", str(n)], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.folder, args.tokens, args.prompts)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = folder(Path(tmp) / "gpt2")
        lm = hf.causal_lm(str(path))
        prompts = list(samples.SENTENCES[:args.prompts])
        header(f"the generation check of a GPT-2 (4 layers, width 256; {args.tokens} tokens x {args.prompts} prompts, "
               f"levels {', '.join(LEVELS)} on a100) as a multiple of native greedy decoding of the same tokens, "
               f"once per level", WALL)
        rows = rows_native(check(lm, prompts, 2))  # warm up both
        native(lm, prompts, 2, 1)
        times: dict[str, list[float]] = {"native": [], "check": []}
        for _ in range(args.rounds):  # interleaved: native, check, native, check, ...
            for name in ("native", "check"):
                started = time.perf_counter()
                if name == "native":
                    native(lm, prompts, args.tokens, rows)
                else:
                    check(lm, prompts, args.tokens)
                times[name].append(time.perf_counter() - started)
        t_native, t_check = (statistics.median(times[k]) for k in ("native", "check"))
        ratio = t_check / t_native
        # a peak is one child's: glibc's arenas and the threads' timing move it by a few MiB, a tenth of the native
        # figure here, so each side is the median of --rounds children, interleaved as the times are
        peaks: dict[str, list[float]] = {"idle": [], "native": [], "check": []}
        for _ in range(args.rounds):
            for what in peaks:
                peaks[what].append(_peak(what, path, args.tokens, args.prompts))
        idle, gen, full = (statistics.median(peaks[k]) for k in ("idle", "native", "check"))
        extra_gen, extra_check = gen - idle, full - idle
        mem = extra_check / extra_gen if extra_gen > 0 else float("inf")
        time_ok, mem_ok = ratio <= 6, mem <= 2.5
        print(f"{'time':<8} native {rows} rows {t_native:.2f} s, generation check {t_check:.2f} s (medians of "
              f"{args.rounds}): {ratio:.1f}x (goal <= 6x): {'PASSED' if time_ok else 'FAILED'}")
        print(f"{'memory':<8} peak RSS: idle {idle:.0f} MiB, native generation +{extra_gen:.1f} MiB, generation "
              f"check +{extra_check:.1f} MiB (medians of {args.rounds}): {mem:.1f}x (goal <= 2.5x): "
              f"{'PASSED' if mem_ok else 'FAILED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
