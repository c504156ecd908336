"""An independent reference for tf32lab.numbers.formats, in integer arithmetic.

It shares nothing with the implementation's bit tricks: a float32 pattern is decoded into an exact value
``(-1)**sign * M * 2**E`` (integers), rounded by integer division with an explicit remainder test per mode, and
encoded again. The same code runs on plain Python ints (the hypothesis tests) and on numpy int64 arrays (the
sweep over all 2**32 patterns, scripts/sweep_formats.py): it only uses integer operators and ``Ops.where``.

Results are float32 bit patterns; a NaN result is the canonical quiet NaN ``NAN`` (callers compare NaN-aware).
"""

from __future__ import annotations

from dataclasses import dataclass

NAN = 0x7FC00000
INF = 0x7F800000


@dataclass(frozen=True)
class Format:
    """A binary floating-point format: ``p`` significant bits, normal exponents ``emin..emax``."""

    p: int
    emin: int
    emax: int


TF32 = Format(p=11, emin=-126, emax=127)
BF16 = Format(p=8, emin=-126, emax=127)
FP16 = Format(p=11, emin=-14, emax=15)
FP32 = Format(p=24, emin=-126, emax=127)


class PyOps:
    """Plain Python integers."""

    @staticmethod
    def where(c, a, b):
        return a if c else b

    @staticmethod
    def bit_length(n):
        return n.bit_length()


class NumpyOps:
    """numpy int64 arrays, elementwise."""

    @staticmethod
    def where(c, a, b):
        import numpy as np

        return np.where(c, a, b)

    @staticmethod
    def bit_length(n):
        import numpy as np

        # frexp of an integer below 2**53 is exact: its exponent is the bit length (0 for 0).
        return np.frexp(n.astype(np.float64))[1].astype(np.int64)


def pow2(k, ops):
    """2**max(k, 0), elementwise (int or array)."""
    return 1 << (k * (k > 0))


