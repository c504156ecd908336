"""What ``torch.compile`` changes about precision behind PyTorch's flags: Inductor settings, and flag writes
compiled into a graph. ``doctor`` turns each finding into a warning.

Nothing here imports Inductor or Dynamo: a setting is read from the live config when the program has loaded it,
else from its environment variable and PyTorch's default; compiled code is looked at only when Dynamo is loaded.

- **Shape padding** (``torch._inductor.config.shape_padding``, ``TORCHINDUCTOR_SHAPE_PADDING``, on by default):
  pads matmul shapes for tensor cores; a compiled 1x1 ``Conv2d`` drifted from eager at ``highest`` on a TF32 GPU
  (pytorch#175854, left open as intended behaviour).
- **1x1 convolutions as matmuls** (``conv_1x1_as_mm``, off by default): such a convolution then follows the matmul
  cell (``cuda.matmul``), not cuDNN's (``cuda.conv``), whose defaults differ (IEEE vs TF32).
- **Triton GEMMs at the TF32 flag** (``force_same_precision`` off, torch before 2.13, with max-autotune set in the
  config or environment; ``torch.compile(mode="max-autotune")`` sets it only while it compiles, unseen here):
  Triton templates use TF32 for every shape, where cuBLAS keeps IEEE for shapes that are not multiples of 16, 16, 8
  (the option's own comment in ``torch/_inductor/config.py``).
- **A flag written inside a compiled function** may govern nothing compiled with it: a write Dynamo traces is
  applied after the graph, and Inductor's matmuls run at the level in force outside (measured on torch 2.4.1 and
  2.13.0 on a CPU: ``set_float32_matmul_precision("medium")`` and back around ``x @ w`` in a compiled function gave
  the ``highest`` bits; axolotl#3938 saw a Newton-Schulz step diverge under TF32 this way). A write Dynamo cannot
  trace breaks the graph and runs eagerly, correctly; ``tf32lab.precision()`` and tf32lab's setter are such.
  Read by bytecode: only the compiled function's own code and the functions defined in it (not a helper it calls,
  which Dynamo inlines, nor a setter imported under another name).

Example:

    >>> from tf32lab.machine import inductor
    >>> sorted(inductor.settings())
    ['conv_1x1_as_mm', 'force_same_precision', 'max_autotune', 'max_autotune_gemm', 'shape_padding']
"""

from __future__ import annotations

import dis
import os
import sys
from collections.abc import Mapping
from types import CodeType
from typing import Any, Optional

__all__ = ["alerts", "compiled_flag_writes", "settings"]

# setting -> (environment variable, PyTorch's default when unset; None: the setting has no variable)
_ENV: dict[str, tuple[Optional[str], bool]] = {
    "shape_padding": ("TORCHINDUCTOR_SHAPE_PADDING", True),
    "conv_1x1_as_mm": (None, False),
    "force_same_precision": ("TORCHINDUCTOR_FORCE_SAME_PRECISION", False),
    "max_autotune": ("TORCHINDUCTOR_MAX_AUTOTUNE", False),
    "max_autotune_gemm": ("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", False),
}

# Names whose call or assignment writes a precision flag.
_WRITERS = ("set_float32_matmul_precision", "_set_float32_matmul_precision", "_set_fp32_precision_setter",
            "_set_cublas_allow_tf32", "_set_cudnn_allow_tf32")
_ATTRIBUTES = ("allow_tf32", "fp32_precision", "allow_bf16_reduced_precision_reduction",
               "allow_fp16_reduced_precision_reduction")


def settings(env: Optional[Mapping[str, str]] = None) -> dict[str, Optional[bool]]:
    """Each Inductor setting that bears on precision: live when Inductor's config is loaded, else from the
    environment and PyTorch's default; None where this torch has no such setting (``force_same_precision`` went
    away in 2.13)."""
    env = os.environ if env is None else env
    config = sys.modules.get("torch._inductor.config")
    out: dict[str, Optional[bool]] = {}
    for name, (variable, default) in _ENV.items():
        if config is not None:
            value = getattr(config, name, None)
            out[name] = None if value is None else bool(value)
        elif variable is None or variable not in env:
            out[name] = default if name != "force_same_precision" or _has_force_same_precision() else None
        else:
            out[name] = env[variable] == "1"
    return out


