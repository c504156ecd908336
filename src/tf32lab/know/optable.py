"""Which aten ops reach a precision-sensitive kernel, and what PyTorch does with each: one classification module.

Facts about PyTorch, not about tf32lab's emulator (whether it has a rule for an op is ``tf32lab.emulation.rules``'s
``RULES`` alone; ``tf32lab.emulation.emulator.treatment`` combines the two). Coverage follows what an op computes,
not what its name looks like: ``nn.Bilinear`` runs ``aten::_trilinear`` (two cuBLAS GEMMs on a GPU) and
``linalg_vector_norm`` runs none. The table was audited against PyTorch's sources (which kernel each op reaches on
CUDA: cuBLAS under PyTorch's handle, whose math mode follows the matmul flag; cuDNN; cuSOLVER/MAGMA, which have no
TF32 path; fused attention and RNN kernels). ``tests/test_optable.py`` fails when a torch adds an op whose name
looks like a product (:func:`suspect`) and that the table does not classify.

What an op does (``Op.how``):

- ``kernel``: its product runs in a kernel of its family (cuBLAS, cuDNN, a fused attention or RNN kernel), so an
  emulator must compute it itself. ``Op.why`` says why that cannot be done, where it cannot (a backend's own kernel
  reached directly, a sparse or semi-structured product, ``matrix_exp``'s internal GEMMs);
- ``decomposes``: composite; PyTorch breaks it down into ops of the table;
- ``no_tf32``: composite, and PyTorch turns TF32 off inside it (``NoTF32Guard``): IEEE on CUDA;
- ``solver``: a LAPACK / cuSOLVER / MAGMA factorization with no tensor-core path: IEEE (measured unaffected on an
  H100: getrf, potrf, potrs, geqrf, syevd, gesvd);
- ``other``: not a float32 product at all (integer, fp8, fp16 or packed weights; pooling, normalization, layout,
  a query that returns a flag).

Ops the table does not list (custom ops, an op of a newer torch) get a family from their name (:func:`family`).

Example:

    >>> from tf32lab.know import optable
    >>> optable.lookup("aten::_trilinear.default"), optable.lookup("aten::linalg_vector_norm")
    (Op(family='matmul', how='kernel', why=None), None)
    >>> optable.lookup("aten::cudnn_convolution").why
    "a backend's own kernel, reached directly"
    >>> optable.suspect("aten::_fancy_new_mm"), optable.suspect("aten::relu_")
    (True, False)
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

__all__ = ["FAMILIES", "HOWS", "NO_TF32_BACKWARD", "OPS", "Op", "family", "family_by_name", "lookup", "suspect"]

# The families whose math a precision flag can change (PyTorch's CUDA semantics notes, "TensorFloat-32 (TF32) on
# Ampere devices"); each is a key of ``tf32lab.know.targets``.
FAMILIES = ("matmul", "conv", "rnn", "attention", "matvec", "linalg")
HOWS = ("kernel", "decomposes", "no_tf32", "solver", "other")


class Op(NamedTuple):
    """What one aten op does: its ``family`` (None for ``other``), ``how`` (one of :data:`HOWS`) and, for a
    ``kernel`` op that cannot be emulated, ``why``."""

    family: Optional[str]
    how: str
    why: Optional[str] = None


def _words(text: str) -> list[str]:
    return text.split()


def _group(family: Optional[str], how: str, names: str, why: Optional[str] = None) -> dict[str, Op]:
    return {name: Op(family, how, why) for name in _words(names)}


# Why a kernel op cannot be emulated: what it runs is out of a dispatch mode's reach, or not what the target runs.
_BACKEND = "a backend's own kernel, reached directly"
_SPARSE = "a sparse or semi-structured product (cuSPARSE, cuSPARSELt)"
_INSIDE = "GEMMs inside one native kernel"
_NESTED = "nested tensors' own kernel"


OPS: dict[str, Op] = {
    # -- matmul: cuBLAS GEMMs under PyTorch's handle (the matmul flag) --------------------------------------------
    **_group("matmul", "kernel", """
        mm bmm addmm addmm_ baddbmm baddbmm_ addbmm addbmm_ _addmm_activation linear
        _euclidean_dist _cdist_forward _cdist_backward _trilinear conv_tbc"""),
    # F.affine_grid: one bmm of the base grid and theta inside a CompositeExplicitAutograd kernel
    # (aten/src/ATen/native/AffineGridGenerator.cpp); its backward is composite and decomposes into a bmm
    **_group("matmul", "kernel", "affine_grid_generator"),
    **_group("matmul", "decomposes", """
        matmul linalg_matmul einsum tensordot inner bilinear chain_matmul linalg_multi_dot cdist matrix_power
        linalg_matrix_power conv_tbc_backward matrix_exp matrix_exp_backward"""),
    # an RNN cell is two ``linear``s (cuBLAS) and a fused pointwise kernel, no cuDNN: aten/src/ATen/native/RNN.cpp
    # (``LSTMCell``, ``GRUCell``, ``SimpleCell``: ``params.linear_ih(input)``, ``params.linear_hh(hx)``)
    **_group("matmul", "decomposes", "lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell"),
    **_group("matmul", "no_tf32", "linalg_pinv pinverse"),
    **_group("matmul", "kernel", "linalg_matrix_exp _foreach_mm _grouped_mm", _INSIDE),
    **_group("matmul", "kernel", """
        _cslt_sparse_mm _cslt_sparse_mm_search _sparse_semi_structured_mm _sparse_semi_structured_addmm
        _sparse_semi_structured_linear _sparse_mm _sparse_addmm hspmm smm sspaddmm _sparse_sparse_matmul
        sparse_sampled_addmm _sparse_mm_reduce_impl _sparse_mm_reduce_impl_backward""", _SPARSE),
    **_group("matmul", "kernel", """
        mkldnn_linear mkldnn_linear_backward mkldnn_linear_backward_input mkldnn_linear_backward_weights""", _BACKEND),
    **_group("matmul", "kernel", "linear_backward matmul_backward", _NESTED),
    # -- matrix-vector: cuBLAS gemv, no tensor-core path (aten Blas.cpp; verify on GPU) -----------------------------
    **_group("matvec", "kernel", "mv addmv addmv_ dot vdot addr addr_"),
    # -- convolution: cuDNN (the conv flag) ---------------------------------------------------------------------
    **_group("conv", "kernel", "convolution _convolution convolution_backward"),
    **_group("conv", "decomposes", """
        conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d _convolution_mode
        _convolution_double_backward"""),
    **_group("conv", "kernel", """
        cudnn_convolution cudnn_convolution_transpose cudnn_convolution_relu cudnn_convolution_add_relu
        miopen_convolution miopen_convolution_transpose miopen_convolution_relu miopen_convolution_add_relu
        miopen_depthwise_convolution mkldnn_convolution _mps_convolution _mps_convolution_transpose
        mps_convolution_backward mps_convolution_transpose_backward _nnpack_spatial_convolution _conv_depthwise2d
        conv_depthwise3d _slow_conv2d_forward _slow_conv2d_backward slow_conv3d slow_conv3d_forward
        slow_conv_dilated2d slow_conv_dilated3d slow_conv_transpose2d slow_conv_transpose3d thnn_conv2d
        convolution_overrideable convolution_backward_overrideable""", _BACKEND),
    # -- recurrent: cuDNN RNN kernels (the cuDNN rnn flag) -----------------------------------------------------
    **_group("rnn", "kernel", "lstm gru rnn_tanh rnn_relu mkldnn_rnn_layer"),  # the last: TorchScript's LSTM, CPU
    **_group("rnn", "kernel", """
        _cudnn_rnn _cudnn_rnn_backward miopen_rnn miopen_rnn_backward mkldnn_rnn_layer_backward
        _lstm_mps lstm_mps_backward""", _BACKEND),
    # -- attention: fused kernels, or the math path's GEMMs ---------------------------------------------------------
    **_group("attention", "kernel", """
        scaled_dot_product_attention _scaled_dot_product_attention_math _scaled_dot_product_efficient_attention
        _scaled_dot_product_efficient_attention_backward _scaled_dot_product_flash_attention_for_cpu
        _scaled_dot_product_flash_attention_for_cpu_backward _native_multi_head_attention
        _transformer_encoder_layer_fwd"""),
    **_group("attention", "kernel", """
        _efficient_attention_forward _efficient_attention_backward _scaled_dot_product_cudnn_attention
        _scaled_dot_product_cudnn_attention_backward _cudnn_attention_forward _cudnn_attention_backward
        _scaled_dot_product_fused_attention_overrideable _scaled_dot_product_fused_attention_overrideable_backward
        _scaled_dot_product_attention_math_for_mps _triton_scaled_dot_attention _triton_multi_head_attention""",
        _BACKEND),
    # -- linear algebra ------------------------------------------------------------------------------------------
    **_group("linalg", "kernel", """
        triangular_solve linalg_solve_triangular linalg_lu_solve _linalg_solve_ex linalg_lstsq linalg_inv_ex"""),
    **_group("linalg", "decomposes", """
        linalg_solve linalg_solve_ex lu_solve linalg_inv inverse linalg_tensorsolve"""),
    **_group("linalg", "solver", """
        cholesky linalg_cholesky linalg_cholesky_ex cholesky_inverse cholesky_solve _cholesky_solve_helper geqrf
        linalg_eig linalg_eigh _linalg_eigh linalg_eigvals _linalg_eigvals linalg_eigvalsh linalg_svd _linalg_svd
        linalg_svdvals svd linalg_qr qr orgqr ormqr linalg_householder_product linalg_lu linalg_lu_factor
        linalg_lu_factor_ex _lu_with_info lu_unpack linalg_ldl_solve linalg_det _linalg_det det linalg_slogdet
        _linalg_slogdet slogdet logdet linalg_matrix_rank linalg_matrix_norm"""),
    # -- not float32 products -----------------------------------------------------------------------------------
    **_group(None, "other", """
        _int_mm _scaled_mm _scaled_mm_v2 _scaled_grouped_mm _scaled_grouped_mm_v2 _mixed_dtypes_linear
        _weight_int4pack_mm _weight_int4pack_mm_for_cpu _weight_int4pack_mm_with_scales_and_zeros _weight_int8pack_mm
        _dyn_quant_matmul_4bit _convert_weight_to_int4pack _convert_weight_to_int4pack_for_cpu
        fbgemm_linear_fp16_weight fbgemm_linear_fp16_weight_fp32_activation fbgemm_linear_int8_weight
        fbgemm_linear_int8_weight_fp32_activation fbgemm_linear_quantize_weight fbgemm_pack_gemm_matrix_fp16
        fbgemm_pack_quantized_matrix _wrapped_linear_prepack _wrapped_quantized_linear_prepacked quantized_gru
        quantized_gru_cell quantized_lstm quantized_lstm_cell quantized_rnn_relu_cell quantized_rnn_tanh_cell
        _cslt_compress _flash_attention_forward _flash_attention_backward _flash_attention_forward_no_dropout_inplace
        _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward
        _thnn_fused_lstm_cell _thnn_fused_lstm_cell_backward _thnn_fused_lstm_cell_backward_impl
        _thnn_fused_gru_cell _thnn_fused_gru_cell_backward _thnn_differentiable_lstm_cell_backward
        _thnn_differentiable_gru_cell_backward _cudnn_rnn_flatten_weight _use_cudnn_rnn_flatten_weight
        _compute_linear_combination outer ger kron matrix_H slice_inverse
        _convert_indices_from_coo_to_csr _convert_indices_from_csr_to_coo cudnn_affine_grid_generator
        cudnn_affine_grid_generator_backward cudnn_batch_norm cudnn_batch_norm_backward cudnn_grid_sampler
        cudnn_grid_sampler_backward cudnn_is_acceptable _cudnn_ctc_loss _use_cudnn_ctc_loss _cudnn_init_dropout_state
        miopen_batch_norm miopen_batch_norm_backward miopen_ctc_loss _use_miopen_ctc_loss mkldnn_adaptive_avg_pool2d
        mkldnn_adaptive_avg_pool2d_backward mkldnn_max_pool2d mkldnn_max_pool2d_backward mkldnn_max_pool3d
        mkldnn_max_pool3d_backward mkldnn_reorder_conv2d_weight mkldnn_reorder_conv3d_weight _mkldnn_reshape
        _mkldnn_transpose _mkldnn_transpose_ to_mkldnn to_mkldnn_backward multi_margin_loss
        multi_margin_loss_backward"""),
}

# Backward formulas whose GEMMs are IEEE on a GPU at every level: PyTorch turns TF32 off inside some (NoTF32Guard
# in FunctionsManual.cpp: pinv, cholesky, svd); eigh, qr, lu, linalg.solve and det gave the same bits at 'high' as
# at 'highest' on an H100 (docs/gpu-results.md; solve's at 256 x 256, one trsm block). lu_factor's backward is lu's
# formula. inv's backward does use TF32 (measured), so it is not listed.
NO_TF32_BACKWARD = frozenset({
    "LinalgPinvBackward0", "LinalgPinvBackward1", "LinalgPinvBackward2", "PinverseBackward0",
    "CholeskyBackward0", "LinalgCholeskyExBackward0", "LinalgSvdBackward0", "SvdBackward0",
    "LinalgEighBackward0", "LinalgQrBackward0", "LinalgLuBackward0", "LinalgLuFactorExBackward0",
    "LinalgSolveExBackward0", "LinalgDetBackward0",
})

# The name rule, for ops the table does not list: an op's name split at "_" into tokens, and the first family (in
# this order) one of whose words it holds, or a token starting with one of its prefixes. A "linalg" token says
# nothing (linalg_vector_norm, linalg_cross). The last row and any token ending in "mm" name no family: they only
# make an op worth classifying (the audit's net, deliberately wide, so that :func:`suspect` catches new ops), as
# too loose to name one ("inv": prims::erf_inv; "gemm": a packing op, fbgemm_pack_gemm_matrix_fp16).
_NAME_RULE: tuple[tuple[Optional[str], frozenset[str], tuple[str, ...]], ...] = (
    ("conv", frozenset(), ("conv",)),
    ("attention", frozenset(_words("attention attn sdpa flash efficient transformer")), ()),
    ("rnn", frozenset(_words("lstm gru rnn")), ()),
    ("matvec", frozenset(_words("mv addmv dot vdot")), ()),
    ("matmul", frozenset(_words("""
        mm bmm addmm baddbmm addbmm matmul linear einsum tensordot bilinear trilinear chain addr ger inner cdist
        euclidean tbc""")), ()),
    ("linalg", frozenset(_words("""
        cholesky triangular lu qr svd svdvals inverse pinv pinverse solve lstsq geqrf ormqr orgqr householder det
        slogdet logdet matrix""")), ("eig",)),
    (None, frozenset(_words("gemm inv outer kron multi spmm")),
     ("cudnn", "miopen", "mkldnn", "cslt", "fbgemm", "int4pack", "int8pack")),
)


def _base(name: str) -> str:
    return name.rsplit("::", 1)[-1].split(".", 1)[0]


def _tokens(name: str) -> list[str]:
    return [t for t in _base(name).lower().split("_") if t]


def lookup(name: str) -> Optional[Op]:
    """What the aten op ``name`` (``"aten::mm"``, ``"aten::mm.default"`` or ``"mm"``) does; None if unlisted.

    >>> lookup("aten::mm.default"), lookup("mylib::mm")
    (Op(family='matmul', how='kernel', why=None), None)
    """
    if "::" in name and not name.startswith("aten::"):
        return None
    return OPS.get(_base(name))


def suspect(name: str) -> bool:
    """Whether an op's name looks like it may compute a product (the audit's net: wide, on purpose).

    >>> suspect("aten::_cudnn_new_thing"), suspect("aten::linalg_vector_norm")
    (True, False)
    """
    return _by_name(name)[0]


def family_by_name(name: str) -> Optional[str]:
    """The family an op's name suggests (``"aten::addmm"``, ``"_convolution"``, ``"mylib::fancy_matmul"``), or None.

    >>> family_by_name("aten::addmm"), family_by_name("cudnn_convolution_transpose"), family_by_name("aten::relu")
    ('matmul', 'conv', None)
    >>> family_by_name("_scaled_dot_product_flash_attention_for_cpu"), family_by_name("_transformer_encoder_layer_fwd")
    ('attention', 'attention')
    """
    return _by_name(name)[1]


@functools.cache
def _by_name(name: str) -> tuple[bool, Optional[str]]:
    """The name rule: whether the name is caught by it, and the family it names."""
    tokens = _tokens(name)
    for named, words, prefixes in _NAME_RULE:
        if any(t in words or t.startswith(prefixes) for t in tokens):
            return True, named
    return any(t.endswith("mm") for t in tokens), None


_COUNTED = ("kernel", "decomposes", "no_tf32")


@functools.cache
def family(name: str) -> Optional[str]:
    """The family of an op whose math a target can change (None for solvers and everything else).

    Listed aten ops by the table; an aten op the table misses by :func:`family_by_name` if it looks like a product;
    ops of other namespaces (custom ops) by :func:`family_by_name`.

    >>> family("aten::addmm.default"), family("aten::cholesky"), family("aten::linalg_vector_norm")
    ('matmul', None, None)
    >>> family("mylib::fancy_matmul")
    'matmul'
    """
    op = lookup(name)
    if op is not None:
        return op.family if op.how in _COUNTED else None
    if name.startswith("aten::") and not suspect(name):
        return None
    return family_by_name(name)
