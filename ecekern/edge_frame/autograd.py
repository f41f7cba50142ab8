"""The edge-frame ops' autograd, in :mod:`ecekern._autograd`'s style: four
``torch.library`` ops, one per kernel launcher (``triton_op`` on a GPU, so inductor
traces the launches; custom ops in the interpreter), called in eager mode and while
compiling alike, and two autograd Functions around them; plus the same maths in
differentiable PyTorch (the second derivatives, and a cross-check).

The rotation's op returns the one tensor that holds x_cos and x_sin (a planes tensor
with ``planes=True``), and its Function returns the two views; the Function's
backward gets their gradients as they come (a planes pair's, read in place). The
unrotation's backward op returns dy the same way. With grad mode on in a backward (a
second derivative) the Functions differentiate :func:`rotate_torch` and
:func:`unrotate_torch` instead.
"""

from __future__ import annotations

import math

import torch

from .. import reference
from .._autograd import library_op, torch_grads
from ..so3 import lm_tables
from .launch import (
    EdgeFrameLaunch,
    pack,
    planes_strided,
    rotate_grads,
    rotate_rows,
    rows_views,
    unrotate_grads,
    unrotate_node_rows,
)


def _degree_onehot(L: int, like: torch.Tensor) -> torch.Tensor:
    l_of_s = lm_tables(L).on(like.device).l_of_s
    return (l_of_s[:, None] == torch.arange(L + 1, device=like.device)).to(like.dtype)


def rotate_torch(h, d, rho, src, dst, mmax: int, packed: bool):
    """:func:`rotate_and_select` (times rho) in PyTorch ops, from P or D."""
    P = d if packed else pack(d, mmax)
    E, S = P.shape[:2]
    L = math.isqrt(S) - 1
    A = torch.cat([h[dst], h[src]], dim=-1)  # (E, S, 2C)
    x = torch.einsum("estm,sl,esc->etclm", P, _degree_onehot(L, P), A)
    if rho is not None:
        x = x * rho.reshape(E, 1, A.shape[-1], L + 1, 1)
    x = x.reshape(E, 2, -1, mmax + 1)
    return x[:, 0], x[:, 1]


def unrotate_torch(yc, ys, d, mmax: int, packed: bool):
    """The per-edge message ``(E, S, C')`` of :func:`pack_and_unrotate` in PyTorch."""
    P = d if packed else pack(d, mmax)
    E, S = P.shape[:2]
    L = math.isqrt(S) - 1
    y = torch.stack([yc, ys], dim=1).reshape(E, 2, -1, L + 1, mmax + 1)
    return torch.einsum("estm,sl,etclm->esc", P, _degree_onehot(L, P), y)


# --------------------------------------------------------------------------------------
# torch.library ops: one per launcher; the launch's fields are ints
# --------------------------------------------------------------------------------------
def _rotate_fake(h, d, tab, rho, ptr_dst, perm_dst, ptr_src, perm_src, L, M, packed,
                 planes, block, warps):  # fmt: skip
    E, F, NA = d.shape[0], 2 * h.shape[2] * (L + 1), M + 1
    return h.new_empty((NA, 2, E, F) if planes else (2, E, F, NA))


@library_op("edge_frame_rotate", _rotate_fake)
def _rotate_op(
    h: torch.Tensor,
    d: torch.Tensor,
    tab: torch.Tensor,
    rho: torch.Tensor | None,
    ptr_dst: torch.Tensor,
    perm_dst: torch.Tensor | None,
    ptr_src: torch.Tensor,
    perm_src: torch.Tensor,
    L: int,
    M: int,
    packed: bool,
    planes: bool,
    block: int,
    warps: int,
) -> torch.Tensor:
    csr = (ptr_dst, perm_dst, ptr_src, perm_src)
    return rotate_rows(h, d, tab, rho, csr, L, M, packed, block, warps, planes)


def _rotate_bwd_fake(gc, gs, h, d, tab, rho, ptr_dst, perm_dst, ptr_src, perm_src,
                     L, M, packed, block, warps):  # fmt: skip
    n_rho = (d.shape[0], 2 * h.shape[2] * (L + 1)) if rho is not None else (0,)
    return h.new_empty(h.shape), d.new_empty(d.shape), h.new_empty(n_rho)