def _has_force_same_precision() -> bool:
    # Read from the config's source, not by importing it (Inductor is heavy); the option went away in 2.13.
    import torch

    try:
        with open(os.path.join(os.path.dirname(torch.__file__), "_inductor", "config.py"), encoding="utf-8") as f:
            return "\nforce_same_precision" in f.read()
    except OSError:
        return False


def _writes_flag(code: CodeType) -> Optional[str]:
    """The first precision-flag write in ``code`` or the functions defined inside it, by name."""
    before = None
    for instruction in dis.get_instructions(code):
        name = instruction.argval
        if instruction.opname == "STORE_ATTR" and name in _ATTRIBUTES:
            return f"{name} = ..."
        if (instruction.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME") and name in _WRITERS
                and before != "tf32lab"):  # tf32lab's own setter breaks the graph: it runs eagerly
            return f"{name}()"
        before = name
    for const in code.co_consts:
        if isinstance(const, CodeType):
            found = _writes_flag(const)
            if found:
                return found
    return None


def _compiled_codes() -> list[CodeType]:
    """The code objects ``torch.compile`` traced in this process (none when Dynamo was never loaded, or this torch
    keeps no record of them)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    seen: Any = getattr(getattr(convert_frame, "input_codes", None), "seen", None)
    if not isinstance(seen, list):
        return []
    codes = (ref() if callable(ref) else None for ref in list(seen))
    return [code for code in codes if isinstance(code, CodeType)]


def compiled_flag_writes() -> list[str]:
    """``file:line function: write`` for each function ``torch.compile`` traced in this process that writes a
    precision flag."""
    import torch

    # PyTorch's own setters (traced when the user's code calls them) and tf32lab's scopes (never compiled)
    own = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__, os.path.dirname(__file__)))
    found = []
    for code in _compiled_codes():
        if code.co_filename.startswith(own):
            continue
        if code.co_name.startswith("torch_dynamo_resume_in_"):
            continue  # Dynamo's continuation of a function after a graph break: the function is reported itself
        write = _writes_flag(code)
        if write:
            found.append(f"{code.co_filename}:{code.co_firstlineno} {code.co_name}: {write}")
    return found


def alerts(cells: Mapping[str, str], tensor_cores: bool, env: Optional[Mapping[str, str]] = None, *,
           gpu: bool = True) -> list[tuple[str, str]]:
    """``(code, message)`` for each way compiled code here would not compute at the flags in ``cells``.

    ``tensor_cores``: the machine (or simulated target) has TF32 units, where shape padding and Triton's TF32 matter;
    ``gpu``: it computes on a CUDA GPU, whose cells (``cuda.*``) these are.
    """
    env = os.environ if env is None else env
    found = settings(env)
    out = []
    # On by default: worth a word only to a program that has compiled something, or where it is asked for by name.
    asked = env.get("TORCHINDUCTOR_SHAPE_PADDING") == "1" or bool(_compiled_codes())
    if tensor_cores and found["shape_padding"] and asked:
        out.append(("inductor-shape-padding", (
            "torch.compile pads matmul shapes for tensor cores (Inductor's shape_padding, on by default): a compiled "
            "1x1 Conv2d was seen to drift from eager at 'highest' on a TF32 GPU (pytorch#175854); "
            "TORCHINDUCTOR_SHAPE_PADDING=0 turns it off")))
    if gpu and found["conv_1x1_as_mm"] and cells.get("cuda.conv") != cells.get("cuda.matmul"):
        out.append(("inductor-conv-as-matmul", (
            f"Inductor's conv_1x1_as_mm is on: compiled 1x1 convolutions follow cuda.matmul "
            f"({cells.get('cuda.matmul')!r}), not cuda.conv ({cells.get('cuda.conv')!r})")))
    if (tensor_cores and found["force_same_precision"] is False
            and (found["max_autotune"] or found["max_autotune_gemm"]) and cells.get("cuda.matmul") == "tf32"):
        out.append(("inductor-triton-tf32", (
            "max-autotune with force_same_precision off: Triton GEMM templates use TF32 for every shape, where "
            "cuBLAS keeps IEEE for shapes that are not multiples of 16, 16, 8; "
            "TORCHINDUCTOR_FORCE_SAME_PRECISION=1 keeps them alike")))
    for where in compiled_flag_writes():
        out.append(("flag-written-while-compiled", (
            f"{where} is compiled by torch.compile and writes a precision flag: where Dynamo traces the write, it "
            "is applied after the graph and the matmuls compiled with it run at the level in force outside; set "
            "the flag outside the compiled function, or use tf32lab.precision(), which breaks the graph")))
    return out
