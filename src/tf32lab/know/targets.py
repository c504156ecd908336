"""Targets: what math each op family gets on a piece of hardware, given PyTorch's precision flags.

One row per hardware profile. A row maps each *key* (an op family, or an attention kernel) to an :class:`Entry`:
the flag cell PyTorch consults for it and, per value of that cell, the math the hardware then computes. Every
entry names its source (PyTorch code or notes, vendor documentation, a paper); an entry marked ``verify on GPU``
is a reasoned assumption not yet measured on the device.

Keys: ``matmul``, ``conv``, ``rnn``, ``matvec``, ``linalg``, ``attention`` (the kernel PyTorch picks for float32
``scaled_dot_product_attention``), ``attention.math`` and ``attention.efficient`` (the two kernels by name),
``matmul.gemv`` (a product with one row, one column or an inner dimension of 1, or ``F.affine_grid``'s thin
one, which cuBLAS may hand to a kernel without tensor cores), ``conv.depthwise`` (the forward and input gradient of
cuDNN's depthwise convolutions, which PyTorch sends there channels-last; their weight gradient is ``conv``'s) and
``linalg.trsm`` (the triangular solves under PyTorch's cuBLAS handle inside ``solve_triangular``, ``lu_solve``,
``linalg.solve``, ``inv`` and ``lstsq``).

TF32 operand rounding: measured RNE for cuBLAS on an H100 (docs/gpu-results.md); RNA on Ampere and Ada from one
report (pytorch#53635), unmeasured here. cuDNN picks the rounding per kernel (on the H100: RNE for most, RNA for
some, no TF32 for a few); a target gives one rounding for all convolutions and RNNs, so their emulation matches
the GPU within rounding-mode noise, never bit for bit.

Example:

    >>> from tf32lab import targets
    >>> a100 = targets.get("a100")
    >>> cells = {"cuda.matmul": "ieee", "cuda.conv": "tf32"}       # the level "highest", PyTorch's defaults
    >>> str(a100.math("matmul", cells)), str(a100.math("conv", cells))   # convs run TF32 even at highest
    ('ieee', 'tf32-rna')
    >>> str(targets.get("v100").math("conv", cells))                     # no TF32 before Ampere
    'ieee'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional, Union

from tf32lab.errors import Tf32LabError
from tf32lab.know.levels import level_cells
from tf32lab.know.peaks import DATASHEET, SMS, Peaks
from tf32lab.numbers import accumulation_models as acc
from tf32lab.numbers.accumulation_models import Accumulation

__all__ = ["CELL_VALUES", "KEYS", "MATHS", "NATIVE", "PROJECTED", "SUMMED", "TARGETS", "Entry", "Math", "Target",
           "check_value", "counted_math", "get", "native", "rnn_key", "rnn_math", "speed_targets", "table"]

NATIVE = "native"  # the name of this machine's own hardware as a target: run, never emulated

MATHS = ("ieee", "tf32", "bf16", "bf16x3", "tf32x3", "bfx9")
# Every value a cell can hold that this module knows (besides "none", which flags resolves to the parent's value).
# "bfx9": cuBLAS's float32 emulated with nine bf16 products, cuda.matmul only (pytorch#195301). A value outside
# this list comes from a torch newer than tf32lab: it is reported as unknown, never read as IEEE.
CELL_VALUES = ("ieee", "tf32", "bf16", "bfx9")
KEYS = ("matmul", "conv", "rnn", "matvec", "linalg", "attention", "attention.math", "attention.efficient",
        "matmul.gemv", "linalg.trsm", "conv.depthwise")

_SINGLE = ("tf32", "bf16")  # one rounding of each operand; the rest are exact (ieee) or split (x3: two, x9: three)


@dataclass(frozen=True)
class Math:
    """What one op computes: ``name`` in MATHS, and the rounding of operands for ``tf32`` / ``bf16``.

    ``tf32x3`` splits as CUTLASS's fast-fp32 kernels do (big: truncated, small: RNA), ``bf16x3`` as
    Henry et al. (both parts RNE) and ``bfx9`` in three RNE bf16 parts, all nine products kept (cuBLAS
    ``CUBLAS_COMPUTE_32F_EMULATED_16BFX9``), so they take no rounding.

    >>> str(Math("tf32", "rna")), str(Math("bf16x3"))
    ('tf32-rna', 'bf16x3')
    """

    name: str
    rounding: Optional[str] = None

    def __post_init__(self) -> None:
        if self.name not in MATHS:
            raise Tf32LabError(f"unknown math {self.name!r}; accepted: {', '.join(map(repr, MATHS))}")
        if (self.rounding is not None) != (self.name in _SINGLE):
            raise Tf32LabError(f"math {self.name!r} takes {'a' if self.name in _SINGLE else 'no'} rounding")

    def __str__(self) -> str:
        return f"{self.name}-{self.rounding}" if self.rounding else self.name


IEEE = Math("ieee")
TF32_RNA = Math("tf32", "rna")
TF32_RNE = Math("tf32", "rne")
BF16_RNE = Math("bf16", "rne")
TF32X3 = Math("tf32x3")
BFX9 = Math("bfx9")


@dataclass(frozen=True)
class Entry:
    """How one key is decided: the flag ``cell`` consulted (None: fixed) and ``math`` per cell value.

    A value may name another key instead of a Math (``"matmul"``: computed as that key would be).
    ``"*"`` matches any value.
    """

    cell: Optional[str]
    math: Mapping[str, Union[Math, str]]
    source: str


SUMMED = ", "  # between a coverage label's math and how a "hardware" block summed its products (the emulator's)


def counted_math(label: str) -> str:
    """The math of an emulator's ``coverage`` count's label (``"tf32-rna"``), without how the products were summed,
    which a ``"hardware"`` block appends to it (``"tf32-rna, nvidia k4 f24"``, ``"ieee, ideal sum"``).

    >>> counted_math("tf32-rna, nvidia k4 f24"), counted_math("ieee, ideal sum"), counted_math("ieee")
    ('tf32-rna', 'ieee', 'ieee')
    """
    return label.partition(SUMMED)[0]


# ``torch.backends.cudnn.enabled`` as a cell, "on" or "off". Off, a GPU runs no convolution or RNN in cuDNN (or
# MIOpen): a convolution goes to PyTorch's Slow2d / SlowDilated / SlowTranspose backends, im2col and a cuBLAS GEMM
# under the matmul flag (a depthwise one to its own CUDA kernels, IEEE: aten/src/ATen/native/Convolution.cpp,
# _select_conv_backend), and an RNN to its native layers of at::linear GEMMs (aten/src/ATen/native/RNN.cpp,
# cudnn_is_acceptable): both at the level's math, as matmuls are.
CUDNN_CELL = "cudnn"
CUDNN_KEYS = ("conv", "rnn")


def _fixed(math: Math, source: str) -> Entry:
    return Entry(None, MappingProxyType({"*": math}), source)


def _by(cell: str, source: str, **math: Union[Math, str]) -> Entry:
    return Entry(cell, MappingProxyType(math), source)


@dataclass(frozen=True)
class Target:
    """A hardware profile: ``entries`` maps each key of KEYS to an :class:`Entry`; a GPU's ``peaks`` feed the speed
    model. ``emulated`` is False only for :func:`native`, this machine's own hardware, where levels run for real.

    Made once from a name where the user gives one (:func:`get`, the CLI, the public functions) and passed down.
    """

    name: str
    title: str
    device: str  # "cuda" or "cpu": whose flag cells apply
    capability: Optional[tuple[int, int]]
    entries: Mapping[str, Entry]
    peaks: Optional[Peaks] = None
    emulated: bool = True
    # how the hardware sums a GEMM's products, per math name (``emulate(accumulation="hardware")``); a math
    # missing here is summed as the ideal unit would (exact products, float32 sums)
    accumulation: Mapping[str, Accumulation] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    vendor: str = "nvidia"  # "amd": a ROCm GPU (PyTorch's cuda flag cells; a gfx architecture, not an sm)

    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise Tf32LabError(f"unknown key {key!r}; accepted: {', '.join(map(repr, KEYS))}") from None

    def math(self, key: str, cells: Mapping[str, str]) -> Math:
        """The math for ``key`` when the flag cells hold ``cells`` (``flags.read_cells()`` plus ``sdpa`` and
        ``cudnn``)."""
        key = self.table_key(key, cells)
        seen = []
        while True:
            entry = self.entry(key)
            value = cells.get(entry.cell, "ieee") if entry.cell else "*"
            math = entry.math.get(value)
            if math is None and value != "*":
                check_value(self, entry.cell or "", value)
                math = entry.math.get("*")
            if math is None:  # a value this hardware ignores (bf16 on cuBLAS): PyTorch falls back to IEEE
                return IEEE
            if isinstance(math, Math):
                return math
            seen.append(key)
            if math in seen:
                raise Tf32LabError(f"target {self.name!r}: keys {seen} refer to each other")
            key = math

    def table_key(self, key: str, cells: Mapping[str, str]) -> str:
        """The key whose entry gives ``key``'s math under ``cells``: a convolution's or an RNN's with cuDNN off is
        the matmul's (PyTorch's own kernels, their GEMMs cuBLAS's: see CUDNN_CELL).

        >>> get("a100").table_key("conv", {"cudnn": "off"}), get("a100").table_key("conv", {"cudnn": "on"})
        ('matmul', 'conv')
        """
        return "matmul" if key in CUDNN_KEYS and self.device == "cuda" and cells.get(CUDNN_CELL) == "off" else key

    def maths(self, cells: Mapping[str, str]) -> dict[str, str]:
        """The math of every key when the flag cells hold ``cells``, by key (a pure lookup)."""
        return {key: str(self.math(key, cells)) for key in KEYS}

    def maths_at(self, level: str, cells: Mapping[str, str]) -> dict[str, str]:
        """The math of every key at ``level``: the level's cells over ``cells`` (those a level leaves alone: convs,
        RNNs, the SDPA kernel). The one answer to "which math does this target give at this level", asked of
        the table, never by entering a scope.

        >>> get("a100").maths_at("high", {"cuda.conv": "ieee", "sdpa": "math"})["matmul"]
        'tf32-rna'
        """
        return self.maths({**cells, **level_cells(level)})

    def accumulation_of(self, math: Math) -> Optional[Accumulation]:
        """How this hardware sums the products of a GEMM in ``math``; None where no model is known.

        >>> str(get("a100").accumulation_of(TF32_RNA)), str(get("h100").accumulation_of(IEEE))
        ('nvidia k4 f24', 'fma')
        """
        return self.accumulation.get(math.name)

    def speed_peaks(self) -> Peaks:
        """The peaks the speed model divides by; a one-line error for a target without (CPUs: measure them)."""
        if self.peaks is None:
            gpus = ", ".join(map(repr, speed_targets()))
            raise Tf32LabError(f"no speed model for target {self.name!r}: predictions cover GPU targets ({gpus}); "
                               f"on a CPU, measure it: `tf32lab speed SPEC --target native --measure`, or "
                               f"tf32lab.bench")
        return self.peaks

    def math_name(self, key: str, cells: Mapping[str, str]) -> str:
        """``str(self.math(key, cells))``, or ``"unknown"`` where a cell holds a value this target cannot compute
        (for tables that show every key: doctor's, ``tf32lab targets``)."""
        try:
            return str(self.math(key, cells))
        except Tf32LabError:
            return "unknown"

    def __repr__(self) -> str:
        cap = f" sm{self.capability[0]}{self.capability[1]}" if self.capability else ""
        return f"<Target {self.name}: {self.title}{cap}>"


# -- sources ---------------------------------------------------------------------------------------------------
_S_CUBLAS = ("aten/src/ATen/Context.cpp: cuda.matmul=tf32 -> cuBLAS TF32; operands RNA as CUTLASS's "
             "round_half_ulp_truncate and pytorch#53635 ([1024.5] @ [[1.0]] gave 1025 on an RTX 3090); "
             "unmeasured on Ampere and Ada")
_S_CUBLAS_HOPPER = ("aten/src/ATen/Context.cpp: cuda.matmul=tf32 -> cuBLAS TF32; operands RNE: measured on an H100 "
                    "(docs/gpu-results.md)")
_S_CUBLAS_BLACKWELL = ("aten/src/ATen/Context.cpp: cuda.matmul=tf32 -> cuBLAS TF32, operands assumed RNE as measured "
                       "on an H100, verify on GPU; cuda.matmul=bfx9 -> CUBLAS_COMPUTE_32F_EMULATED_16BFX9, nine bf16 "
                       "products (pytorch#195301; cuBLAS docs, floating-point emulation), accumulation ideal here")
_S_CUDNN = ("PyTorch CUDA notes: cudnn.conv / cudnn.rnn fp32_precision, default tf32 (cudnn.allow_tf32=True); the "
            "rounding is cuDNN's kernel's own, assumed RNA as in CUTLASS; unmeasured on Ampere and Ada")
_S_CUDNN_HOPPER = ("PyTorch CUDA notes: cudnn.conv / cudnn.rnn fp32_precision, default tf32; the rounding is per "
                   "kernel, measured on an H100 (docs/gpu-results.md): RNE for 1x1, 3x3 with 256 channels, "
                   "channels_last, 5x5 and the RNN; RNA for 3x3 with 64 channels (NCHW), conv1d, conv3d; no TF32 for "
                   "3x3 with 8 channels and conv_transpose2d; RNE, the majority, is modelled")
_S_GEMV_HOPPER = ("mm/addmm/linear/bmm with one row, one column or an inner dimension of 1, and F.affine_grid's thin "
                  "bmm: no TF32 at any level, as cuBLAS takes a kernel without tensor cores: measured on an H100 and "
                  "an H200 (docs/gpu-results.md); assumed on Blackwell")
_S_DEPTHWISE_HOPPER = ("cuDNN's channels-last depthwise convolutions: no TF32 in the forward or the input gradient "
                       "at either setting of cuDNN's flag, in 8 shapes (2-D and 3-D, 3x3 to 7x7, 32 to 256 channels, "
                       "multipliers 1 and 2) measured on an H200, cuDNN 9.19 (docs/gpu-results.md; assumed on "
                       "Blackwell); the weight gradient takes TF32 in 5 of them (conv's math)")
_S_DEPTHWISE = ("cuDNN's channels-last depthwise convolutions follow cuDNN's flag, as a dense one; unmeasured before "
                "Hopper (on an H200 its forward and input gradient took no TF32)")
_S_GEMV_AMPERE = ("one-row products follow the matmul flag: pytorch#53635 (a 1x1 product rounded to TF32 on an RTX "
                  "3090, cuBLAS 11.1); unmeasured with a newer cuBLAS, which skips TF32 for them on an H100")
_S_TRSM = ("cuBLAS trsm under PyTorch's handle follows the matmul flag: solve_triangular, lu_solve, linalg.solve, "
           "inv and lstsq run TF32 at 'high', measured on an H100 (docs/gpu-results.md); assumed on Ampere")
_S_GEMV = ("aten Blas.cpp: mv/addmv/dot go to cuBLAS gemv, no tensor-core path; measured on an H100 (the same bits "
           "at 'high' as at 'highest', docs/gpu-results.md)")
_S_SOLVER = ("cuSOLVER / LAPACK factorizations take no TF32 math mode (PyTorch PR #67948); getrf, potrf, potrs, "
             "geqrf, syevd, gesvd measured unaffected on an H100 (docs/gpu-results.md)")
_S_SDPA = ("aten sdp_utils.cpp: float32 SDPA on sm80+ picks the memory-efficient kernel when enabled (flash "
           "needs fp16/bf16); verify on GPU")
_S_SDPA_MATH = "aten attention.cpp: SDPA's math backend is bmm/matmul, so it follows the matmul flag"
_S_EFFICIENT = ("PyTorch's mem_eff_attention (CUTLASS fast-fp32): the memory-efficient kernel runs 3xTF32 for "
                "float32 on sm80+")
_S_PRE_AMPERE = ("NVIDIA Ampere architecture whitepaper: no TF32 before Ampere (sm80); the flags are accepted and "
                 "have no effect")
_S_EFFICIENT_SIMT = ("PyTorch's mem_eff_attention (CUTLASS): before sm80 the memory-efficient kernel computes float32 "
                     "without tensor cores")
_S_ONEDNN_BF16 = ("PyTorch MKLDNN notes: mkldnn fp32_precision=bf16 -> oneDNN bf16 (AMX), RNE conversion; matmul "
                  "verified on a Sapphire Rapids CPU within float32 accumulation (docs/gpu-results.md)")
_S_ONEDNN_TF32 = ("mkldnn fp32_precision=tf32: PyTorch asks oneDNN for TF32 only on a CPU with AMX-FP16 "
                  "(aten/src/ATen/native/mkldnn/Matmul.cpp, use_mkldnn_tf32_matmul); without it the same bits as "
                  "IEEE, measured for matmul and conv on a Sapphire Rapids CPU (docs/gpu-results.md); a CPU with "
                  "AMX-FP16 is unmeasured (doctor's probe tells)")
_S_ONEDNN_MV = ("mv/addmv follow mkldnn.matmul (aten's CPU gemm tries oneDNN first): bf16 at 'medium' on a Sapphire "
                "Rapids CPU for all but the smallest (docs/gpu-results.md); dot and addr measured IEEE there, so "
                "emulating them in bf16 overstates their error")
_S_CPU = "aten/src/ATen/Context.cpp: a CPU without reduced-precision units computes IEEE float32 at every level"


PROJECTED = " with proj_size"  # the mark on an RNN op's name (rnn_math) where it is an LSTM with projections


def rnn_key(device: str, mode: str, projected: bool = False) -> str:
    """The key whose math an RNN's GEMMs take on a target of ``device``: on a GPU cuDNN's RNN kernel runs them all
    (``rnn``); on a CPU only an LSTM without projections has a kernel of its own (oneDNN's: aten RNN.cpp,
    ``lstm_mkldnn_stub``, under ``mkldnn.rnn``), while a GRU, an Elman RNN or an LSTM with ``proj_size`` runs as
    aten GEMMs under ``mkldnn.matmul`` (``matmul``: bf16 at `medium` on an AMX CPU). ``mode``: ``lstm``, ``gru``,
    ``rnn_tanh`` or ``rnn_relu``, or an op's name (``aten::gru.input``). The emulator's one answer, which the
    reports read too.

    >>> rnn_key("cuda", "gru"), rnn_key("cpu", "aten::lstm.input"), rnn_key("cpu", "gru")
    ('rnn', 'rnn', 'matmul')
    """
    mode = mode.split("::")[-1].split(".")[0]
    if device != "cpu":
        return "rnn"
    return "matmul" if mode != "lstm" or projected else "rnn"


def rnn_math(maths: Mapping[str, str], device: str, rnn_ops: Iterable[str]) -> Optional[str]:
    """The math the RNNs ``rnn_ops`` (op names) ran in, from a level's ``maths`` (:meth:`Target.maths_at`): one
    math, or the LSTMs' and the others' joined by ``/`` where a CPU target gives them two (an LSTM IEEE at
    `medium`, a GRU bf16); None where no RNN ran. An LSTM with ``proj_size`` is known by its call, not its name:
    its name is marked with :data:`PROJECTED` (``aten::lstm.input with proj_size``).

    >>> rnn_math({"rnn": "ieee", "matmul": "bf16-rne"}, "cpu", ["aten::lstm.input", "aten::gru.input"])
    'ieee/bf16-rne'
    """
    keys = sorted({rnn_key(device, op, op.endswith(PROJECTED)) for op in rnn_ops}, key=("rnn", "matmul").index)
    found = list(dict.fromkeys(maths[k] for k in keys if k in maths))
    return "/".join(found) if found else None


def check_value(target: Target, cell: str, value: str) -> None:
    """Raise when ``cell`` holds a value that ``target`` cannot compute: one this tf32lab does not know (from a
    newer torch), or ``bfx9`` before Blackwell (PyTorch raises there too)."""
    if value not in CELL_VALUES and value != "none":
        raise Tf32LabError(
            f"{cell} holds {value!r}, a value this tf32lab does not know (known: {', '.join(CELL_VALUES)}): a newer "
            f"torch's setting cannot be emulated; set a level or pass math= instead")
    capability = target.capability or (0, 0)
    if value == "bfx9" and cell == "cuda.matmul" and target.device == "cuda" and capability < (10, 0):
        where = target.title if target.vendor == "amd" else f"sm{capability[0]}{capability[1]}"
        raise Tf32LabError(
            f"level 'bfx9' (cuda.matmul = 'bfx9') needs compute capability 10.0 (NVIDIA Blackwell, target b200); on "
            f"target {target.name!r} ({where}) PyTorch raises for every float32 matmul (pytorch#195301)")


def _ampere_plus(capability: tuple[int, int]) -> dict[str, Entry]:
    hopper = capability >= (9, 0)
    tf32, cublas, cudnn = (TF32_RNE, _S_CUBLAS_HOPPER, _S_CUDNN_HOPPER) if hopper else (TF32_RNA, _S_CUBLAS, _S_CUDNN)
    if capability >= (10, 0):
        cublas = _S_CUBLAS_BLACKWELL
    bfx9 = {"bfx9": BFX9} if capability >= (10, 0) else {}
    return {
        "matmul": _by("cuda.matmul", cublas, tf32=tf32, ieee=IEEE, **bfx9),
        "conv": _by("cuda.conv", cudnn, tf32=tf32, ieee=IEEE),
        "rnn": _by("cuda.rnn", cudnn, tf32=tf32, ieee=IEEE),
        "matvec": _fixed(IEEE, _S_GEMV),
        "linalg": _fixed(IEEE, _S_SOLVER),
        "matmul.gemv": _fixed(IEEE, _S_GEMV_HOPPER) if hopper else _by("cuda.matmul", _S_GEMV_AMPERE,
                                                                       **{"*": "matmul"}),
        "linalg.trsm": _by("cuda.matmul", _S_TRSM, **{"*": "matmul"}),
        "conv.depthwise": _fixed(IEEE, _S_DEPTHWISE_HOPPER) if hopper else _by("cuda.conv", _S_DEPTHWISE,
                                                                                **{"*": "conv"}),
        "attention": _by("sdpa", _S_SDPA, efficient="attention.efficient", math="attention.math"),
        "attention.math": _by("cuda.matmul", _S_SDPA_MATH, **{"*": "matmul"}),
        "attention.efficient": _fixed(TF32X3, _S_EFFICIENT),
    }


def _pre_ampere() -> dict[str, Entry]:
    fixed = _fixed(IEEE, _S_PRE_AMPERE)
    return {
        "matmul": fixed, "conv": fixed, "rnn": fixed,
        "matvec": _fixed(IEEE, _S_GEMV),
        "linalg": _fixed(IEEE, _S_SOLVER),
        "matmul.gemv": fixed, "linalg.trsm": fixed, "conv.depthwise": fixed,
        "attention": _by("sdpa", _S_SDPA, efficient="attention.efficient", math="attention.math"),
        "attention.math": _by("cuda.matmul", _S_SDPA_MATH, **{"*": "matmul"}),
        "attention.efficient": _fixed(IEEE, _S_EFFICIENT_SIMT),
    }


def _onednn(reduced: bool) -> dict[str, Entry]:
    if not reduced:
        fixed = _fixed(IEEE, _S_CPU)
        entries = {key: fixed for key in ("matmul", "conv", "rnn", "matvec")}
    else:
        entries = {
            op: _by(f"mkldnn.{op}", f"{_S_ONEDNN_BF16}; {_S_ONEDNN_TF32}", bf16=BF16_RNE, tf32=IEEE, ieee=IEEE)
            for op in ("matmul", "conv", "rnn")
        }
        entries["matvec"] = _by("mkldnn.matmul", _S_ONEDNN_MV, **{"*": "matmul"})
    return {
        **entries,
        "linalg": _fixed(IEEE, _S_SOLVER),
        "matmul.gemv": _by("mkldnn.matmul", "a one-row product is a matmul to PyTorch; measured IEEE at 'medium' "
                           "on a Sapphire Rapids CPU (oneDNN's own choice), so bf16 here overstates its error",
                           **{"*": "matmul"}),
        "linalg.trsm": _fixed(IEEE, "LAPACK trsm: no reduced-precision path on a CPU"),
        "conv.depthwise": entries["conv"],
        "attention": _by("mkldnn.matmul", "CPU flash attention uses the CPU GEMM: follows the matmul flag",
                         **{"*": "matmul"}),
        "attention.math": _by("mkldnn.matmul", _S_SDPA_MATH, **{"*": "matmul"}),
        "attention.efficient": _by("mkldnn.matmul", "no separate kernel on CPU", **{"*": "matmul"}),
    }


def _nvidia_accumulation(capability: tuple[int, int]) -> Mapping[str, Accumulation]:
    """IEEE float32 as an SGEMM thread's FMA chain everywhere; TF32 per the architecture's MMA (MMA-Sim)."""
    models = {"ieee": acc.FMA}
    if capability >= (10, 0):
        models["tf32"] = acc.BLACKWELL
    elif capability >= (9, 0):
        models["tf32"] = acc.HOPPER
    elif capability >= (8, 0):
        models["tf32"] = acc.AMPERE
    return MappingProxyType(models)


def _cuda(name: str, title: str, capability: tuple[int, int], fp32: float, tf32: Optional[float],
          bf16: Optional[float], bandwidth: float, sms: int, source: str) -> Target:
    """A GPU: its maths from its capability, its peaks (dense TFLOP/s without sparsity, GB/s, SMs) as given."""
    entries = _ampere_plus(capability) if capability >= (8, 0) else _pre_ampere()
    peaks = Peaks(name, fp32, tf32, bf16, bandwidth, sms, source)
    return Target(name, title, "cuda", capability, MappingProxyType(entries), peaks,
                  accumulation=_nvidia_accumulation(capability))


_S_HIPBLASLT_XF32 = ("PyTorch on ROCm: cuda.matmul=tf32 -> hipBLASLt HIPBLAS_COMPUTE_32F_FAST_TF32 -> "
                     "v_mfma_f32_*_xf32 on gfx942, only with HIPBLASLT_ALLOW_TF32=1 in the environment (PyTorch's "
                     "test_linalg.py _hip_allow_tf32; assumed set); the instruction truncates operands to TF32 "
                     "(MMA-Sim section IV-F; jeffdaily/tf32_analysis: round-down model within 3.8e-6 of an MI300X)")
_S_HIPBLASLT_GFX950 = ("gfx950 has no XF32 instruction: hipBLASLt computes TF32 GEMMs as three bf16 products "
                       "(bf16x3), verify on GPU; with HIPBLASLT_ALLOW_TF32 unset, IEEE")
_S_MIOPEN = "MIOpen has no TF32 path for convolutions or RNNs: IEEE float32 at every setting (jeffdaily/tf32_analysis)"
_S_ROCM_GEMV = "rocBLAS gemv: no matrix-core path"


def _rocm(name: str, title: str, capability: tuple[int, int], tf32: Math, fp32: float, tf32_peak: float,
          bf16: float, bandwidth: float, cus: int, source: str) -> Target:
    """An AMD Instinct GPU under PyTorch's ROCm build: the ``cuda`` flag cells, hipBLASLt for GEMMs, MIOpen (IEEE)
    for convolutions and RNNs."""
    matmul_source = _S_HIPBLASLT_XF32 if tf32.name == "tf32" else _S_HIPBLASLT_GFX950
    ieee = _fixed(IEEE, _S_MIOPEN)
    entries = {
        "matmul": _by("cuda.matmul", matmul_source, tf32=tf32, ieee=IEEE),
        "conv": ieee, "rnn": ieee, "conv.depthwise": ieee,
        "matvec": _fixed(IEEE, _S_ROCM_GEMV),
        "linalg": _fixed(IEEE, _S_SOLVER),
        "matmul.gemv": _by("cuda.matmul", "one-row products follow the matmul flag in hipBLASLt; unmeasured",
                           **{"*": "matmul"}),
        "linalg.trsm": _by("cuda.matmul", "rocBLAS trsm under PyTorch's handle; assumed to follow the matmul flag",
                           **{"*": "matmul"}),
        "attention": _by("sdpa", _S_SDPA, efficient="attention.efficient", math="attention.math"),
        "attention.math": _by("cuda.matmul", _S_SDPA_MATH, **{"*": "matmul"}),
        "attention.efficient": _by("cuda.matmul", "ROCm's memory-efficient attention (aotriton) runs float32 "
                                   "through the matmul math; verify on GPU", **{"*": "matmul"}),
    }
    models = {"ieee": acc.FMA}
    if tf32.name == "tf32":
        models["tf32"] = acc.CDNA3_XF32
    peaks = Peaks(name, fp32, tf32_peak, bf16, bandwidth, cus, source)
    return Target(name, title, "cuda", capability, MappingProxyType(entries), peaks,
                  accumulation=MappingProxyType(models), vendor="amd")


# One row per target: name, title, capability, then its peaks: FP32 (SIMT), TF32 and bf16 (tensor cores) TFLOP/s,
# bandwidth GB/s, SMs, and where they come from.
TARGETS: Mapping[str, Target] = MappingProxyType({t.name: t for t in (
    _cuda("v100", "NVIDIA V100 (Volta)", (7, 0), 15.7, None, None, 900, 80, f"V100 SXM2: {DATASHEET}; {SMS} (GV100)"),
    _cuda("t4", "NVIDIA T4 (Turing)", (7, 5), 8.1, None, None, 320, 40, f"{DATASHEET}; {SMS} (TU104)"),
    _cuda("a100", "NVIDIA A100 (Ampere)", (8, 0), 19.5, 156, 312, 1555, 108,
          f"A100 40GB SXM: {DATASHEET} (80GB: 2039 GB/s); {SMS} (GA100)"),
    _cuda("a10g", "NVIDIA A10G (Ampere)", (8, 6), 31.2, 62.5, 125, 600, 80,
          "A10's figures, unverified for the A10G (not in NVIDIA's datasheets); 80 SMs per AWS, unverified"),
    _cuda("rtx3090", "NVIDIA GeForce RTX 3090 (Ampere)", (8, 6), 35.6, 35.6, 71, 936, 82,
          "GA102 whitepaper: GeForce TF32 dense peak = FP32 peak; 82 SMs"),
    _cuda("l4", "NVIDIA L4 (Ada)", (8, 9), 30.3, 60, 121, 300, 58,
          f"{DATASHEET}, sparse figures halved; {SMS} (AD104)"),
    _cuda("rtx4090", "NVIDIA GeForce RTX 4090 (Ada)", (8, 9), 82.6, 82.6, 165, 1008, 128,
          "AD102 whitepaper, GeForce rule (TF32 dense peak = FP32 peak); 128 SMs"),
    _cuda("h100", "NVIDIA H100 (Hopper)", (9, 0), 67, 495, 989, 3350, 132,
          f"H100 SXM: {DATASHEET}; {SMS} (GH100 SXM5)"),
    _cuda("h200", "NVIDIA H200 (Hopper)", (9, 0), 67, 495, 989, 4800, 132, f"{DATASHEET}; {SMS} (GH100 SXM5)"),
    _cuda("b200", "NVIDIA B200 (Blackwell)", (10, 0), 75, 1125, 2250, 8000, 148,
          "NVIDIA HGX B200 datasheet: the 8-GPU figures divided by 8, sparse figures halved; 148 SMs, unverified"),
    _rocm("mi300", "AMD Instinct MI300X (CDNA3, gfx942)", (9, 4), Math("tf32", "rz"), 163.4, 653.7, 1307.4, 5300,
          304, "AMD Instinct MI300X datasheet (matrix FP32 163.4, TF32 653.7, BF16 1307.4 TFLOP/s dense; 5.3 TB/s; "
          "304 CUs), unverified here"),
    _rocm("mi355", "AMD Instinct MI355X (CDNA4, gfx950)", (9, 5), Math("bf16x3"), 157.3, 838.7, 2516.0, 8000,
          256, "AMD Instinct MI355X datasheet (FP32 vector 157.3, BF16 2516 TFLOP/s dense; 8 TB/s; 256 CUs); no "
          "TF32 units: TF32 runs as bf16x3 (a third of the BF16 peak); unverified here"),
    Target("cpu-amx", "CPU with AMX (oneDNN bf16)", "cpu", None, MappingProxyType(_onednn(True))),
    Target("cpu", "CPU without reduced-precision units", "cpu", None, MappingProxyType(_onednn(False))),
)})


def get(name: str) -> Target:
    """The target called ``name``; a clear error lists the known ones.

    >>> get("h100").capability
    (9, 0)
    >>> get("a200")
    Traceback (most recent call last):
    ...
    tf32lab.errors.Tf32LabError: unknown target 'a200'; accepted: 'v100', 't4', 'a100', 'a10g', 'rtx3090', \
'l4', 'rtx4090', 'h100', 'h200', 'b200', 'mi300', 'mi355', 'cpu-amx', 'cpu'
    """
    if isinstance(name, Target):
        return name
    try:
        return TARGETS[name]
    except (KeyError, TypeError):
        raise Tf32LabError(f"unknown target {name!r}; accepted: {', '.join(map(repr, TARGETS))}") from None


def speed_targets() -> tuple[str, ...]:
    """The targets the speed model covers (those with peaks: the GPUs), in table order.

    >>> speed_targets()[:3]
    ('v100', 't4', 'a100')
    """
    return tuple(name for name, target in TARGETS.items() if target.peaks is not None)


def native(profile: Target) -> Target:
    """This machine's own hardware as a target: ``profile``'s maths (for tables) and peaks, run for real, never
    emulated. Made where the machine is known (``tf32lab.hardware.resolve_target``).

    >>> native(get("cpu")).name, native(get("cpu")).emulated
    ('native', False)
    """
    return dataclasses.replace(profile, name=NATIVE, title=f"this machine ({profile.title})", emulated=False)


def sdpa_kernel() -> str:
    """The kernel PyTorch would pick for float32 SDPA on a CUDA device with the current backend toggles."""
    import torch  # here only: the table itself imports no torch (the CLI lists targets in its help)

    return "efficient" if torch.backends.cuda.mem_efficient_sdp_enabled() else "math"


def cudnn_cell() -> str:
    """:data:`CUDNN_CELL`'s value now: ``"on"``, or ``"off"`` where ``torch.backends.cudnn.enabled`` is False."""
    import torch  # here only, as in sdpa_kernel

    return "on" if torch.backends.cudnn.enabled else "off"


def table() -> list[dict[str, str]]:
    """Every (target, key) entry as plain rows: cell consulted, math per value, source. For docs and doctor.

    >>> rows = table()
    >>> next(r for r in rows if r["target"] == "a100" and r["key"] == "conv")["math"]
    'tf32 -> tf32-rna, ieee -> ieee'
    """
    rows = []
    for target in TARGETS.values():
        for key in KEYS:
            entry = target.entry(key)
            rows.append({
                "target": target.name,
                "key": key,
                "cell": entry.cell or "-",
                "math": ", ".join(f"{value} -> {math}" for value, math in entry.math.items()),
                "source": entry.source,
            })
    return rows
