"""EquivariantLinear as dense GEMMs: the block-diagonal forward, and the weight
gradient that every path uses.

Forward: one row-major GEMM of ``x (B, K n_ang)`` against the per-m block-diagonal
``(K n_ang, O n_ang)`` weight, assembled from W on each call (autograd flows through
the assembly): no copies of x, n_ang times the needed flops. Bytes ``s B n_ang (K + O)``
plus the assembled weight; flops ``2 B K O n_ang^2``.

Weight gradient: the block diagonal of one GEMM per cos and sin over the flattened
(feature, mode) axes, ``dW[m, o, k] = sum_b g[b, o, m] x[b, k, m]`` over cos and sin:
n_ang times the flops, on the vendor's tuned GEMM, deterministic.

Status: any dtype and device torch's GEMM serves; differentiable to any order.
"""

from __future__ import annotations

import math

import torch

__all__ = ["bwd_w_gemm", "dense"]


def dense(x_cos, x_sin, weight, bias):
    """One row-major GEMM against the per-m block-diagonal weight.

    The weight is built transposed, ``w_t[o n_ang + n, k n_ang + m] = W[m, o, k]
    (m == n)``, one contiguous ``(O, K, n_ang)`` slab per mode stacked along a new
    axis: no permute and so no copy, forward or backward (an einsum or a reshape of a
    permuted weight costs two ``aten::copy_`` per call). The GEMM reads it transposed,
    which cuBLAS does for free."""
    n_ang, O, K = weight.shape
    lead = x_cos.shape[:-2]
    eye = torch.eye(n_ang, dtype=weight.dtype, device=weight.device)
    w_t = torch.stack(
        [w_m[:, :, None] * eye[m] for m, w_m in enumerate(weight.unbind(0))], dim=1
    ).reshape(O * n_ang, K * n_ang)
    rows = math.prod(lead)
    xc = x_cos.reshape(rows, K * n_ang)
    xs = x_sin.reshape(rows, K * n_ang)
    if bias is not None:
        b_bd = (bias[:, None] * eye[0]).reshape(-1)  # on the m = 0 slots only
        y_cos = torch.addmm(b_bd, xc, w_t.t())
    else:
        y_cos = xc @ w_t.t()
    y_sin = xs @ w_t.t()
    return y_cos.reshape(*lead, O, n_ang), y_sin.reshape(*lead, O, n_ang)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 16-bit ``a, b`` with the fp32 sums kept (``torch.mm``'s
    ``out_dtype``); a torch without it rounds the product once and widens it."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # no mm(..., out_dtype) here
        return torch.mm(a.float(), b.float())


def bwd_w_gemm(gc, gs, xc, xs) -> torch.Tensor:
    """``dW (n_ang, O, K)`` from ``g (B, O, n_ang)`` and ``x (B, K, n_ang)`` of cos
    and sin: ``M = g2^T x2`` with ``g2 = g (B, O n)`` and ``x2 = x (B, K n)``,
    ``dW[m, o, k] = M[o n + m, k n + m]``. M is summed in fp32 for 16-bit inputs and
    rounded once."""
    B, O, n = gc.shape
    K = xc.shape[1]
    (g2c, x2c), (g2s, x2s) = (
        (g.reshape(B, O * n).t(), x.reshape(B, K * n)) for g, x in ((gc, xc), (gs, xs))
    )
    if gc.dtype in (torch.bfloat16, torch.float16):
        m = _mm_fp32(g2c, x2c)
        m += _mm_fp32(g2s, x2s)
    else:
        m = g2c @ x2c
        m.addmm_(g2s, x2s)
    d = m.view(O, n, K, n).diagonal(dim1=1, dim2=3).permute(2, 0, 1)
    return d.to(gc.dtype).contiguous()