def decode(bits, ops):
    """float32 pattern -> (sign, M, E, is_inf, is_nan), value = (-1)**sign * M * 2**E for finite ones."""
    sign = bits // 2**31
    ef = (bits // 2**23) % 256
    m = bits % 2**23
    normal = ef != 0
    M = ops.where(normal, m + 2**23, m)
    E = ops.where(normal, ef - 150, -149)
    special = ef == 255
    return sign, M, E, special & (m == 0), special & (m != 0)


def round_exact(M, E, fmt: Format, mode: str, ops):
    """Round the exact value M * 2**E (M >= 0) to ``fmt``: returns (N, Q, overflow), result = N * 2**Q."""
    e = E + ops.bit_length(M) - 1  # exponent of the leading bit (meaningless for M == 0)
    Q = ops.where(e >= fmt.emin, e, fmt.emin) - (fmt.p - 1)  # quantum: the format's ulp at this magnitude
    # Any shift past the significand's width (M < 2**39 here) leaves q = 0 and no round-up: clamping it keeps
    # the result exact and numpy's int64 free of overflow.
    shift = Q - E
    shift = ops.where(shift > 40, 40, shift)
    d = pow2(shift, ops)
    scaled = M * pow2(-shift, ops)  # only for a format finer than the input: exact, no rounding
    q = scaled // d
    r = scaled - q * d
    twice = 2 * r
    if mode == "rz":
        inc = 0
    elif mode == "rna":
        inc = ops.where(twice >= d, 1, 0) * (shift > 0)
    elif mode == "rne":
        inc = ops.where((twice > d) | ((twice == d) & (q % 2 == 1)), 1, 0) * (shift > 0)
    else:
        raise ValueError(mode)
    N = q + inc
    top = Q + ops.bit_length(N) - 1
    overflow = (N != 0) & (top > fmt.emax)
    if mode == "rz":  # truncation saturates at the largest finite value
        N = ops.where(overflow, 2**fmt.p - 1, N)
        Q = ops.where(overflow, fmt.emax - (fmt.p - 1), Q)
        overflow = overflow & False
    return N, Q, overflow


def encode(sign, N, Q, overflow, ops):
    """Exact value (-1)**sign * N * 2**Q (representable in float32) or ±Inf -> float32 pattern."""
    bl = ops.bit_length(N)
    e = Q + bl - 1
    normal = (N != 0) & (e >= -126)
    # Normal: N scaled to 24 bits, hidden bit removed. Subnormal: N * 2**(Q + 149) is the mantissa field.
    mant_n = N * pow2(24 - bl, ops) // pow2(bl - 24, ops) - 2**23
    mant_s = N * pow2(Q + 149, ops)
    body = ops.where(normal, (e + 127) * 2**23 + mant_n, mant_s)
    body = ops.where(overflow, INF, body)
    return sign * 2**31 + body


def round_bits(bits, fmt: Format, mode: str, ops):
    """Reference rounding of float32 patterns to ``fmt``, as float32 patterns."""
    sign, M, E, is_inf, is_nan = decode(bits, ops)
    N, Q, overflow = round_exact(M, E, fmt, mode, ops)
    out = encode(sign, N, Q, overflow, ops)
    out = ops.where(is_inf, bits, out)
    return ops.where(is_nan, NAN, out)


def sub_bits(a, b, ops):
    """IEEE float32 ``a - b`` (RNE) for patterns, computed exactly and rounded once."""
    sa, Ma, Ea, infa, nana = decode(a, ops)
    sb, Mb, Eb, infb, nanb = decode(b, ops)
    Emin = ops.where(Ea < Eb, Ea, Eb)
    A = Ma * pow2(Ea - Emin, ops) * (1 - 2 * sa)
    B = Mb * pow2(Eb - Emin, ops) * (1 - 2 * sb)
    D = A - B
    sd = ops.where(D < 0, 1, 0)
    N, Q, overflow = round_exact(D * (1 - 2 * sd), Emin, FP32, "rne", ops)
    out = encode(sd, N, Q, overflow, ops)  # exact zero -> +0, as IEEE subtraction gives in RNE
    # Infinities: inf - finite = inf; finite - inf = -inf; inf - inf of equal sign = NaN.
    neg_b_inf = (1 - sb) * 2**31 + INF
    out = ops.where(infb, neg_b_inf, out)
    out = ops.where(infa, a, out)
    out = ops.where(infa & infb & (sa == sb), NAN, out)
    return ops.where(nana | nanb, NAN, out)


def ref_round_tf32(bits, rounding="rna", ops=PyOps):
    return round_bits(bits, TF32, rounding, ops)


def ref_round_bf16(bits, rounding="rne", ops=PyOps):
    return round_bits(bits, BF16, rounding, ops)


def ref_round_fp16(bits, ops=PyOps):
    return round_bits(bits, FP16, "rne", ops)


def ref_split_bf16x3(bits, ops=PyOps):
    hi = ref_round_bf16(bits, "rne", ops)
    return hi, ref_round_bf16(sub_bits(bits, hi, ops), "rne", ops)


def ref_split_bf16x9(bits, ops=PyOps):
    """hi, mid, lo: RNE parts of what is left; an RNE overflow takes hi toward zero, inf and NaN are all hi."""
    _, _, _, is_inf, is_nan = decode(bits, ops)
    hi = ref_round_bf16(bits, "rne", ops)
    _, _, _, hi_inf, _ = decode(hi, ops)
    hi = ops.where(hi_inf, ref_round_bf16(bits, "rz", ops), hi)  # an overflow (inf and NaN are set next)
    hi = ops.where(is_nan, NAN, ops.where(is_inf, bits, hi))
    rest = ops.where(is_nan, 0, ops.where(is_inf, 0, sub_bits(bits, hi, ops)))
    mid = ref_round_bf16(rest, "rne", ops)
    return hi, mid, ref_round_bf16(sub_bits(rest, mid, ops), "rne", ops)


def ref_split_tf32x3(bits, ops=PyOps):
    big = ref_round_tf32(bits, "rz", ops)
    return big, ref_round_tf32(sub_bits(bits, big, ops), "rna", ops)
