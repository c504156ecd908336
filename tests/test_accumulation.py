"""The hardware accumulation models against MMA-Sim's own outputs (tests/data/mmasim_tf32.npz).

The vectors were made by running MMA-Sim (github microsoft/MMA-Sim, c785138) offline with
``scripts/make_mmasim_vectors.py`` (which regenerates these very bits): per unit (Ampere and Ada
``mma m16n8k8`` TF32, Hopper ``wgmma m64n8k8``, Blackwell ``tcgen05.mma m64n8k8``, CDNA3 ``v_mfma_f32_16x16x8_xf32``)
random, cancelling, exponent-spread, all-positive and edge-case (zeros, subnormals, tiny and huge) inputs, one
instruction each, and eight instructions chained along K. The instruction truncates float32 operands to TF32;
the tests do so with ``formats.round_tf32(x, "rz")`` before the model, which takes operands as given.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from tf32lab.numbers import accumulation, formats

# numba compiles the accumulation kernels (about 10 s of CPU each, once per process) in a fresh clone: these
# files run on one xdist worker, so that the other worker does not compile the same ones at the same time
pytestmark = pytest.mark.xdist_group("numba_accumulation")

DATA = pathlib.Path(__file__).parent / "data"
VECTORS = np.load(DATA / "mmasim_tf32.npz")
META = json.loads((DATA / "mmasim_tf32.json").read_text())
MODELS = {"ampere": accumulation.AMPERE, "ada": accumulation.AMPERE, "hopper": accumulation.HOPPER,
          "blackwell": accumulation.BLACKWELL, "cdna3": accumulation.CDNA3_XF32}
CASES = sorted({key.rsplit("/", 1)[0] for key in VECTORS.files})


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    both_nan = torch.isnan(x) & torch.isnan(y)
    return bool(((x.view(torch.int32) == y.view(torch.int32)) | both_nan).all())


@pytest.mark.parametrize("case", CASES)
def test_bit_for_bit_against_mmasim(case):
    unit = case.split("/")[0]
    a, b, c, d = (torch.from_numpy(VECTORS[f"{case}/{x}"]) for x in "abcd")
    a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
    got = accumulation.gemm(a, b, MODELS[unit], c=c)
    assert _bits_equal(got, d), f"{case}: {int((got != d).sum())} of {d.numel()} outputs differ"


def test_the_vectors_tell_the_models_apart():
    # the data would catch a wrong chunk, a wrong bit count or ideal accumulation
    for case in ("ampere/chain_positive", "hopper/chain_positive", "cdna3/chain_random"):
        a, b, c, d = (torch.from_numpy(VECTORS[f"{case}/{x}"]) for x in "abcd")
        a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
        others = [m for m in (accumulation.AMPERE, accumulation.HOPPER, accumulation.CDNA3_XF32, accumulation.FMA)
                  if m is not MODELS[case.split("/")[0]]]
        for model in others:
            assert not _bits_equal(accumulation.gemm(a, b, model, c=c), d), (case, str(model))
        assert not _bits_equal(a @ b + c, d), case


@pytest.mark.parametrize("unit", sorted(MODELS))
def test_section_vi_c(unit):
    # MMA-Sim section VI-C: a = [2048, 2048], b = [2048, -2048], c = -1e-6; CDNA3 floors c to -0.25
    a, b, c = torch.tensor([[2048.0, 2048.0]]), torch.tensor([[2048.0], [-2048.0]]), torch.tensor([[-1e-6]])
    got = accumulation.gemm(a, b, MODELS[unit], c=c).item()
    assert got == META[f"{unit}/vi_c"] == (-0.25 if unit == "cdna3" else 0.0)


def test_special_values_follow_ieee():
    a = torch.tensor([[float("inf"), 1.0], [float("nan"), 1.0], [float("inf"), 1.0]])
    b = torch.tensor([[1.0, 0.0], [2.0, 3.0]])
    got = accumulation.gemm(a, b, accumulation.HOPPER)
    assert got[0, 0] == float("inf") and torch.isnan(got[0, 1]) and torch.isnan(got[1]).all()
    big = torch.tensor([[2.0 ** 127, 2.0 ** 127]])
    assert accumulation.gemm(big, torch.ones(2, 1), accumulation.AMPERE).item() == float("inf")


def test_a_zero_sum_is_positive_zero():
    # MMA-Sim sums the aligned terms as integers: a tiny negative sum truncated away is +0, and so is the next
    # step's sum of -0 terms (the FMA chain is IEEE arithmetic: there -2^-150 rounds to -0)
    a, b = torch.tensor([[-(2.0 ** -75)] + [0.0] * 7]), torch.tensor([[2.0 ** -75]] + [[-(2.0 ** -100)]] * 7)
    for unit in ("ampere", "hopper"):
        for compiled in {False, accumulation.compiled()}:
            got = accumulation.gemm(a, b, MODELS[unit], use_compiled=compiled)
            assert got.item() == 0.0 and not got.signbit().item(), (unit, compiled)
    assert accumulation.gemm(a, b, accumulation.FMA).signbit().item()


def test_batches_broadcast_and_k_padding():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, 13, generator=g), torch.randn(13, 7, generator=g)
    a, b = formats.round_tf32(a, "rne"), formats.round_tf32(b, "rne")
    got = accumulation.gemm(a, b, accumulation.AMPERE)
    assert got.shape == (3, 5, 7)
    for i in range(3):
        assert torch.equal(got[i], accumulation.gemm(a[i], b, accumulation.AMPERE))
    assert torch.allclose(got, a @ b, rtol=0, atol=1e-5)
    padded = torch.nn.functional.pad(a[0], (0, 3)), torch.nn.functional.pad(b, (0, 0, 0, 3))
    assert torch.equal(accumulation.gemm(*padded, accumulation.AMPERE), got[0])


def test_fma_chain_is_float32_in_k_order():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 300, generator=g), torch.randn(300, 3, generator=g)
    want = torch.zeros(4, 3)
    for k in range(300):  # float32 multiply then add rounds twice; an FMA once: same here unless a tie
        want = (want.double() + a[:, k, None].double() * b[k].double()).float()
    assert torch.equal(accumulation.gemm(a, b, accumulation.FMA), want)


def test_bad_input_names_it():
    with pytest.raises(TypeError, match="float32"):
        accumulation.gemm(torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2), accumulation.FMA)
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(2, 2\)"):
        accumulation.gemm(torch.ones(2, 3), torch.ones(2, 2), accumulation.FMA)
    with pytest.raises(ValueError, match="'xyz'"):
        accumulation.Accumulation("xyz", 4, 24, "")
    with pytest.raises(ValueError, match="fraction_bits must be a whole number 0 to 30, got -3"):
        accumulation.Accumulation("nvidia", 8, -3, "")
    for chunk in (0, 4.0, True, "4", 257):
        with pytest.raises(ValueError, match=f"chunk must be a whole number 1 to 256 .*, got {chunk!r}"):
            accumulation.Accumulation("nvidia", chunk, 24, "")
    with pytest.raises(ValueError, match=r"c of shape \(2, 3, 5\) does not broadcast to the product's \(3, 5\)"):
        accumulation.gemm(torch.ones(3, 8), torch.ones(8, 5), accumulation.AMPERE, c=torch.zeros(2, 3, 5))
    # an empty output, batched: its shape, no kernel call
    for compiled in (False, None):
        got = accumulation.gemm(torch.ones(8, 0, 4), torch.ones(8, 4, 3), accumulation.AMPERE, use_compiled=compiled)
        assert got.shape == (8, 0, 3)


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("cdna3")])
def test_compiled_kernels_give_the_same_bits(case):
    unit = case.split("/")[0]
    a, b, c = (torch.from_numpy(VECTORS[f"{case}/{x}"]) for x in "abc")
    a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
    for model in (MODELS[unit], accumulation.FMA):
        tensors = accumulation.gemm(a, b, model, c=c, use_compiled=False)
        assert _bits_equal(accumulation.gemm(a, b, model, c=c, use_compiled=True), tensors), (case, str(model))


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
def test_compiled_kernels_batches_and_specials():
    g = torch.Generator().manual_seed(3)
    a, b = formats.round_tf32(torch.randn(2, 9, 21, generator=g)), formats.round_tf32(torch.randn(21, 70, generator=g))
    a[0, 0, 0], a[1, 2, 3], b[4, 5] = float("inf"), float("nan"), 2.0 ** 120
    odd = accumulation.Accumulation("nvidia", 3, 24, "a chunk that is no multiple of 4")
    for model in (accumulation.AMPERE, accumulation.HOPPER, accumulation.FMA, odd):
        want = accumulation.gemm(a, b, model, c=torch.ones(70), use_compiled=False)
        assert _bits_equal(accumulation.gemm(a, b, model, c=torch.ones(70), use_compiled=True), want), str(model)
        # operands read through their strides (a linear's weight is transposed), one row, one column
        assert _bits_equal(accumulation.gemm(a, b.T.contiguous().T, model, c=torch.ones(70), use_compiled=True), want)
        assert _bits_equal(accumulation.gemm(a[:, :1], b, model, use_compiled=True),
                           accumulation.gemm(a[:, :1], b, model, use_compiled=False)), str(model)
        assert _bits_equal(accumulation.gemm(a, b[:, :1], model, use_compiled=True),
                           accumulation.gemm(a, b[:, :1], model, use_compiled=False)), str(model)


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
def test_compiled_kernels_keep_the_callers_thread_count(user_flags):
    # numba's OpenMP layer set the thread's OpenMP count to numba's (every CPU) at each launch: torch read it back
    a, b = formats.round_tf32(torch.randn(64, 64)), formats.round_tf32(torch.randn(64, 64))
    torch.set_num_threads(1)
    accumulation.gemm(a, b, accumulation.AMPERE, use_compiled=True)
    accumulation.gemm(a, b, accumulation.FMA, use_compiled=True)
    assert torch.get_num_threads() == 1


def _compiled_signatures(module) -> dict[str, int]:
    """How many signatures numba compiled for each kernel of ``module`` in this process."""
    from numba.core.dispatcher import Dispatcher

    found = {name: getattr(f, "dispatcher", f) for name, f in vars(module).items()}
    return {name: len(d.signatures) for name, d in found.items() if isinstance(d, Dispatcher)}


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
def test_each_kernel_is_compiled_once_whatever_its_callers_pass():
    # numba compiled nvidia_gemm anew (25 s of CPU) for each layout of its operands (a transposed weight, a
    # broadcast batch, one column), and a kernel called with read-only arrays or numpy integers anew again
    from tf32lab.numbers import accumulation_kernels as kernels

    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(3, 12, 16, generator=g), torch.randn(16, 20, generator=g)  # unrounded: nvidia_gemm
    tf32 = formats.round_tf32(a)
    calls = [(a, b, None), (a, b.T.contiguous().T, torch.ones(20)), (a[:, :5], b, torch.ones(3, 5, 20)),
             (a.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :12], b[:12, :1], None), (tf32, b[:, ::2], None),
             (tf32, formats.round_tf32(b), None), (tf32[:, :, :12], formats.round_tf32(b)[:12].T.contiguous().T, None)]
    for model in (accumulation.AMPERE, accumulation.HOPPER, accumulation.FMA):
        for x, y, c in calls:
            want = accumulation.gemm(x, y, model, c=c, use_compiled=False)
            assert _bits_equal(accumulation.gemm(x, y, model, c=c, use_compiled=True), want), (str(model), x.shape)
    # the kernels called as they are, with read-only and strided arrays and numpy integers
    frozen = [x.numpy().copy() for x in (tf32[:1], formats.round_tf32(b)[None], torch.zeros(1, 12, 20))]
    for x in frozen:
        x.flags.writeable = False
    want = accumulation.gemm(tf32[:1], formats.round_tf32(b), accumulation.AMPERE, use_compiled=False)
    got = kernels.nvidia_gemm(*frozen, np.int32(4), np.int64(24), 20, 12, False)
    narrow, fitted = kernels.nvidia_gemm_narrow(frozen[0].transpose(0, 2, 1).copy().transpose(0, 2, 1), *frozen[1:],
                                                4, np.int32(24), 20, 12)
    assert fitted and _bits_equal(torch.from_numpy(got)[0], want) and _bits_equal(torch.from_numpy(narrow)[0], want)
    fma = kernels.fma_gemm(frozen[0].astype(np.float64)[:, ::-1, :], frozen[1].astype(np.float64), frozen[2], 8)
    want = accumulation.gemm(tf32[:1].flip(1), formats.round_tf32(b), accumulation.FMA, use_compiled=False)
    assert _bits_equal(torch.from_numpy(fma), want)
    # the kernels Python calls; their helpers take the types the kernels' bodies give them, fixed at compile time
    counts = _compiled_signatures(kernels)
    assert {name: counts[name] for name in kernels.__all__ if name in counts} == {
        "nvidia_gemm": 1, "nvidia_gemm_narrow": 1, "fma_gemm": 1}, counts


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
def test_a_kernel_called_directly_takes_its_defaults_and_keywords():
    # compiled once for its whole signature, nvidia_gemm refused a call that left ``normal`` to its default (numba
    # found no overload for an omitted argument) and one that named it (the wrapper took no keywords)
    from tf32lab.numbers import accumulation_kernels as kernels

    g = torch.Generator().manual_seed(9)
    a, b = (formats.round_tf32(torch.randn(1, *shape, generator=g)) for shape in ((12, 16), (16, 20)))
    operands = (a.numpy(), b.numpy(), np.zeros((1, 12, 20), np.float32), 4, 24, 20, 12)
    want = accumulation.gemm(a, b, accumulation.AMPERE, use_compiled=False)
    for got in (kernels.nvidia_gemm(*operands), kernels.nvidia_gemm(*operands, normal=True),
                kernels.nvidia_gemm(*operands[:3], chunk=4, bits=24, tile=20, band=12, normal=False)):
        assert _bits_equal(torch.from_numpy(got), want)
    assert len(kernels.nvidia_gemm.dispatcher.signatures) == 1


def _binade(shape: tuple[int, ...], exponent: int, g: torch.Generator) -> torch.Tensor:
    """TF32 values of random sign in [2^exponent, 2^(exponent + 1))."""
    signs = torch.randint(0, 2, shape, generator=g) * 2.0 - 1.0
    return formats.round_tf32(signs * (1 + torch.rand(shape, generator=g)) * 2.0**exponent, "rz")


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
@pytest.mark.parametrize("model", [accumulation.AMPERE, accumulation.HOPPER])
def test_the_kernel_for_sums_that_stay_normal_gives_the_same_bits(model):
    # stays_normal() lets the kernel skip the subnormal and overflow cases: at the edge of its condition (the
    # smallest products at 2^(-126 + fraction bits), random signs cancelling down to a few units of 2^-126) the
    # fast kernel gives the tensor code's bits; one binade lower, or near overflow, it is not used
    from tf32lab.numbers import accumulation_kernels as kernels

    g = torch.Generator().manual_seed(11)
    low = -126 + model.fraction_bits
    cases = {"random": (torch.randn(40, 64, generator=g), torch.randn(64, 36, generator=g), True),
             "edge": (_binade((40, 64), low // 2, g), _binade((64, 36), low - low // 2, g), True),
             "below": (_binade((40, 64), low // 2 - 1, g), _binade((64, 36), low - low // 2, g), False),
             "huge": (_binade((40, 64), 60, g), _binade((64, 36), 62, g), False)}
    for name, (a, b, normal) in cases.items():
        a, b = formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz")
        assert accumulation._stays_normal(a, b, torch.zeros(1), model.fraction_bits) is normal, name
        want = accumulation.gemm(a, b, model, use_compiled=False)
        assert _bits_equal(accumulation.gemm(a, b, model, use_compiled=True), want), name
        if name == "edge":  # sums that cancel below the smallest product
            assert ((want != 0) & (want.abs() < 2.0**low)).any()
        if normal:  # both kernels, called as they are
            a3, b3, c3 = a[None].numpy(), b[None].numpy(), np.zeros((1, 40, 36), np.float32)
            for fast in (False, True):
                got = kernels.nvidia_gemm(a3, b3, c3, model.chunk, model.fraction_bits, 36, 8, fast)
                assert _bits_equal(torch.from_numpy(got)[0], want), (name, fast)
    tiny_c = torch.full((40, 36), 2.0**-130)  # a subnormal accumulator input: not for the fast kernel
    assert not accumulation._stays_normal(torch.ones(40, 64), torch.ones(64, 36), tiny_c, 24)
    assert not accumulation._stays_normal(torch.ones(4, 4), torch.full((4, 4), float("nan")), torch.zeros(1), 24)


def _narrow(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, model: accumulation.Accumulation, band: int):
    """The 32-bit kernel called as it is: (its output or None where it refuses)."""
    from tf32lab.numbers import accumulation_kernels as kernels

    batch = lambda x: x.reshape(-1, *x.shape[-2:]).contiguous().numpy()  # noqa: E731
    out, fitted = kernels.nvidia_gemm_narrow(batch(a), batch(b), batch(c), model.chunk, model.fraction_bits,
                                             min(c.size(-1), 40), band)
    return torch.from_numpy(out).reshape(c.shape) if fitted else None


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
@pytest.mark.parametrize("model", [accumulation.AMPERE, accumulation.HOPPER])
def test_the_32_bit_kernel_gives_the_tensor_codes_bits(model):
    # TF32 and bf16 operands in the kernel's range: random, exponent-spread, cancelling to a few units, zero
    # operands whose exponent (-126) plus a huge partner's sets the alignment, products at its lowest exponent
    # (2^-100) cancelling below it, a c of its own; rows not a multiple of the 4 a pass takes, bands of 5 rows
    from tf32lab.numbers.accumulation_kernels import NARROW_LOWEST

    g = torch.Generator().manual_seed(5)
    tf32 = lambda x: formats.round_tf32(x, "rz")  # noqa: E731
    spread = tf32(torch.randn(2, 7, 64, generator=g) * 2.0 ** torch.randint(-30, 30, (2, 7, 64), generator=g))
    zeros_rule = tf32(torch.randn(7, 64, generator=g) * 2.0**-40)
    zeros_rule[:, ::3] = 0.0
    huge_partner = tf32(torch.randn(64, 45, generator=g))
    huge_partner[::3] = 2.0**60
    low = NARROW_LOWEST
    cases = {
        "random": (tf32(torch.randn(7, 64, generator=g)), tf32(torch.randn(64, 45, generator=g)), None),
        "bf16": (torch.randn(7, 64, generator=g).bfloat16().float(),
                 torch.randn(64, 45, generator=g).bfloat16().float(), torch.randn(7, 45, generator=g)),
        "spread": (spread, tf32(torch.randn(64, 45, generator=g)), tf32(torch.randn(2, 7, 45, generator=g))),
        "cancelling": (tf32(torch.ones(7, 64) + torch.rand(7, 64, generator=g) * 2**-9),
                       tf32(torch.randn(64, 45, generator=g).sign() * 4.0), None),
        "zeros align": (zeros_rule, huge_partner, None),
        "lowest": (_binade((7, 64), low // 2, g), _binade((64, 45), low - low // 2, g),
                   torch.full((7, 45), 2.0**low)),
    }
    for name, (a, b, c) in cases.items():
        c = torch.zeros(*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.size(-2), b.size(-1)) if c is None else c
        want = accumulation.gemm(a, b, model, c=c, use_compiled=False)
        for band in (7, 5):
            got = _narrow(a.expand(*want.shape[:-1], 64), b.expand(*want.shape[:-2], 64, 45), c, model, band)
            assert got is not None and _bits_equal(got, want), (name, band)
        assert _bits_equal(accumulation.gemm(a, b, model, c=c, use_compiled=True), want), name
        if not c.any():  # no c at all: the kernel starts from zeros without reading one
            assert _bits_equal(accumulation.gemm(a, b, model, use_compiled=True), want), name
        if name == "lowest":  # sums that cancel below the lowest exponent
            assert ((want != 0) & (want.abs() < 2.0**low)).any()


@pytest.mark.skipif(not accumulation.compiled(), reason="numba not installed")
def test_the_32_bit_kernel_refuses_what_it_cannot_compute():
    # outside its range it says so, and gemm() falls back on the float64 kernels: the same bits either way
    from tf32lab.numbers.accumulation_kernels import NARROW_LOWEST

    g = torch.Generator().manual_seed(6)
    a, b = formats.round_tf32(torch.randn(8, 64, generator=g)), formats.round_tf32(torch.randn(64, 12, generator=g))
    zero = torch.zeros(8, 12)
    low = NARROW_LOWEST
    refused = {
        "13 significant bits": (a + a * 2.0**-12, b, zero),
        "products below the lowest": (_binade((8, 64), low // 2 - 1, g), _binade((64, 12), low - low // 2, g), zero),
        "c below the lowest": (a, b, torch.full((8, 12), 2.0 ** (low - 1))),
        "near overflow": (_binade((8, 64), 60, g), _binade((64, 12), 62, g), zero),
        "inf": (a, b.index_put((torch.tensor([3]), torch.tensor([4])), torch.tensor(float("inf"))), zero),
        "nan in c": (a, b, zero.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("nan")))),
    }
    for name, (x, y, c) in refused.items():
        for model in (accumulation.AMPERE, accumulation.HOPPER):
            assert _narrow(x, y, c, model, 8) is None, (name, str(model))
            want = accumulation.gemm(x, y, model, c=c, use_compiled=False)
            assert _bits_equal(accumulation.gemm(x, y, model, c=c, use_compiled=True), want), (name, str(model))
    assert _narrow(a, b, zero, accumulation.AMPERE, 8) is not None  # the same operands, in range: taken
    # what it is not made for, it refuses too: other chunks, fraction bits beyond 25, K not a whole number of steps
    from tf32lab.numbers import accumulation_kernels as kernels

    a3, b3, c3 = a[None].numpy(), b[None].numpy(), zero[None].numpy()
    for chunk, bits, k in ((3, 24, 64), (16, 24, 64), (4, 26, 64), (8, 25, 60)):
        assert not kernels.nvidia_gemm_narrow(a3[..., :k], b3[:, :k], c3, chunk, bits, 12, 8)[1], (chunk, bits, k)
    # the 512-bit hint is added only where llvmlite prints it and LLVM parses it
    assert not kernels._attribute_parses('"not an attribute')
    # operands whose first rows are short but not the rest: gemm tries the 32-bit kernel, which refuses (with and
    # without c); the float64 kernel gives the tensor code's bits
    later = a.clone()
    later[5, 7] = 1.0 + 2.0**-20
    assert accumulation._short(later) and _narrow(later, b, zero, accumulation.AMPERE, 8) is None
    for c in (None, torch.ones(12)):
        want = accumulation.gemm(later, b, accumulation.HOPPER, c=c, use_compiled=False)
        assert _bits_equal(accumulation.gemm(later, b, accumulation.HOPPER, c=c, use_compiled=True), want)


# -- real hardware: an H200 (docs/gpu-results.md, "Accumulation bit for bit on an H200") -----------------------
H200 = np.load(DATA / "h200_bits.npz")


@pytest.mark.parametrize("case", sorted({k.rsplit("/", 1)[0] for k in H200.files if k.startswith("gemm/")}))
def test_cublas_bits_on_an_h200(case):
    # a 4 x 4 corner of cuBLAS's outputs (kernels without split-K) and the rows and columns it depends on;
    # high: operands rounded RNE by cuBLAS on Hopper, then the Hopper unit; highest: the FMA chain
    a, b = torch.from_numpy(H200[f"{case}/a"]), torch.from_numpy(H200[f"{case}/b"])
    high = accumulation.gemm(formats.round_tf32(a, "rne"), formats.round_tf32(b, "rne"), accumulation.HOPPER)
    assert _bits_equal(high, torch.from_numpy(H200[f"{case}/high"]))
    assert _bits_equal(accumulation.gemm(a, b, accumulation.FMA), torch.from_numpy(H200[f"{case}/highest"]))
    if case == "gemm/uniform/K4096":  # the ideal sum misses the truncation's bias: no output agrees
        ideal = formats.round_tf32(a, "rne") @ formats.round_tf32(b, "rne")
        assert bool((ideal != torch.from_numpy(H200[f"{case}/high"])).all())


@pytest.mark.parametrize("case", sorted({k.rsplit("/", 1)[0] for k in H200.files if k.startswith("wgmma/")}))
def test_triton_wgmma_bits_on_an_h200(case):
    # tl.dot(A, B, acc=C, input_precision="tf32") in one program: wgmma truncates the unrounded operands itself
    a, b, c, d = (torch.from_numpy(H200[f"{case}/{x}"]) for x in "abcd")
    got = accumulation.gemm(formats.round_tf32(a, "rz"), formats.round_tf32(b, "rz"), accumulation.HOPPER, c=c)
    assert _bits_equal(got, d)