@library_op("edge_frame_rotate_bwd", _rotate_bwd_fake)
def _rotate_bwd_op(
    gc: torch.Tensor,
    gs: torch.Tensor,
    h: torch.Tensor,
    d: torch.Tensor,
    tab: torch.Tensor,
    rho: torch.Tensor | None,
    ptr_dst: torch.Tensor,
    perm_dst: torch.Tensor | None,
    ptr_src: torch.Tensor,
    perm_src: torch.Tensor,
    L: int,
    M: int,
    packed: bool,
    block: int,
    warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dh, dd, drho)``, drho empty ``(0,)`` without rho."""
    csr = (ptr_dst, perm_dst, ptr_src, perm_src)
    dh, dd, drho = rotate_grads(gc, gs, h, d, tab, rho, csr, L, M, packed, block,
                                warps)  # fmt: skip
    return dh, dd, drho if drho is not None else h.new_empty(0)


def _unrotate_fake(yc, ys, d, tab, w, row_ptr, scale, L, M, packed, block, warps):
    C = yc.shape[1] // (L + 1)
    return yc.new_empty((row_ptr.shape[0] - 1, (L + 1) ** 2, C))


@library_op("edge_frame_unrotate", _unrotate_fake)
def _unrotate_op(
    yc: torch.Tensor,
    ys: torch.Tensor,
    d: torch.Tensor,
    tab: torch.Tensor,
    w: torch.Tensor | None,
    row_ptr: torch.Tensor,
    scale: float,
    L: int,
    M: int,
    packed: bool,
    block: int,
    warps: int,
) -> torch.Tensor:
    return unrotate_node_rows(yc, ys, d, tab, w, row_ptr, scale, L, M, packed,
                              block, warps)  # fmt: skip


def _unrotate_bwd_fake(G, yc, ys, d, tab, w, row_ptr, scale, L, M, packed, need_d,
                       need_w, block, warps):  # fmt: skip
    E, F, NA = yc.shape
    planes = planes_strided(yc, ys)
    dY = yc.new_empty((NA, 2, E, F) if planes else (2, E, F, NA))
    dd = d.new_empty(d.shape if need_d else (0,))
    return dY, dd, yc.new_empty((E,) if need_w and w is not None else (0,))


@library_op("edge_frame_unrotate_bwd", _unrotate_bwd_fake)
def _unrotate_bwd_op(
    G: torch.Tensor,
    yc: torch.Tensor,
    ys: torch.Tensor,
    d: torch.Tensor,
    tab: torch.Tensor,
    w: torch.Tensor | None,
    row_ptr: torch.Tensor,
    scale: float,
    L: int,
    M: int,
    packed: bool,
    need_d: bool,
    need_w: bool,
    block: int,
    warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dY, dd, dw)``: :func:`~ecekern.edge_frame.launch.unrotate_grads`."""
    return unrotate_grads(G, yc, ys, d, tab, w, row_ptr, scale, L, M, packed,
                          need_d, need_w, block, warps)  # fmt: skip


# --------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------
class _RotateFn(torch.autograd.Function):
    """``(h, d, rho) -> (x_cos, x_sin)``, the two views of the op's one rows tensor;
    the graph's index tensors ride along."""

    @staticmethod
    def forward(ctx, h, d, rho, tab, src, dst, csr, L, M, packed,
                launch: EdgeFrameLaunch, planes):  # fmt: skip
        ctx.save_for_backward(h, d, rho, tab, src, dst, *csr)
        ctx.meta = (L, M, packed, launch, csr[1] is None)
        X = _rotate_op(h, d, tab, rho, *csr, L, M, packed, planes,
                       launch.rotate_block, launch.rotate_warps)  # fmt: skip
        return rows_views(X, planes)

    @staticmethod
    def backward(ctx, gc, gs):
        h, d, rho, tab, src, dst, *csr = ctx.saved_tensors
        L, M, packed, launch, no_dst_perm = ctx.meta
        if no_dst_perm:
            csr[1] = None
        if torch.is_grad_enabled():  # a second derivative: differentiable PyTorch
            return (*torch_grads(
                lambda h, d, rho: rotate_torch(h, d, rho, src, dst, M, packed),
                (h, d, rho), ctx.needs_input_grad[:3], (gc, gs),
            ), *(None,) * 9)  # fmt: skip
        # any strides (a planes pair from chapter 6's kernels as it is)
        dh, dd, drho = _rotate_bwd_op(gc, gs, h, d, tab, rho, *csr, L, M, packed,
                                      launch.rotate_bwd_block,
                                      launch.rotate_bwd_warps)  # fmt: skip
        return dh, dd, drho if rho is not None else None, *(None,) * 9


class _UnrotateFn(torch.autograd.Function):
    """``(y_cos, y_sin, d, w) -> Delta``; edges dst-sorted with ``row_ptr``."""

    @staticmethod
    def forward(ctx, yc, ys, d, w, tab, dst, row_ptr, scale, L, M, packed,
                launch: EdgeFrameLaunch):  # fmt: skip
        ctx.save_for_backward(yc, ys, d, w, tab, dst, row_ptr)
        ctx.meta = (scale, L, M, packed, launch)
        return _unrotate_op(yc, ys, d, tab, w, row_ptr, scale, L, M, packed,
                            launch.unrotate_block, launch.unrotate_warps)  # fmt: skip

    @staticmethod
    def backward(ctx, G):
        yc, ys, d, w, tab, dst, row_ptr = ctx.saved_tensors
        scale, L, M, packed, launch = ctx.meta
        N = row_ptr.shape[0] - 1
        if torch.is_grad_enabled():  # a second derivative: differentiable PyTorch

            def fn(yc, ys, d, w):
                msg = unrotate_torch(yc, ys, d, M, packed)
                return reference.aggregate(msg, dst, N, scale, w)

            grads = torch_grads(fn, (yc, ys, d, w), ctx.needs_input_grad[:4], (G,))
            return (*grads, *(None,) * 8)
        need_d, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        dY, dd, dw = _unrotate_bwd_op(
            G.contiguous(), yc, ys, d, tab, w, row_ptr, scale, L, M, packed, need_d,
            need_w, launch.unrotate_bwd_block, launch.unrotate_bwd_warps,
        )  # fmt: skip
        # dy laid out as the op wrote it: a planes pair where y is one
        planes = planes_strided(yc, ys)
        dyc, dys = rows_views(dY, planes)
        return (dyc, dys, dd if need_d else None, dw if need_w else None,
                *(None,) * 8)  # fmt: skip
