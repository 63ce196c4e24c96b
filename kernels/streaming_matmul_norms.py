"""A weight-streaming product with the sandwich norms after it: the product's output (split_k
1) or its split-K fp32 partials go straight into a fused norms kernel (kernels/rms_norm.py),
which sums them, normalizes, adds the residual and normalizes again; no XLA kernel runs
between the two.

    streaming_matmul_norm_add_norm(x, w, residual, norm_weight, next_norm_weight, eps)
      = layers.linear_norm_add_norm (Ouro: h = residual + rms_norm(x @ w)) -> (h, next_norm(h))
    streaming_matmul_add_norm_norm(...)
      = layers.linear_add_norm_norm (Huginn: h = rms_norm(x @ w + residual)) -> (h, next_norm(h))

Block sizes as kernels/streaming_matmul.py's entry points (`**blocks`); each has its `ref_`
twin.
"""

from __future__ import annotations

from loopjax import layers

from .rms_norm import add_norm_norm, norm_add_norm
from .streaming_config import check_matmul_inputs
from .streaming_matmul import _call, _overrides

__all__ = [
    "ref_streaming_matmul_add_norm_norm",
    "ref_streaming_matmul_norm_add_norm",
    "streaming_matmul_add_norm_norm",
    "streaming_matmul_norm_add_norm",
]


def ref_streaming_matmul_norm_add_norm(x, w, residual, norm_weight, next_norm_weight, eps: float):
    check_matmul_inputs(x, w, residual)
    return layers.linear_norm_add_norm(x, w, residual, norm_weight, next_norm_weight, eps)


def ref_streaming_matmul_add_norm_norm(x, w, residual, norm_weight, next_norm_weight, eps: float):
    check_matmul_inputs(x, w, residual)
    return layers.linear_add_norm_norm(x, w, residual, norm_weight, next_norm_weight, eps)


def streaming_matmul_norm_add_norm(
    x,  # [M, K]
    w,  # [K, N]
    residual,  # [M, N], x's dtype
    norm_weight,  # [N]: the norm of the product
    next_norm_weight,  # [N]: the norm of the sum
    eps: float,
    *,
    interpret: bool | None = None,
    **blocks,  # streaming_matmul's block-size keywords
):
    """layers.linear_norm_add_norm -> (h, rms_norm(h, next_norm_weight)), two [M, N]."""
    return _then_norms(norm_add_norm, x, w, residual, norm_weight, next_norm_weight, eps, interpret, blocks)


def streaming_matmul_add_norm_norm(
    x,  # [M, K]
    w,  # [K, N]
    residual,  # [M, N], x's dtype
    norm_weight,  # [N]: the norm of the sum
    next_norm_weight,  # [N]: the norm of the normed sum
    eps: float,
    *,
    interpret: bool | None = None,
    **blocks,  # streaming_matmul's block-size keywords
):
    """layers.linear_add_norm_norm -> (h, rms_norm(h, next_norm_weight)), two [M, N]."""
    return _then_norms(add_norm_norm, x, w, residual, norm_weight, next_norm_weight, eps, interpret, blocks)


def _then_norms(norms, x, w, residual, norm_weight, next_norm_weight, eps, interpret, blocks):
    """The product's output (split 1) or fp32 partials into the fused norms kernel `norms`."""
    product = _call(x, w, residual, "partials", interpret, _overrides(**blocks))
    return norms(product, residual, norm_weight, next_norm_weight, eps, interpret=interpret)
