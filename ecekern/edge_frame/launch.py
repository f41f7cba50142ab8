"""Launchers of the edge-frame kernels: the launch, the row tables, the packed tile
(:func:`pack`) and one function per kernel that allocates and launches.

The rotation's rows and the unrotation's row gradients are written into one tensor
that holds both, cos and sin (:func:`rows_tensor`): ``*_rows`` return that tensor
(what the library ops return: their outputs may not alias each other), the public
launchers its two views (:func:`rows_views`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .._autograd import wrap_triton
from .._triton import split_scale, tl, triton
from ..so3 import lm_tables, table_mode
from .kernels import (
    _rotate_bwd_kernel,
    _rotate_fwd_kernel,
    _unrotate_bwd_kernel,
    _unrotate_fwd_kernel,
)


@dataclass(frozen=True)
class EdgeFrameLaunch:
    """Edges per loop step (``*_block``) and warps per program of the four kernels.
    One fixed choice, so results are the same bits in every process: the fastest of
    the launch sweep at 365k edges (L = 2, C = 32, fp32)."""

    rotate_block: int = 2
    rotate_warps: int = 4
    rotate_bwd_block: int = 4
    rotate_bwd_warps: int = 4
    unrotate_block: int = 2
    unrotate_warps: int = 4
    unrotate_bwd_block: int = 4
    unrotate_bwd_warps: int = 4


#: The library's launch (the defaults above).
LAUNCH = EdgeFrameLaunch()


@functools.cache
def _tables_cpu(L: int, M: int) -> torch.Tensor:
    """``tab[t, l, m]``: the row of D that the cos (t = 0) or sin (t = 1) slot
    ``(l, m)`` selects, -1 where the slot is empty; int32 ``(2, L+1, n_ang)``."""
    t = lm_tables(L, M)
    S = t.S
    with table_mode():
        tab = torch.stack([t.cos_index, t.sin_index]).to(torch.int32)
        return torch.where(tab == S, -1, tab).contiguous()


_TABLES: dict = {}


def tables(L: int, M: int, device: torch.device) -> torch.Tensor:
    """:func:`_tables_cpu` on ``device``, copied there once."""
    key = (L, M, str(device))
    tab = _TABLES.get(key)
    if tab is None:
        with table_mode():
            tab = _TABLES[key] = _tables_cpu(L, M).to(device)
    return tab


@functools.cache
def _pack_index_cpu(L: int, M: int) -> torch.Tensor:
    """``idx[s, t*n_ang + m]``: the row of D behind ``P[e, s, t, m]``, or S (a zero
    row) where the slot is empty or of another degree than s."""
    t = lm_tables(L, M)
    S, NA = t.S, t.n_ang
    with table_mode():
        idx = torch.full((S, 2 * NA), S, dtype=torch.long)
        for s in range(S):
            l = int(t.l_of_s[s])
            for m in range(NA):
                idx[s, m] = t.cos_index[l, m]
                idx[s, NA + m] = t.sin_index[l, m]
    return idx


def pack(D: torch.Tensor, mmax: int) -> torch.Tensor:
    """``P[e, s, t, m] = D[e, row_t(l(s), m), s]``, ``(E, S, S) -> (E, S, 2, n_ang)``:
    the select folded into D's blocks, one contiguous row of n_ang values per (s, t).
    One gather (its backward scatters dP into dD; no two slots share an entry)."""
    E, S = D.shape[0], D.shape[-1]
    L = math.isqrt(S) - 1
    NA = mmax + 1
    key = (L, mmax, str(D.device))
    idx = _TABLES.get(("pack",) + key)
    if idx is None:
        with table_mode():
            idx = _pack_index_cpu(L, mmax).to(D.device)
        _TABLES[("pack",) + key] = idx
    Dt = torch.nn.functional.pad(D.transpose(1, 2), (0, 1))  # (E, S, S+1): D^T | 0
    P = torch.gather(Dt, 2, idx.unsqueeze(0).expand(E, S, 2 * NA))
    return P.view(E, S, 2, NA)


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _meta(L: int, M: int, C: int) -> dict:
    return {
        "L": L,
        "NA": M + 1,
        "NA_PAD": triton.next_power_of_2(M + 1),
        "C_PAD": triton.next_power_of_2(max(C, 1)),
    }


def rows_tensor(E: int, F: int, NA: int, like: torch.Tensor, planes: bool,
                zero: bool = False) -> torch.Tensor:  # fmt: skip
    """The one tensor that holds two ``(E, F, n_ang)`` row tensors (cos, sin):
    ``(2, E, F, n_ang)``, or with ``planes`` the planes ``(n_ang, 2, E, F)``
    (:func:`ecekern._planes.planes_pair`), the layout chapter 6's layer kernels read;
    zero-filled with ``zero``."""
    shape = (NA, 2, E, F) if planes else (2, E, F, NA)
    return like.new_zeros(shape) if zero else like.new_empty(shape)


def rows_views(X: torch.Tensor, planes: bool):
    """The cos and sin rows ``(E, F, n_ang)`` of :func:`rows_tensor`'s ``X``."""
    if planes:
        return X[:, 0].permute(1, 2, 0), X[:, 1].permute(1, 2, 0)
    return X[0], X[1]


