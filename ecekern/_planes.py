"""The planes layout that chapters 3 and 6 hand rows over in (shared, as the Triton
shim is: chapter modules do not import each other).

Rows are ``(E, W, n_ang)`` pairs (cos, sin). A *planes pair* is the cos and sin
views ``P[:, 0]``, ``P[:, 1]`` (permuted to ``(E, W, n_ang)``) of one ``P (n_ang,
2, E, W)`` (order, cos/sin, edge, feature): element strides ``(W, 1, 2 E W)``, a
feature row of one order contiguous, which is what chapter 6's layer kernels read.
"""

from __future__ import annotations

import torch

__all__ = ["as_planes", "planes_pair"]


def planes_pair(like: torch.Tensor, E: int, W: int, n_ang: int):
    """New planes ``P (n_ang, 2, E, W)`` like ``like`` and its cos and sin rows:
    ``(P, rows_cos, rows_sin)``."""
    P = like.new_empty((n_ang, 2, E, W))
    return P, P[:, 0].permute(1, 2, 0), P[:, 1].permute(1, 2, 0)


def as_planes(a_cos: torch.Tensor, a_sin: torch.Tensor) -> torch.Tensor | None:
    """The ``(n_ang, 2, E, W)`` planes view that rows ``a_cos``, ``a_sin`` are the
    cos and sin views of (:func:`planes_pair`'s, or any with gaps between the
    planes), or None."""
    E, W, n_ang = a_cos.shape
    st = a_cos.stride()
    if (
        E == 0
        or a_sin.shape != a_cos.shape
        or a_sin.stride() != st
        or st[:2] != (W, 1)
        or a_sin.dtype != a_cos.dtype
        or a_sin.untyped_storage().data_ptr() != a_cos.untyped_storage().data_ptr()
    ):
        return None
    s_c = a_sin.storage_offset() - a_cos.storage_offset()
    if s_c < E * W or (n_ang > 1 and st[2] < s_c + E * W):
        return None  # not two disjoint sets of planes
    return a_cos.as_strided((n_ang, 2, E, W), (st[2], s_c, W, 1))
