"""``autoconfig(compile_cache=PATH)`` warm start on CUDA: a compiled MiniLM-sized encoder in fresh processes.

Three fresh processes in turn, as ``benchmarks/compile_cache.py`` does on a CPU: cold (an empty folder; it
compiles, then ``tf32lab.save_compile_cache``), the same folder again, and a new folder holding only the Mega-Cache
artifact. Each reports its wall seconds from start to the first compiled forward's result and the time of that
first call alone. The model is an all-MiniLM-L6-v2-sized BERT encoder with random weights, on the GPU when there is
one.

    PYTHONPATH=src python scripts/gpu/compile_cache_cuda.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CHILD = textwrap.dedent("""
    import sys, time, torch, tf32lab
    from transformers import BertConfig, BertModel
    folder, save = sys.argv[1], sys.argv[2] == "save"
    tf32lab.autoconfig(compile_cache=folder)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    model = BertModel(config).to(device).eval()
    ids = torch.randint(0, config.vocab_size, (64, 32), device=device)
    compiled = torch.compile(model)
    started = time.perf_counter()
    with torch.no_grad():
        out = compiled(input_ids=ids).last_hidden_state
    float(out.sum())
    print("first compiled call", round(time.perf_counter() - started, 2), "s")
    if save:
        tf32lab.save_compile_cache(folder)
""")


def run(label: str, folder: Path, save: bool) -> None:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(folder), "save" if save else "load"],
                          capture_output=True, text=True, timeout=280, env=os.environ.copy())
    seconds = time.perf_counter() - started
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("first")), "")
    tail = "" if done.returncode == 0 else f" FAILED (exit {done.returncode}): {done.stderr[-1500:]}"
    print(f"{label:<22} process {seconds:6.2f} s, {line}{tail}", flush=True)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        first, second = Path(tmp, "cold"), Path(tmp, "shipped")
        run("cold (compile, save)", first, save=True)
        run("warm folder", first, save=False)
        second.mkdir(mode=0o700)
        for name in ("tf32lab-mega-cache.bin", "tf32lab-mega-cache.json"):  # only the artifact travels
            if (first / name).exists():
                shutil.copy(first / name, second / name)
        run("Mega-Cache only", second, save=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