def planes_strided(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether rows ``a``, ``b`` ``(E, F, n_ang)`` both have the element strides of
    a contiguous planes pair, ``(F, 1, 2 E F)`` (the unrotation's backward then
    writes dy as one, read by the same kernels); from the strides alone, so the same
    while compiling."""
    E, F, NA = a.shape
    st = (F, 1, 2 * E * F)
    return E > 0 and a.stride() == st and b.stride() == st


def shared_strides(a: torch.Tensor, b: torch.Tensor):
    """``(a, b)`` with one set of element strides (as they are, or both made
    contiguous)."""
    if a.stride() == b.stride():
        return a, b
    return a.contiguous(), b.contiguous()


def rotate_rows(h, d, tab, rho, csr, L: int, M: int, packed: bool,
                block: int, warps: int, planes: bool) -> torch.Tensor:  # fmt: skip
    """Launch the rotation, both sides, ``block`` edges per loop step: the one
    :func:`rows_tensor` holding ``(x_cos, x_sin)``, each ``(E, 2C(L+1), n_ang)``.
    ``csr = (ptr_dst, perm_dst or None, ptr_src, perm_src)``."""
    N, S, C = h.shape
    N, C = int(N), int(C)
    E = d.shape[0]
    F, NA = 2 * C * (L + 1), M + 1
    if N == 0 or E == 0 or C == 0:
        return rows_tensor(E, F, NA, h, planes, zero=True)
    X = rows_tensor(E, F, NA, h, planes)
    xc, xs = rows_views(X, planes)
    rho_args = (rho, rho.stride(0), rho.stride(1)) if rho is not None else (h, 0, 0)
    ptr_dst, perm_dst, ptr_src, perm_src = csr
    for side, ptr, perm in ((0, ptr_dst, perm_dst), (1, ptr_src, perm_src)):
        wrap_triton(_rotate_fwd_kernel)[(N,)](
            h, d, tab, rho_args[0], ptr, perm if perm is not None else ptr, xc, xs,
            E, C, rho_args[1], rho_args[2], *xc.stride(), **_meta(L, M, C),
            BLOCK_E=block, SIDE=side, PERM=perm is not None,
            PACKED=packed, HAS_RHO=rho is not None, ACC=_acc(h.dtype),
            num_warps=warps,
        )  # fmt: skip
    return X


def rotate_fwd(h, d, tab, rho, csr, L: int, M: int, packed: bool,
               launch: EdgeFrameLaunch = LAUNCH,
               planes: bool = False):  # fmt: skip
    """:func:`rotate_rows` at ``launch``: ``(x_cos, x_sin)``, the two views of one
    ``(2, E, F, n_ang)`` tensor, or (``planes``) of one planes tensor."""
    X = rotate_rows(h, d, tab, rho, csr, L, M, packed, launch.rotate_block,
                    launch.rotate_warps, planes)  # fmt: skip
    return rows_views(X, planes)


def rotate_bwd(gc, gs, h, d, tab, rho, csr, L: int, M: int, packed: bool,
               launch: EdgeFrameLaunch = LAUNCH):  # fmt: skip
    """:func:`rotate_grads` at ``launch``."""
    return rotate_grads(gc, gs, h, d, tab, rho, csr, L, M, packed,
                        launch.rotate_bwd_block, launch.rotate_bwd_warps)  # fmt: skip


def rotate_grads(gc, gs, h, d, tab, rho, csr, L: int, M: int, packed: bool,
                 block: int, warps: int):  # fmt: skip
    """Launch the merged backward, both sides: ``(dh, dd, drho or None)``; dd has
    d's shape (P's, or D's with zeros off the selected entries). ``gc, gs``: any
    strides, read as they are when they share them."""
    gc, gs = shared_strides(gc, gs)
    N, S, C = h.shape
    N, C = int(N), int(C)
    E = d.shape[0]
    dh = torch.zeros_like(h)
    dd = torch.zeros_like(d)
    drho = None
    if rho is not None:
        drho = torch.zeros((E, 2 * C * (L + 1)), device=h.device, dtype=h.dtype)
    if N == 0 or E == 0 or C == 0:
        return dh, dd, drho
    rho_args = (rho, rho.stride(0), rho.stride(1)) if rho is not None else (h, 0, 0)
    ptr_dst, perm_dst, ptr_src, perm_src = csr
    for side, ptr, perm in ((0, ptr_dst, perm_dst), (1, ptr_src, perm_src)):
        wrap_triton(_rotate_bwd_kernel)[(N,)](
            gc, gs, h, d, tab, rho_args[0], ptr, perm if perm is not None else ptr,
            dh, dd, drho if drho is not None else dh,
            E, C, rho_args[1], rho_args[2], *gc.stride(), **_meta(L, M, C),
            S_PAD=triton.next_power_of_2(S), BLOCK_E=block,
            SIDE=side, PERM=perm is not None, PACKED=packed,
            HAS_RHO=rho is not None, ACC=_acc(h.dtype),
            num_warps=warps,
        )  # fmt: skip
    return dh, dd, drho


def unrotate_fwd(yc, ys, d, tab, w, row_ptr, scale: float, L: int, M: int,
                 packed: bool,
                 launch: EdgeFrameLaunch = LAUNCH):  # fmt: skip
    """:func:`unrotate_node_rows` at ``launch``."""
    return unrotate_node_rows(yc, ys, d, tab, w, row_ptr, scale, L, M, packed,
                              launch.unrotate_block, launch.unrotate_warps)  # fmt: skip


def unrotate_node_rows(yc, ys, d, tab, w, row_ptr, scale: float, L: int, M: int,
                       packed: bool, block: int, warps: int):  # fmt: skip
    """Launch the unrotation with the aggregation: ``Delta (N, S, C')``, one program
    per destination node; y of any strides (read as they are when cos and sin share
    them), edges dst-sorted."""
    yc, ys = shared_strides(yc, ys)
    E = yc.shape[0]
    C = int(yc.shape[1]) // (L + 1)
    S = (L + 1) ** 2
    N = row_ptr.shape[0] - 1
    out = torch.empty((N, S, C), device=yc.device, dtype=yc.dtype)
    if N == 0 or C == 0:
        return out.zero_()
    wrap_triton(_unrotate_fwd_kernel)[(N,)](
        yc, ys, d, tab, w if w is not None else yc, row_ptr, out,
        E, C, *split_scale(scale), *yc.stride(), **_meta(L, M, C),
        S_PAD=triton.next_power_of_2(S), BLOCK_E=block,
        PACKED=packed, HAS_W=w is not None, ACC=_acc(yc.dtype),
        num_warps=warps,
    )  # fmt: skip
    return out


def unrotate_bwd(G, yc, ys, d, tab, w, row_ptr, scale: float, L: int, M: int,
                 packed: bool, need_d: bool = True, need_w: bool = True,
                 launch: EdgeFrameLaunch = LAUNCH):  # fmt: skip
    """:func:`unrotate_grads` at ``launch``: ``(dy_cos, dy_sin, dd or None, dw or
    None)``, dy the views of its one rows tensor."""
    planes = planes_strided(yc, ys)
    dY, dd, dw = unrotate_grads(G, yc, ys, d, tab, w, row_ptr, scale, L, M, packed,
                                need_d, need_w, launch.unrotate_bwd_block,
                                launch.unrotate_bwd_warps)  # fmt: skip
    dyc, dys = rows_views(dY, planes)
    return dyc, dys, dd if need_d else None, dw if need_w and w is not None else None


def unrotate_grads(G, yc, ys, d, tab, w, row_ptr, scale: float, L: int, M: int,
                   packed: bool, need_d: bool, need_w: bool, block: int,
                   warps: int):  # fmt: skip
    """Launch the merged backward: ``(dY, dd, dw)``, dY the one :func:`rows_tensor`
    holding ``(dy_cos, dy_sin)``, a planes tensor when y's rows have a contiguous
    planes pair's strides (:func:`planes_strided`), else ``(2, E, F, n_ang)`` (y then
    read contiguous); dd (d's shape) and dw (w's) empty ``(0,)`` where not asked for
    (``need_d``, ``need_w``) or w is None."""
    yc, ys = shared_strides(yc, ys)
    E = yc.shape[0]
    C = int(yc.shape[1]) // (L + 1)
    N = row_ptr.shape[0] - 1
    need_w = need_w and w is not None
    planes = planes_strided(yc, ys)
    if not planes:  # dy is written with y's strides: make them the rows'
        yc, ys = yc.contiguous(), ys.contiguous()
    # one fill for the pair (every row of an edge in a segment is set)
    dY = rows_tensor(E, yc.shape[1], yc.shape[2], yc, planes, zero=True)
    dyc, dys = rows_views(dY, planes)
    dd = torch.zeros_like(d) if need_d else d.new_empty(0)
    dw = torch.zeros_like(w) if need_w else yc.new_empty(0)
    if N == 0 or E == 0 or C == 0:
        return dY, dd, dw
    wrap_triton(_unrotate_bwd_kernel)[(N,)](
        G, yc, ys, d, tab, w if w is not None else yc, row_ptr,
        dyc, dys, dd if need_d else dyc, dw if need_w else dyc,
        E, C, *split_scale(scale), *yc.stride(), **_meta(L, M, C),
        BLOCK_E=block, PACKED=packed, HAS_W=w is not None,
        NEED_D=need_d, NEED_W=need_w, ACC=_acc(yc.dtype),
        num_warps=warps,
    )  # fmt: skip
    return dY, dd, dw
