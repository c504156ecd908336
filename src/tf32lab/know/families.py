"""Op families: which aten ops PyTorch's precision flags can reach.

The flags' reach is listed in PyTorch's CUDA semantics notes, "TensorFloat-32 (TF32) on Ampere devices".

A name-based rule rather than a list, so that an op this table never heard of (a new ``_scaled_dot_product_*``
variant, a backend's private convolution) still lands in its family.
"""

from __future__ import annotations

import functools

FAMILIES = ("matmul", "conv", "rnn", "attention", "matvec", "linalg")

_TOKENS = {
    "matmul": {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "tensordot", "bilinear",
               "chain", "addr", "ger", "inner", "cdist", "euclidean"},
    "matvec": {"mv", "addmv", "dot", "vdot"},
    "rnn": {"lstm", "gru", "rnn"},
    "attention": {"attention", "sdpa", "flash", "efficient", "transformer"},
    "linalg": {"linalg", "cholesky", "triangular", "lu", "qr", "svd", "eig", "eigh", "inverse", "solve", "lstsq",
               "geqrf", "ormqr", "orgqr", "det", "slogdet", "pinverse", "matrix"},
}


@functools.cache
def family_of(op_name: str) -> str | None:
    """Family of an op by its name (``"aten::addmm"``, ``"_convolution"``, ...), or None when no flag reaches it.

    >>> family_of("aten::addmm"), family_of("cudnn_convolution_transpose"), family_of("aten::relu")
    ('matmul', 'conv', None)
    >>> family_of("_scaled_dot_product_flash_attention_for_cpu"), family_of("_transformer_encoder_layer_fwd")
    ('attention', 'attention')
    """
    name = op_name.rsplit("::", 1)[-1].split(".", 1)[0].lower()
    tokens = [t for t in name.split("_") if t]
    if any(t.startswith("conv") for t in tokens):
        return "conv"
    for family in ("attention", "rnn", "matvec", "matmul", "linalg"):
        if any(t in _TOKENS[family] for t in tokens):
            return family
    return None
