"""The edge-frame ops' autograd: the same maths in differentiable PyTorch (second
derivatives, and a cross-check), the ``torch.library`` ops that keep the kernels
opaque to inductor, and the two autograd Functions."""

from __future__ import annotations

import math

import torch

from .. import reference
from ..so3 import lm_tables
from .launch import pack, rotate_bwd, rotate_fwd, unrotate_bwd, unrotate_fwd


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


@torch.library.custom_op("ecekern::edge_frame_rotate", mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor]:
    csr = (ptr_dst, perm_dst, ptr_src, perm_src)
    return rotate_fwd(h, d, tab, rho, csr, L, M, packed)


@_rotate_op.register_fake
def _(h, d, tab, rho, ptr_dst, perm_dst, ptr_src, perm_src, L, M, packed):
    shape = (d.shape[0], 2 * h.shape[2] * (L + 1), M + 1)
    return h.new_empty(shape), h.new_empty(shape)


@torch.library.custom_op("ecekern::edge_frame_rotate_bwd", mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    csr = (ptr_dst, perm_dst, ptr_src, perm_src)
    dh, dd, drho = rotate_bwd(gc, gs, h, d, tab, rho, csr, L, M, packed)
    return dh, dd, drho if drho is not None else h.new_empty(0)


@_rotate_bwd_op.register_fake
def _(gc, gs, h, d, tab, rho, ptr_dst, perm_dst, ptr_src, perm_src, L, M, packed):
    n_rho = (d.shape[0], 2 * h.shape[2] * (L + 1)) if rho is not None else (0,)
    return h.new_empty(h.shape), d.new_empty(d.shape), h.new_empty(n_rho)


@torch.library.custom_op("ecekern::edge_frame_unrotate", mutates_args=())
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
) -> torch.Tensor:
    return unrotate_fwd(yc, ys, d, tab, w, row_ptr, scale, L, M, packed)


@_unrotate_op.register_fake
def _(yc, ys, d, tab, w, row_ptr, scale, L, M, packed):
    C = yc.shape[1] // (L + 1)
    return yc.new_empty((row_ptr.shape[0] - 1, (L + 1) ** 2, C))


@torch.library.custom_op("ecekern::edge_frame_unrotate_bwd", mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dyc, dys, dd, dw = unrotate_bwd(G, yc, ys, d, tab, w, row_ptr, scale, L, M, packed)
    return dyc, dys, dd, dw if dw is not None else yc.new_empty(0)


@_unrotate_bwd_op.register_fake
def _(G, yc, ys, d, tab, w, row_ptr, scale, L, M, packed):
    n_w = (yc.shape[0],) if w is not None else (0,)
    return (
        yc.new_empty(yc.shape),
        ys.new_empty(ys.shape),
        d.new_empty(d.shape),
        (yc.new_empty(n_w)),
    )


class _RotateFn(torch.autograd.Function):
    """``(h, d, rho) -> (x_cos, x_sin)``; the graph's index tensors ride along."""

    @staticmethod
    def forward(ctx, h, d, rho, tab, src, dst, csr, L, M, packed, launch, planes):
        ctx.save_for_backward(h, d, rho, tab, src, dst, *csr)
        ctx.meta = (L, M, packed, launch, csr[1] is None)
        if torch.compiler.is_compiling():
            return _rotate_op(h, d, tab, rho, *csr, L, M, packed)
        return rotate_fwd(h, d, tab, rho, csr, L, M, packed, launch, planes)

    @staticmethod
    def backward(ctx, gc, gs):
        h, d, rho, tab, src, dst, *csr = ctx.saved_tensors
        L, M, packed, launch, no_dst_perm = ctx.meta
        if no_dst_perm:
            csr[1] = None
        if torch.is_grad_enabled():  # a second derivative: differentiable PyTorch
            return (*_torch_grads(
                lambda h, d, rho: rotate_torch(h, d, rho, src, dst, M, packed),
                (h, d, rho), ctx.needs_input_grad[:3], (gc, gs),
            ), *(None,) * 9)  # fmt: skip
        if torch.compiler.is_compiling():
            gc, gs = gc.contiguous(), gs.contiguous()
            dh, dd, drho = _rotate_bwd_op(gc, gs, h, d, tab, rho, *csr, L, M, packed)
        else:  # any strides (a planes pair from chapter 6's kernels as it is)
            dh, dd, drho = rotate_bwd(gc, gs, h, d, tab, rho, csr, L, M, packed,
                                      launch)  # fmt: skip
        return dh, dd, drho if rho is not None else None, *(None,) * 9


class _UnrotateFn(torch.autograd.Function):
    """``(y_cos, y_sin, d, w) -> Delta``; edges dst-sorted with ``row_ptr``."""

    @staticmethod
    def forward(ctx, yc, ys, d, w, tab, dst, row_ptr, scale, L, M, packed, launch):
        ctx.save_for_backward(yc, ys, d, w, tab, dst, row_ptr)
        ctx.meta = (scale, L, M, packed, launch)
        if torch.compiler.is_compiling():
            yc, ys = yc.contiguous(), ys.contiguous()
            return _unrotate_op(yc, ys, d, tab, w, row_ptr, scale, L, M, packed)
        return unrotate_fwd(yc, ys, d, tab, w, row_ptr, scale, L, M, packed, launch)

    @staticmethod
    def backward(ctx, G):
        yc, ys, d, w, tab, dst, row_ptr = ctx.saved_tensors
        scale, L, M, packed, launch = ctx.meta
        N = row_ptr.shape[0] - 1
        if torch.is_grad_enabled():  # a second derivative: differentiable PyTorch

            def fn(yc, ys, d, w):
                msg = unrotate_torch(yc, ys, d, M, packed)
                return reference.aggregate(msg, dst, N, scale, w)

            grads = _torch_grads(fn, (yc, ys, d, w), ctx.needs_input_grad[:4], (G,))
            return (*grads, *(None,) * 8)
        G = G.contiguous()
        need_d, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        if torch.compiler.is_compiling():
            yc, ys = yc.contiguous(), ys.contiguous()
            dyc, dys, dd, dw = _unrotate_bwd_op(
                G, yc, ys, d, tab, w, row_ptr, scale, L, M, packed
            )
        else:
            dyc, dys, dd, dw = unrotate_bwd(
                G, yc, ys, d, tab, w, row_ptr, scale, L, M, packed, need_d, need_w,
                launch,
            )  # fmt: skip
        return dyc, dys, dd, dw if need_w else None, *(None,) * 8


def _torch_grads(fn, inputs, needs, grads):
    """The gradients of ``fn(*inputs)`` against ``grads``, differentiable (for a
    second derivative); None where not needed."""
    want = [t for t, need in zip(inputs, needs) if need and t is not None]
    with torch.enable_grad():
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        got = torch.autograd.grad(out, want, grads, create_graph=True,
                                  allow_unused=True)  # fmt: skip
    it = iter(got)
    return tuple(
        next(it) if need and t is not None else None for t, need in zip(inputs, needs)
    )
