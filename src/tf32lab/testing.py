"""Tolerances derived from the math, not guessed: how far a product ``a @ b`` can be off under a level on a target.

Under a math whose operands are rounded with unit roundoff ``u`` (TF32: 2^-11, bf16: 2^-8; IEEE float32:
2^-24), each term a_ik·b_kj of a K-long dot product is off by up to 2u·|a_ik|·|b_kj|, and the K errors, of random
sign, add up to about sqrt(K) times one of them. So element (i, j) of the product gets

    tolerance_ij = factor · sqrt(K) · (2u + 2^-24) · max_k |a_ik| · max_k |b_kj|

(the inner-product bound of Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1, with the
sqrt(K) growth of random rounding errors of Higham and Mary, "A New Approach to Probabilistic Rounding Error
Analysis", SIAM J. Sci. Comput. 41(5), 2019; TF32 keeps 10 explicit mantissa bits, NVIDIA's A100 architecture
whitepaper, 2020; 2^-24 is float32's own accumulation). ``factor`` (default 4) covers the spread of that sum
over many elements.

Which math: by default the one in force where the check runs, as the computation being checked got it: inside
``emulate(target)`` (the pytest plugin's ``--tf32lab a100:high`` puts every test body there) the emulated
target's math at the scope's level; outside it, this machine's own at the level in force. ``level=`` and
``target=`` ask for another one; the math comes from the target's table (``emulate(target)`` would use the
same), so ``level="highest"`` on an A100 gives float32's tolerance, and ``high`` TF32's.

Example:

    >>> import torch, tf32lab
    >>> from tf32lab.testing import assert_close, tolerance
    >>> a, b = torch.randn(64, 512), torch.randn(512, 32)
    >>> exact = (a.double() @ b.double()).float()
    >>> # the tolerance follows the emulated target and the level in force: TF32 on an A100 at `high`
    >>> with tf32lab.precision("high"), tf32lab.emulate("a100"):
    ...     y = a @ b
    ...     assert_close(y, exact, operands=(a, b))                          # passes
    >>> bool((y - exact).abs().max() < tolerance(a, b, level="high", target="a100").min())
    True
    >>> assert_close(y, exact, operands=(a, b), level="highest", target="a100")   # float32's: too tight
    Traceback (most recent call last):
    ...
    AssertionError: ... elements exceed the tolerance of a 512-long product at 'highest' on a100 (ieee)...
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import check_level

__all__ = ["UNIT_ROUNDOFF", "assert_close", "tolerance", "unit_roundoff"]

UNIT_ROUNDOFF = {"ieee": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-8, "tf32x3": 2.0**-21, "bf16x3": 2.0**-16,
                 "bfx9": 2.0**-24}  # nine bf16 products keep all 24 bits of each operand
FLOAT32 = 2.0**-24


def _native_target(device: torch.device) -> str:
    """The target that describes how this machine computes on ``device`` (no emulation)."""
    from tf32lab.machine.hardware import detect

    machine = detect()
    if device.type == "cuda" and machine.gpus:
        return machine.target
    return "cpu-amx" if "amx_bf16" in machine.isa else "cpu"


def _math(level: Optional[str], target: Optional[str], device: torch.device) -> tuple[str, str, str]:
    """``(math, level, target)`` of a float32 matmul: what is asked for, else what is in force here."""
    from tf32lab.control.scope import current_emulation, get_float32_matmul_precision
    from tf32lab.emulation.emulator import context_cells
    from tf32lab.know.targets import get

    if level is not None:
        check_level(level)
    forced = None
    if target is None:
        entry = current_emulation()
        if entry is not None:  # as the emulator computes this context's ops (its forced math included)
            resolved, forced = entry.emu.target, entry.emu.math
        else:
            resolved = get(_native_target(device))
    else:
        resolved = get(target)
    cells = context_cells()
    maths = resolved.maths_at(level, cells) if level is not None else resolved.maths(cells)
    name = str(forced) if forced is not None else maths["matmul"]
    return name, level or get_float32_matmul_precision(), resolved.name


def unit_roundoff(level: Optional[str] = None, target: Optional[str] = None) -> tuple[float, str]:
    """The operands' unit roundoff of a float32 matmul at ``level`` on ``target``, and the math's name.

    Each left out is the one in force here: the level of this thread's scope (else the process's), the target
    of the ``emulate()`` block this code runs in (else this machine's CPU).

    >>> unit_roundoff("high", "a100")
    (0.00048828125, 'tf32-rna')
    """
    name, _, _ = _math(level, target, torch.device("cpu"))
    return UNIT_ROUNDOFF[name.split("-")[0]], name


def tolerance(a: torch.Tensor, b: torch.Tensor, *, level: Optional[str] = None, target: Optional[str] = None,
              factor: float = 4.0) -> torch.Tensor:
    """Per element of ``a @ b`` (broadcast over batch dimensions): how far it may be off (module docstring).

    ``level`` and ``target`` left out: the ones in force here, as :func:`assert_close` takes them."""
    return _tolerance(a, b, _math(level, target, a.device)[0], factor)


def _tolerance(a: torch.Tensor, b: torch.Tensor, math_name: str, factor: float) -> torch.Tensor:
    if a.dim() < 1 or b.dim() < 1 or a.shape[-1] != b.shape[-2 if b.dim() > 1 else 0]:
        raise Tf32LabError(f"tolerance(a, b): shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    u = UNIT_ROUNDOFF[math_name.split("-")[0]]
    k = a.shape[-1]
    rows = a.detach().abs().amax(dim=-1, keepdim=True).double()  # (..., M, 1)
    cols = b.detach().abs().amax(dim=-2 if b.dim() > 1 else 0, keepdim=True).double()  # (..., 1, N)
    bound = factor * math.sqrt(k) * (2 * u + FLOAT32) * rows * cols
    # shaped as torch.matmul shapes a @ b: a vector operand's dimension is dropped (mv: (M,), a vector times a
    # matrix: (N,), dot: a scalar), so the bound meets the values it is compared with
    if b.dim() == 1:
        bound = bound.squeeze(-1)
    if a.dim() == 1 and b.dim() > 1:
        bound = bound.squeeze(-2)
    return bound.to(torch.promote_types(a.dtype, torch.float32)) if a.dim() > 1 and b.dim() > 1 else bound


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, operands: tuple[torch.Tensor, torch.Tensor],
                 level: Optional[str] = None, target: Optional[str] = None, factor: float = 4.0,
                 msg: Optional[str] = None) -> None:
    """Assert ``|actual - expected| <= tolerance(*operands)`` elementwise: ``actual`` computes the product of
    ``operands`` (and perhaps cheap elementwise work after it) as the hardware in force computes it.

    The tolerance is that of the math in force where it is called, which is the one ``actual`` was computed
    with when the check sits beside the computation: the target of the ``emulate()`` block (under the pytest
    plugin, ``--tf32lab TARGET:LEVEL`` or a ``tf32lab`` marker: the test's own), else this machine's, at the
    level of the scope in force. So one test asserts the right thing at every ``--tf32lab`` setting, where a
    fixed tolerance is either too loose for float32 or too tight for TF32. ``level=``/``target=`` fix either.

    Example:

        >>> import torch, tf32lab
        >>> from tf32lab.testing import assert_close
        >>> _ = torch.manual_seed(0)
        >>> a, b = torch.randn(32, 1024), torch.randn(1024, 16)
        >>> exact = (a.double() @ b.double()).float()
        >>> # under `pytest --tf32lab a100:high` a test body runs as in this block: TF32's tolerance
        >>> with tf32lab.precision("high"), tf32lab.emulate("a100"):
        ...     y = a @ b
        ...     assert_close(y, exact, operands=(a, b))
        >>> # at `highest` (as under `--tf32lab a100:highest`) float32's, which TF32's result does not meet
        >>> with tf32lab.emulate("a100"):
        ...     assert_close(y, exact, operands=(a, b))
        Traceback (most recent call last):
        ...
        AssertionError: ... elements exceed the tolerance of a 1024-long product at 'highest' on a100 (ieee)...
    """
    name, in_force, on = _math(level, target, operands[0].device)
    bound = _tolerance(*operands, name, factor)
    diff = (actual.detach().double() - expected.detach().double()).abs()
    try:
        bound = torch.broadcast_to(bound.double(), diff.shape)
    except RuntimeError:
        raise Tf32LabError(f"assert_close: the product of the operands has shape "
                           f"{tuple(torch.broadcast_shapes(bound.shape))}, the values {tuple(diff.shape)}") from None
    bad = (diff > bound) | torch.isnan(diff)
    if bool(bad.any()):
        worst = int(torch.argmax(torch.where(torch.isnan(diff), torch.inf, diff / bound.clamp_min(1e-300))))
        off, allowed = float(diff.flatten()[worst]), float(bound.flatten()[worst])
        detail = (f"{int(bad.sum())} of {diff.numel()} elements exceed the tolerance of a "
                  f"{operands[0].shape[-1]}-long product at {in_force!r} on {on} ({name}); the worst, at flat "
                  f"index {worst}, is off by {off:.3g} against {allowed:.3g}")
        raise AssertionError(f"{msg}: {detail}" if msg else detail)
