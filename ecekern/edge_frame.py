"""The edge-frame kernels: rotate and select, unrotate with the aggregation (chapter 3).

Formula and shapes. ``D_e`` is block-diagonal over degrees; the selection of the
angular layout picks, for the slot ``(l, m)`` of the cos part (t = 0) and of the sin
part (t = 1), the row ``l^2+l+m`` or ``l^2+l-m`` of ``D_e``. Folded together::

    P[e, s, t, m] = D_e[row_t(l(s), m), s]     (zero where the slot is empty)

    rotate_and_select (one side: A = h[dst_e] for channels 0..C-1, h[src_e] after):
        x_t[e, c, l, m] = rho[e, c, l] * sum_{s: l(s) = l} P[e, s, t, m] A[e, s, c]
    unrotate_and_aggregate:
        Delta[n, s, c'] = k sum_{e: dst_e = n} w_e sum_{t, m} P[e, s, t, m]
                          y_t[e, c', l(s), m]

    h (N, S, C), x_t (E, 2C (L+1), n_ang), y_t (E, C' (L+1), n_ang), Delta (N, S, C'),
    rho (E, 2C (L+1)), w (E,), P (E, S, 2, n_ang), S = (L+1)^2, n_ang = M + 1.

Every kernel is one program per node. The rotation's program for node n handles the
edges that read h[n]: as destination (the dst-sorted CSR) and, in a second launch, as
source (a src-sorted permutation built once per graph). So h[n] is read once per
side, not gathered per edge, and every gradient is a sum owned by one program: no
atomics, deterministic. Two ways to read D (the chapter's comparison):

* ``table``: ``D (E, S, S)`` through the (l, m) row tables, one element per load;
* ``packed``: ``P`` built once per step by :class:`Frames` (a gather of D), read as
  contiguous rows of n_ang values; P is smaller than D (it holds the blocks only).

Gradients (G = dLoss/dDelta, g_t = dLoss/dx_t), each from one merged kernel per side::

    dh[n, s, c]    = sum_{e in side(n)} sum_{t, m} P[e, s, t, m] rho g_t[e, c, l(s), m]
    dP[e, s, t, m] = sum_c rho g_t[e, c, l(s), m] A[e, s, c]       (both sides add)
    drho[e, c, l]  = sum_{t, m} g_t[e, c, l, m] x0_t[e, c, l, m]    (x0: before rho)
    dy_t[e, c', l, m] = k w_e T_t,  T_t = sum_{s in l} P[e, s, t, m] G[dst_e, s, c']
    dP[e, s, t, m] = k w_e sum_c' y_t[e, c', l(s), m] G[dst_e, s, c']
    dw[e]          = k sum_{t, c', l, m} y_t T_t

dP reaches D (and the forces) through the packing gather's backward; the table
variant stores dD directly. Saved for the backward: the inputs; the rotation's
pre-modulation value x0 (for drho) is recomputed. A second derivative (a
force-training step) recomputes the op in differentiable PyTorch (:func:`rotate_torch`,
:func:`unrotate_torch`), with ``index_add_``: no atomics-free guarantee there.

Bytes (fp32, L = M = 2, C = 32, E = 365k): the rotation writes x (1.68 GB) and reads P
twice (0.16 GB) and rho; the unrotation reads y (0.84 GB) and P and writes node rows.

Status: fp64 (fp64 accumulation) and fp32 (fp32 accumulation), L = 1..4,
M <= L, any C, E = 0, nodes without edges, any strides (made contiguous), int64
offsets; D must be block-diagonal over degrees (a Wigner matrix): the entries off the
blocks are not read and get no gradient. Half precisions fall back to the reference,
loudly (not validated: the two side launches would round dh and dP to 16 bits between
them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import options, reference
from ._triton import split_scale, tl, triton, why_not_triton
from .so3 import lm_tables

__all__ = [
    "EdgeFrameLaunch",
    "Frames",
    "pack",
    "pack_and_unrotate",
    "rotate_and_select",
    "traffic",
    "unrotate_and_aggregate",
]

VARIANTS = ("table", "packed")


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _edges(ptr_ptr, perm_ptr, n, k0, E, BLOCK_E: tl.constexpr, PERM: tl.constexpr):
    """The next ``BLOCK_E`` edges of node n's segment from ``k0``: their ids (int64,
    through the permutation if ``PERM``) and mask. Indices are clamped: a CSR that
    was not validated cannot read out of bounds."""
    end = tl.minimum(tl.maximum(tl.load(ptr_ptr + n + 1), 0), E)
    k = k0 + tl.arange(0, BLOCK_E)
    mask = k < end
    if PERM:
        e = tl.load(perm_ptr + k, mask=mask, other=0)
        e = tl.minimum(tl.maximum(e, 0), E - 1)
    else:
        e = k
    return e.to(tl.int64), mask


@triton.jit
def _mask3(mask_e, mask_c, mask_m):
    return (mask_e[:, None] & mask_c[None, :])[:, :, None] & mask_m[None, None, :]


@triton.jit
def _segment(ptr_ptr, n, E):
    start = tl.minimum(tl.maximum(tl.load(ptr_ptr + n), 0), E)
    end = tl.minimum(tl.maximum(tl.load(ptr_ptr + n + 1), start), E)
    return start, end


@triton.jit
def _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, s: tl.constexpr, l: tl.constexpr,
            t: tl.constexpr, S: tl.constexpr, NA: tl.constexpr, J: tl.constexpr,
            PACKED: tl.constexpr):  # fmt: skip
    """Pointers and mask of ``P[e, s, t, m]`` for m < n_ang, ``[BLOCK_E, NA_PAD]``:
    a contiguous row of the packed tile, or D's rows ``row_t(l, m)`` in column s
    through the table (``tab[t, l, m]``, -1 where the slot is empty)."""
    mask_m = offs_m < NA
    if PACKED:
        ptrs = (
            d_ptr + e[:, None] * (S * 2 * NA) + (s * 2 * NA + t * NA) + offs_m[None, :]
        )
        return ptrs, mask_e[:, None] & mask_m[None, :]
    row = tl.load(tab_ptr + t * J + l * NA + offs_m, mask=mask_m, other=-1)
    ptrs = d_ptr + e[:, None] * (S * S) + row[None, :] * S + s
    return ptrs, mask_e[:, None] & (row >= 0)[None, :]


@triton.jit
def _rotate_fwd_kernel(
    h_ptr, d_ptr, tab_ptr, rho_ptr, ptr_ptr, perm_ptr, xc_ptr, xs_ptr,
    E, C, stride_rho_e, stride_rho_f,
    L: tl.constexpr, NA: tl.constexpr, NA_PAD: tl.constexpr, C_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr, SIDE: tl.constexpr, PERM: tl.constexpr,
    PACKED: tl.constexpr, HAS_RHO: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Node n, one side: ``x_t[e, SIDE*C + c, l, m]`` for the edges that read h[n]
    on this side, degree by degree (only the 2l+1 columns of degree l feed its
    slots)."""
    S: tl.constexpr = (L + 1) * (L + 1)
    J: tl.constexpr = (L + 1) * NA
    n = tl.program_id(0).to(tl.int64)
    start, end = _segment(ptr_ptr, n, E)
    offs_c = tl.arange(0, C_PAD)
    offs_m = tl.arange(0, NA_PAD)
    mask_c = offs_c < C
    rows = SIDE * C + offs_c  # this side's channel rows among the 2C
    for k0 in tl.range(start, end, BLOCK_E):
        e, mask_e = _edges(ptr_ptr, perm_ptr, n, k0, E, BLOCK_E, PERM)
        m3 = _mask3(mask_e, mask_c, offs_m < NA)
        for l in tl.static_range(L + 1):
            acc_c = tl.zeros([BLOCK_E, C_PAD, NA_PAD], ACC)
            acc_s = tl.zeros([BLOCK_E, C_PAD, NA_PAD], ACC)
            for i in tl.static_range(2 * l + 1):
                hrow = tl.load(h_ptr + n * (S * C) + (l * l + i) * C + offs_c,
                               mask=mask_c, other=0.0).to(ACC)  # fmt: skip
                p, pm = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 0,
                                S, NA, J, PACKED)  # fmt: skip
                dc = tl.load(p, mask=pm, other=0.0).to(ACC)
                p, pm = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 1,
                                S, NA, J, PACKED)  # fmt: skip
                ds = tl.load(p, mask=pm, other=0.0).to(ACC)
                acc_c += hrow[None, :, None] * dc[:, None, :]
                acc_s += hrow[None, :, None] * ds[:, None, :]
            if HAS_RHO:
                rho = tl.load(
                    rho_ptr + e[:, None] * stride_rho_e
                    + (rows * (L + 1) + l)[None, :] * stride_rho_f,
                    mask=mask_e[:, None] & mask_c[None, :], other=0.0,
                ).to(ACC)  # fmt: skip
                acc_c = acc_c * rho[:, :, None]
                acc_s = acc_s * rho[:, :, None]
            off = (
                e[:, None, None] * (2 * C * J)
                + rows[None, :, None] * J
                + l * NA
                + offs_m[None, None, :]
            )
            tl.store(xc_ptr + off, acc_c.to(xc_ptr.dtype.element_ty), mask=m3)
            tl.store(xs_ptr + off, acc_s.to(xs_ptr.dtype.element_ty), mask=m3)


@triton.jit
def _rotate_bwd_kernel(
    gc_ptr, gs_ptr, h_ptr, d_ptr, tab_ptr, rho_ptr, ptr_ptr, perm_ptr,
    dh_ptr, dd_ptr, drho_ptr,
    E, C, stride_rho_e, stride_rho_f,
    L: tl.constexpr, NA: tl.constexpr, NA_PAD: tl.constexpr, C_PAD: tl.constexpr,
    S_PAD: tl.constexpr, BLOCK_E: tl.constexpr, SIDE: tl.constexpr,
    PERM: tl.constexpr, PACKED: tl.constexpr, HAS_RHO: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """Node n, one side, merged: each gradient tile is read once and gives dh[n]
    (summed over the side's edges in registers), this side's share of dP (or dD) and
    of drho. The second side (SIDE = 1) adds its dh and dP to the first's."""
    S: tl.constexpr = (L + 1) * (L + 1)
    J: tl.constexpr = (L + 1) * NA
    n = tl.program_id(0).to(tl.int64)
    start, end = _segment(ptr_ptr, n, E)
    offs_c = tl.arange(0, C_PAD)
    offs_m = tl.arange(0, NA_PAD)
    offs_s = tl.arange(0, S_PAD)
    mask_c = offs_c < C
    rows = SIDE * C + offs_c
    acc_h = tl.zeros([S_PAD, C_PAD], ACC)
    for k0 in tl.range(start, end, BLOCK_E):
        e, mask_e = _edges(ptr_ptr, perm_ptr, n, k0, E, BLOCK_E, PERM)
        m2 = mask_e[:, None] & mask_c[None, :]
        m3 = m2[:, :, None] & (offs_m < NA)[None, None, :]
        for l in tl.static_range(L + 1):
            off = (
                e[:, None, None] * (2 * C * J)
                + rows[None, :, None] * J
                + l * NA
                + offs_m[None, None, :]
            )
            g_c = tl.load(gc_ptr + off, mask=m3, other=0.0).to(ACC)
            g_s = tl.load(gs_ptr + off, mask=m3, other=0.0).to(ACC)
            if HAS_RHO:
                rho = tl.load(
                    rho_ptr + e[:, None] * stride_rho_e
                    + (rows * (L + 1) + l)[None, :] * stride_rho_f,
                    mask=m2, other=0.0,
                ).to(ACC)  # fmt: skip
                gx_c = g_c * rho[:, :, None]
                gx_s = g_s * rho[:, :, None]
                x0_c = tl.zeros([BLOCK_E, C_PAD, NA_PAD], ACC)
                x0_s = tl.zeros([BLOCK_E, C_PAD, NA_PAD], ACC)
            else:
                gx_c = g_c
                gx_s = g_s
            for i in tl.static_range(2 * l + 1):
                hrow = tl.load(h_ptr + n * (S * C) + (l * l + i) * C + offs_c,
                               mask=mask_c, other=0.0).to(ACC)  # fmt: skip
                pc, pmc = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 0,
                                  S, NA, J, PACKED)  # fmt: skip
                ps, pms = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 1,
                                  S, NA, J, PACKED)  # fmt: skip
                dc = tl.load(pc, mask=pmc, other=0.0).to(ACC)
                ds = tl.load(ps, mask=pms, other=0.0).to(ACC)
                # dh[n, s, :]: contract the edges and the slots
                t = gx_c * dc[:, None, :] + gx_s * ds[:, None, :]
                row = tl.sum(tl.sum(t, axis=2), axis=0)
                acc_h = tl.where(offs_s[:, None] == l * l + i, acc_h + row[None, :],
                                 acc_h)  # fmt: skip
                # dP[e, s, t, :]: contract the channels
                ddc = tl.sum(gx_c * hrow[None, :, None], axis=1)
                dds = tl.sum(gx_s * hrow[None, :, None], axis=1)
                qc, qmc = _d_ptrs(dd_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 0,
                                  S, NA, J, PACKED)  # fmt: skip
                qs, qms = _d_ptrs(dd_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 1,
                                  S, NA, J, PACKED)  # fmt: skip
                if SIDE == 1:
                    ddc += tl.load(qc, mask=qmc, other=0.0).to(ACC)
                    dds += tl.load(qs, mask=qms, other=0.0).to(ACC)
                tl.store(qc, ddc.to(dd_ptr.dtype.element_ty), mask=qmc)
                tl.store(qs, dds.to(dd_ptr.dtype.element_ty), mask=qms)
                if HAS_RHO:
                    x0_c += hrow[None, :, None] * dc[:, None, :]
                    x0_s += hrow[None, :, None] * ds[:, None, :]
            if HAS_RHO:
                dr = tl.sum(g_c * x0_c + g_s * x0_s, axis=2)
                tl.store(
                    drho_ptr + e[:, None] * (2 * C * (L + 1))
                    + (rows * (L + 1) + l)[None, :],
                    dr.to(drho_ptr.dtype.element_ty), mask=m2,
                )  # fmt: skip
    out = dh_ptr + n * (S * C) + offs_s[:, None] * C + offs_c[None, :]
    mask = (offs_s < S)[:, None] & mask_c[None, :]
    if SIDE == 1:
        acc_h += tl.load(out, mask=mask, other=0.0).to(ACC)
    tl.store(out, acc_h.to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _unrotate_fwd_kernel(
    yc_ptr, ys_ptr, d_ptr, tab_ptr, w_ptr, ptr_ptr, out_ptr,
    E, C, scale_hi, scale_lo,
    L: tl.constexpr, NA: tl.constexpr, NA_PAD: tl.constexpr, C_PAD: tl.constexpr,
    S_PAD: tl.constexpr, BLOCK_E: tl.constexpr, PACKED: tl.constexpr,
    HAS_W: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Node n: ``Delta[n] = k sum_e w_e P_e^T y_e`` over its in-edges in CSR order;
    the per-edge message lives in registers only."""
    S: tl.constexpr = (L + 1) * (L + 1)
    J: tl.constexpr = (L + 1) * NA
    n = tl.program_id(0).to(tl.int64)
    start, end = _segment(ptr_ptr, n, E)
    offs_c = tl.arange(0, C_PAD)
    offs_m = tl.arange(0, NA_PAD)
    offs_s = tl.arange(0, S_PAD)
    mask_c = offs_c < C
    acc = tl.zeros([S_PAD, C_PAD], ACC)
    for k0 in tl.range(start, end, BLOCK_E):
        e, mask_e = _edges(ptr_ptr, ptr_ptr, n, k0, E, BLOCK_E, False)
        m3 = _mask3(mask_e, mask_c, offs_m < NA)
        if HAS_W:
            w = tl.load(w_ptr + e, mask=mask_e, other=0.0).to(ACC)
        for l in tl.static_range(L + 1):
            off = (
                e[:, None, None] * (C * J)
                + offs_c[None, :, None] * J
                + l * NA
                + offs_m[None, None, :]
            )
            y_c = tl.load(yc_ptr + off, mask=m3, other=0.0).to(ACC)
            y_s = tl.load(ys_ptr + off, mask=m3, other=0.0).to(ACC)
            if HAS_W:
                y_c = y_c * w[:, None, None]
                y_s = y_s * w[:, None, None]
            for i in tl.static_range(2 * l + 1):
                p, pm = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 0,
                                S, NA, J, PACKED)  # fmt: skip
                dc = tl.load(p, mask=pm, other=0.0).to(ACC)
                p, pm = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 1,
                                S, NA, J, PACKED)  # fmt: skip
                ds = tl.load(p, mask=pm, other=0.0).to(ACC)
                t = y_c * dc[:, None, :] + y_s * ds[:, None, :]
                row = tl.sum(tl.sum(t, axis=2), axis=0)
                acc = tl.where(offs_s[:, None] == l * l + i, acc + row[None, :], acc)
    acc = acc * scale_hi + acc * scale_lo
    tl.store(
        out_ptr + n * (S * C) + offs_s[:, None] * C + offs_c[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_s < S)[:, None] & mask_c[None, :],
    )


@triton.jit
def _unrotate_bwd_kernel(
    g_ptr, yc_ptr, ys_ptr, d_ptr, tab_ptr, w_ptr, ptr_ptr,
    dyc_ptr, dys_ptr, dd_ptr, dw_ptr,
    E, C, scale_hi, scale_lo,
    L: tl.constexpr, NA: tl.constexpr, NA_PAD: tl.constexpr, C_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr, PACKED: tl.constexpr, HAS_W: tl.constexpr,
    NEED_D: tl.constexpr, NEED_W: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Node n, merged: G[n] is read once per column; each in-edge gets dy, its dP
    (or dD) and dw. Gathers only: nothing is summed across edges."""
    S: tl.constexpr = (L + 1) * (L + 1)
    J: tl.constexpr = (L + 1) * NA
    n = tl.program_id(0).to(tl.int64)
    start, end = _segment(ptr_ptr, n, E)
    offs_c = tl.arange(0, C_PAD)
    offs_m = tl.arange(0, NA_PAD)
    mask_c = offs_c < C
    for k0 in tl.range(start, end, BLOCK_E):
        e, mask_e = _edges(ptr_ptr, ptr_ptr, n, k0, E, BLOCK_E, False)
        m3 = _mask3(mask_e, mask_c, offs_m < NA)
        if HAS_W:
            kw = tl.load(w_ptr + e, mask=mask_e, other=0.0).to(ACC)
        else:
            kw = tl.full([BLOCK_E], 1.0, ACC)
        kw = kw * scale_hi + kw * scale_lo
        dw = tl.zeros([BLOCK_E], ACC)
        for l in tl.static_range(L + 1):
            off = (
                e[:, None, None] * (C * J)
                + offs_c[None, :, None] * J
                + l * NA
                + offs_m[None, None, :]
            )
            if NEED_D or NEED_W:
                y_c = tl.load(yc_ptr + off, mask=m3, other=0.0).to(ACC)
                y_s = tl.load(ys_ptr + off, mask=m3, other=0.0).to(ACC)
            t_c = tl.zeros([BLOCK_E, C_PAD, NA_PAD], ACC)
            t_s = tl.zeros([BLOCK_E, C_PAD, NA_PAD], ACC)
            for i in tl.static_range(2 * l + 1):
                grow = tl.load(g_ptr + n * (S * C) + (l * l + i) * C + offs_c,
                               mask=mask_c, other=0.0).to(ACC)  # fmt: skip
                pc, pmc = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 0,
                                  S, NA, J, PACKED)  # fmt: skip
                ps, pms = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, 1,
                                  S, NA, J, PACKED)  # fmt: skip
                dc = tl.load(pc, mask=pmc, other=0.0).to(ACC)
                ds = tl.load(ps, mask=pms, other=0.0).to(ACC)
                t_c += grow[None, :, None] * dc[:, None, :]
                t_s += grow[None, :, None] * ds[:, None, :]
                if NEED_D:
                    ddc = tl.sum(y_c * grow[None, :, None], axis=1) * kw[:, None]
                    dds = tl.sum(y_s * grow[None, :, None], axis=1) * kw[:, None]
                    qc, qmc = _d_ptrs(dd_ptr, tab_ptr, e, mask_e, offs_m, l * l + i,
                                      l, 0, S, NA, J, PACKED)  # fmt: skip
                    qs, qms = _d_ptrs(dd_ptr, tab_ptr, e, mask_e, offs_m, l * l + i,
                                      l, 1, S, NA, J, PACKED)  # fmt: skip
                    tl.store(qc, ddc.to(dd_ptr.dtype.element_ty), mask=qmc)
                    tl.store(qs, dds.to(dd_ptr.dtype.element_ty), mask=qms)
            if NEED_W:
                dw += tl.sum(tl.sum(y_c * t_c + y_s * t_s, axis=2), axis=1)
            tl.store(dyc_ptr + off, (t_c * kw[:, None, None]).to(
                dyc_ptr.dtype.element_ty), mask=m3)  # fmt: skip
            tl.store(dys_ptr + off, (t_s * kw[:, None, None]).to(
                dys_ptr.dtype.element_ty), mask=m3)  # fmt: skip
        if NEED_W:
            dw = dw * scale_hi + dw * scale_lo
            tl.store(dw_ptr + e, dw.to(dw_ptr.dtype.element_ty), mask=mask_e)


# --------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------
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


@functools.cache
def _tables_cpu(L: int, M: int) -> torch.Tensor:
    """``tab[t, l, m]``: the row of D that the cos (t = 0) or sin (t = 1) slot
    ``(l, m)`` selects, -1 where the slot is empty; int32 ``(2, L+1, n_ang)``."""
    t = lm_tables(L, M)
    S = t.S
    tab = torch.stack([t.cos_index, t.sin_index]).to(torch.int32)
    return torch.where(tab == S, -1, tab).contiguous()


_TABLES: dict = {}


def tables(L: int, M: int, device: torch.device) -> torch.Tensor:
    """:func:`_tables_cpu` on ``device``, copied there once."""
    key = (L, M, str(device))
    tab = _TABLES.get(key)
    if tab is None:
        tab = _TABLES[key] = _tables_cpu(L, M).to(device)
    return tab


@functools.cache
def _pack_index_cpu(L: int, M: int) -> torch.Tensor:
    """``idx[s, t*n_ang + m]``: the row of D behind ``P[e, s, t, m]``, or S (a zero
    row) where the slot is empty or of another degree than s."""
    t = lm_tables(L, M)
    S, NA = t.S, t.n_ang
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
        idx = _TABLES[("pack",) + key] = _pack_index_cpu(L, mmax).to(D.device)
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


def rotate_fwd(h, d, tab, rho, csr, L: int, M: int, packed: bool,
               launch: EdgeFrameLaunch = EdgeFrameLaunch()):  # fmt: skip
    """Launch the rotation, both sides: ``(x_cos, x_sin)``, each ``(E, 2C(L+1),
    n_ang)`` contiguous. ``csr = (ptr_dst, perm_dst or None, ptr_src, perm_src)``."""
    N, S, C = h.shape
    N, C = int(N), int(C)
    E = d.shape[0]
    F, NA = 2 * C * (L + 1), M + 1
    xc = torch.empty((E, F, NA), device=h.device, dtype=h.dtype)
    xs = torch.empty((E, F, NA), device=h.device, dtype=h.dtype)
    if N == 0 or E == 0 or C == 0:
        return xc.zero_(), xs.zero_()
    rho_args = (rho, rho.stride(0), rho.stride(1)) if rho is not None else (h, 0, 0)
    ptr_dst, perm_dst, ptr_src, perm_src = csr
    for side, ptr, perm in ((0, ptr_dst, perm_dst), (1, ptr_src, perm_src)):
        _rotate_fwd_kernel[(N,)](
            h, d, tab, rho_args[0], ptr, perm if perm is not None else ptr, xc, xs,
            E, C, rho_args[1], rho_args[2], **_meta(L, M, C),
            BLOCK_E=launch.rotate_block, SIDE=side, PERM=perm is not None,
            PACKED=packed, HAS_RHO=rho is not None, ACC=_acc(h.dtype),
            num_warps=launch.rotate_warps,
        )  # fmt: skip
    return xc, xs


def rotate_bwd(gc, gs, h, d, tab, rho, csr, L: int, M: int, packed: bool,
               launch: EdgeFrameLaunch = EdgeFrameLaunch()):  # fmt: skip
    """Launch the merged backward, both sides: ``(dh, dd, drho or None)``; dd has
    d's shape (P's, or D's with zeros off the selected entries)."""
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
        _rotate_bwd_kernel[(N,)](
            gc, gs, h, d, tab, rho_args[0], ptr, perm if perm is not None else ptr,
            dh, dd, drho if drho is not None else dh,
            E, C, rho_args[1], rho_args[2], **_meta(L, M, C),
            S_PAD=triton.next_power_of_2(S), BLOCK_E=launch.rotate_bwd_block,
            SIDE=side, PERM=perm is not None, PACKED=packed,
            HAS_RHO=rho is not None, ACC=_acc(h.dtype),
            num_warps=launch.rotate_bwd_warps,
        )  # fmt: skip
    return dh, dd, drho


def unrotate_fwd(yc, ys, d, tab, w, row_ptr, scale: float, L: int, M: int,
                 packed: bool,
                 launch: EdgeFrameLaunch = EdgeFrameLaunch()):  # fmt: skip
    """Launch the unrotation with the aggregation: ``Delta (N, S, C')``, one program
    per destination node; y contiguous, edges dst-sorted."""
    E = yc.shape[0]
    C = int(yc.shape[1]) // (L + 1)
    S = (L + 1) ** 2
    N = row_ptr.shape[0] - 1
    out = torch.empty((N, S, C), device=yc.device, dtype=yc.dtype)
    if N == 0 or C == 0:
        return out.zero_()
    _unrotate_fwd_kernel[(N,)](
        yc, ys, d, tab, w if w is not None else yc, row_ptr, out,
        E, C, *split_scale(scale), **_meta(L, M, C),
        S_PAD=triton.next_power_of_2(S), BLOCK_E=launch.unrotate_block,
        PACKED=packed, HAS_W=w is not None, ACC=_acc(yc.dtype),
        num_warps=launch.unrotate_warps,
    )  # fmt: skip
    return out


def unrotate_bwd(G, yc, ys, d, tab, w, row_ptr, scale: float, L: int, M: int,
                 packed: bool, need_d: bool = True, need_w: bool = True,
                 launch: EdgeFrameLaunch = EdgeFrameLaunch()):  # fmt: skip
    """Launch the merged backward: ``(dy_cos, dy_sin, dd or None, dw or None)``."""
    E = yc.shape[0]
    C = int(yc.shape[1]) // (L + 1)
    N = row_ptr.shape[0] - 1
    need_w = need_w and w is not None
    dyc = torch.zeros_like(yc)
    dys = torch.zeros_like(ys)
    dd = torch.zeros_like(d) if need_d else None
    dw = torch.zeros_like(w) if need_w else None
    if N == 0 or E == 0 or C == 0:
        return dyc, dys, dd, dw
    _unrotate_bwd_kernel[(N,)](
        G, yc, ys, d, tab, w if w is not None else yc, row_ptr,
        dyc, dys, dd if need_d else dyc, dw if need_w else dyc,
        E, C, *split_scale(scale), **_meta(L, M, C),
        BLOCK_E=launch.unrotate_bwd_block, PACKED=packed, HAS_W=w is not None,
        NEED_D=need_d, NEED_W=need_w, ACC=_acc(yc.dtype),
        num_warps=launch.unrotate_bwd_warps,
    )  # fmt: skip
    return dyc, dys, dd, dw


# --------------------------------------------------------------------------------------
# the same in differentiable PyTorch: the second derivatives, and a cross-check
# --------------------------------------------------------------------------------------
def _degree_onehot(L: int, like: torch.Tensor) -> torch.Tensor:
    l_of_s = lm_tables(L).l_of_s.to(like.device)
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
# torch.library ops (opaque to inductor) and autograd
# --------------------------------------------------------------------------------------
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
    def forward(ctx, h, d, rho, tab, src, dst, csr, L, M, packed, launch):
        ctx.save_for_backward(h, d, rho, tab, src, dst, *csr)
        ctx.meta = (L, M, packed, launch, csr[1] is None)
        if torch.compiler.is_compiling():
            return _rotate_op(h, d, tab, rho, *csr, L, M, packed)
        return rotate_fwd(h, d, tab, rho, csr, L, M, packed, launch)

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
            ), *(None,) * 8)  # fmt: skip
        gc, gs = gc.contiguous(), gs.contiguous()
        if torch.compiler.is_compiling():
            dh, dd, drho = _rotate_bwd_op(gc, gs, h, d, tab, rho, *csr, L, M, packed)
        else:
            dh, dd, drho = rotate_bwd(gc, gs, h, d, tab, rho, csr, L, M, packed,
                                      launch)  # fmt: skip
        return dh, dd, drho if rho is not None else None, *(None,) * 8


class _UnrotateFn(torch.autograd.Function):
    """``(y_cos, y_sin, d, w) -> Delta``; edges dst-sorted with ``row_ptr``."""

    @staticmethod
    def forward(ctx, yc, ys, d, w, tab, dst, row_ptr, scale, L, M, packed, launch):
        ctx.save_for_backward(yc, ys, d, w, tab, dst, row_ptr)
        ctx.meta = (scale, L, M, packed, launch)
        if torch.compiler.is_compiling():
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


# --------------------------------------------------------------------------------------
# the per-step frames object and the public functions
# --------------------------------------------------------------------------------------
def why_not(device_type: str, L: int, dtype=torch.float32) -> str | None:
    """Why the kernels cannot serve ``dtype`` tensors on ``device_type`` at degree L,
    or None."""
    reason = why_not_triton(device_type)
    if reason is None and not 1 <= L <= 4:
        reason = f"L = {L} is outside 1..4"
    if reason is None and dtype not in (torch.float32, torch.float64):
        reason = f"{dtype} is not validated (float32 and float64 are)"
    return reason


class Frames:
    """What every edge-frame op of one step shares, built once per step: D (or its
    packed tiles P, with the select folded in), the row tables, and the graph's two
    CSR orders (by destination; by source, a permutation).

    Args:
        D: ``(E, S, S)`` edge Wigner blocks (block-diagonal; differentiable).
        mmax: M.
        src, dst: ``(E,)`` int64.
        n_nodes: N.
        row_ptr: the CSR pointer of ``dst`` when the edges are sorted by destination
            (the model's graph); None builds a permutation (sorted by ``dst``).
        variant: ``"packed"`` or ``"table"``.
        launch: the kernels' :class:`EdgeFrameLaunch`.
        validate: check the index values (host synchronisations): src and dst in
            [0, N), row_ptr the CSR pointer of dst. The model's graph is consistent by
            construction and skips them.

    D must be block-diagonal over degrees (a Wigner matrix): the kernels read its
    blocks only, so a D with entries off the blocks gives another result than the
    reference.
    """

    def __init__(self, D, mmax: int, src, dst, n_nodes: int, row_ptr=None,
                 variant: str = "packed",
                 launch: EdgeFrameLaunch = EdgeFrameLaunch(),
                 validate: bool = True):  # fmt: skip
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        L = _check_graph(D, mmax, src, dst, n_nodes, row_ptr, validate)
        self.L, self.M, self.n_nodes = L, mmax, int(n_nodes)
        self.packed, self.launch = variant == "packed", launch
        self.variant = variant
        self.src, self.dst = src.contiguous(), dst.contiguous()
        self.d = pack(D, mmax) if self.packed else D.contiguous()
        self.tab = tables(L, mmax, D.device)
        nodes = torch.arange(self.n_nodes + 1, device=D.device)
        # clamped: every edge lies in one segment of each side, so every output row
        # is written even for indices that were not validated (wrong, never unset)
        top = max(self.n_nodes - 1, 0)
        if row_ptr is None:
            order = torch.sort(self.dst.clamp(0, top), stable=True)
            perm_dst, ptr_dst = order.indices, torch.searchsorted(order.values, nodes)
            self.row_ptr = None
        else:
            perm_dst, ptr_dst = None, row_ptr.contiguous()
            self.row_ptr = ptr_dst
        order = torch.sort(self.src.clamp(0, top), stable=True)
        self.csr = (ptr_dst, perm_dst, torch.searchsorted(order.values, nodes),
                    order.indices)  # fmt: skip

    def rotate_and_select(self, h, rho=None):
        """``(x_cos, x_sin)`` as :func:`ecekern.reference.rotate_and_select`, each
        feature row ``c*(L+1) + l`` times ``rho[:, c*(L+1) + l]`` when given."""
        _check_h(h, self.n_nodes, self.L)
        reference._same("h", h, D=self.d)
        _check_rho(h, rho, self.d.shape[0], self.L)
        return _RotateFn.apply(
            h.contiguous(), self.d, rho, self.tab, self.src, self.dst, self.csr,
            self.L, self.M, self.packed, self.launch,
        )  # fmt: skip

    def unrotate_and_aggregate(self, y_cos, y_sin, scale: float, edge_weight=None):
        """``Delta[n] = scale sum_{e: dst_e = n} w_e D_e^T pack(y_e)``, ``(N, S, C')``:
        :func:`ecekern.reference.pack_and_unrotate` then ``aggregate``, fused."""
        if self.row_ptr is None:
            raise ValueError("unrotate_and_aggregate needs Frames built with row_ptr")
        _check_y(y_cos, y_sin, self.d, self.L, self.M)
        _check_w(y_cos, edge_weight)
        if edge_weight is not None:
            edge_weight = edge_weight.contiguous()
        return _UnrotateFn.apply(
            y_cos.contiguous(), y_sin.contiguous(), self.d, edge_weight, self.tab,
            self.dst, self.row_ptr, float(scale), self.L, self.M, self.packed,
            self.launch,
        )  # fmt: skip


def _check_graph(D, mmax, src, dst, n_nodes, row_ptr, validate: bool) -> int:
    """D, mmax, src, dst and row_ptr of :class:`Frames`; returns L."""
    reference._float("D", D)
    if D.ndim != 3 or D.shape[1] != D.shape[2]:
        raise ValueError(f"D must have shape (E, S, S), got {tuple(D.shape)}")
    S = D.shape[-1]
    L = math.isqrt(S) - 1
    if (L + 1) ** 2 != S:
        raise ValueError(f"D's S = {S} is not (L+1)^2")
    if isinstance(mmax, bool) or not (isinstance(mmax, int) and 0 <= mmax <= L):
        raise ValueError(f"mmax must be an int in [0, L={L}], got {mmax!r}")
    if isinstance(n_nodes, bool) or not isinstance(n_nodes, (int, torch.SymInt)):
        raise ValueError(f"n_nodes must be an int >= 0, got {n_nodes!r}")
    if n_nodes < 0:
        raise ValueError(f"n_nodes must be an int >= 0, got {n_nodes!r}")
    E = D.shape[0]
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an int64 tensor, got {got}")
        if t.shape != (E,):
            raise ValueError(f"{name} must have shape ({E},), got {tuple(t.shape)}")
        if t.device != D.device:
            raise ValueError(f"{name} is on {t.device}, D on {D.device}")
    values = validate and not torch.compiler.is_compiling()
    if row_ptr is not None:
        n = reference.check_csr(dst, row_ptr, E, D.device, values=values)
        if n != n_nodes:
            raise ValueError(f"row_ptr has {n} nodes, n_nodes is {n_nodes}")
    for name, t in (("src", src), ("dst", dst)):
        if values and E and (bool(t.min() < 0) or bool(t.max() >= n_nodes)):
            raise ValueError(f"{name} has node indices outside [0, N = {n_nodes})")
    return L


def _check_h(h, n_nodes: int, L: int):
    reference._float("h", h)
    if h.ndim != 3 or h.shape[0] != n_nodes or h.shape[1] != (L + 1) ** 2:
        raise ValueError(
            f"h must have shape (N, S, C) = ({n_nodes}, {(L + 1) ** 2}, C), "
            f"got {tuple(h.shape)}"
        )
    return h.shape


def _check_rho(h, rho, E: int, L: int) -> None:
    if rho is None:
        return
    reference._float("rho", rho)
    reference._same("h", h, rho=rho)
    F = 2 * h.shape[2] * (L + 1)
    if rho.shape != (E, F):
        raise ValueError(
            f"rho must have shape (E, 2C(L+1)) = ({E}, {F}), got {tuple(rho.shape)}"
        )


def _check_w(y_cos, w) -> None:
    if w is None:
        return
    reference._float("edge_weight", w)
    reference._same("y_cos", y_cos, edge_weight=w)
    if w.shape != (y_cos.shape[0],):
        raise ValueError(
            f"edge_weight must have shape ({y_cos.shape[0]},), got {tuple(w.shape)}"
        )


def _check_y(y_cos, y_sin, d, L: int, M: int) -> None:
    reference._float("y_cos", y_cos)
    reference._same("y_cos", y_cos, y_sin=y_sin, D=d)
    E = d.shape[0]
    if (
        y_cos.shape != y_sin.shape
        or y_cos.ndim != 3
        or y_cos.shape[0] != E
        or y_cos.shape[1] % (L + 1)
        or y_cos.shape[2] != M + 1
    ):
        raise ValueError(
            f"y_cos and y_sin must both have shape (E, C'(L+1), n_ang) = "
            f"({E}, C'*{L + 1}, {M + 1}), got {tuple(y_cos.shape)} and "
            f"{tuple(y_sin.shape)}"
        )


def _path(like: torch.Tensor, L: int, variant: str | None) -> str:
    """``reference``, ``table`` or ``packed`` for tensors like ``like``: the options'
    choice (or ``variant``), and the reference, loudly, where the kernels cannot
    serve."""
    device_type = like.device.type
    path = options.edge_frame_path(device_type) if variant is None else variant
    if path == "reference" or options.current().reference:
        return "reference"
    reason = why_not(device_type, L, like.dtype)
    if reason is not None:
        options.fallback("edge_frame", reason)
        return "reference"
    return path


def frames_for(D, mmax, src, dst, n_nodes, row_ptr, variant=None) -> Frames | None:
    """The model's per-step :class:`Frames` (its graph is consistent by construction:
    not validated), or None where the reference runs (the options say so, or the
    kernels cannot serve: a one-time warning)."""
    L = math.isqrt(D.shape[-1]) - 1
    path = _path(D, L, variant)
    if path == "reference":
        return None
    return Frames(D, mmax, src, dst, n_nodes, row_ptr, path, validate=False)


def rotate_and_select(h, src, dst, D, mmax: int, rho=None, *, variant=None,
                      validate: bool = True):  # fmt: skip
    """:func:`ecekern.reference.rotate_and_select`, fused, with the radial modulation
    ``rho (E, 2C(L+1))`` folded into the store when given. ``variant`` overrides the
    options' ``edge_frame`` (``"table"``, ``"packed"``, ``"reference"``). D must be
    block-diagonal over degrees (a Wigner matrix; its other entries are not read).
    ``validate=False`` skips the host-synchronising range check of src and dst (an
    index out of range then gives wrong rows, never an out-of-bounds access). The
    same checks and errors on every path."""
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    reference._float("D", D)
    L = _check_graph(D, mmax, src, dst, h.shape[0], None, validate)
    _check_h(h, h.shape[0], L)
    reference._same("h", h, D=D)
    _check_rho(h, rho, D.shape[0], L)
    path = _path(h, L, variant)
    if path == "reference":
        x_cos, x_sin = reference.rotate_and_select(h, src, dst, D, mmax)
        if rho is not None:
            x_cos, x_sin = x_cos * rho[:, :, None], x_sin * rho[:, :, None]
        return x_cos, x_sin
    frames = Frames(D, mmax, src, dst, h.shape[0], None, path, validate=False)
    return frames.rotate_and_select(h, rho)


def unrotate_and_aggregate(y_cos, y_sin, D, mmax: int, dst, row_ptr, scale: float,
                           edge_weight=None, *, variant=None,
                           validate: bool = True):  # fmt: skip
    """``reference.aggregate(reference.pack_and_unrotate(y_cos, y_sin, D, mmax), dst,
    N, scale, edge_weight)``, fused: the ``(E, S, C')`` message is never stored.
    ``dst`` sorted with its CSR pointer ``row_ptr``; D block-diagonal over degrees.
    ``validate=False`` skips the CSR's host-synchronising value checks (the kernels
    clamp every index). The same checks and errors on every path."""
    reference._float("D", D)
    values = validate and not torch.compiler.is_compiling()
    n = reference.check_csr(dst, row_ptr, D.shape[0], D.device, values=values)
    L = _check_graph(D, mmax, dst, dst, n, row_ptr, False)
    _check_y(y_cos, y_sin, D, L, mmax)
    _check_w(y_cos, edge_weight)
    path = _path(D, L, variant)
    if path == "reference":
        msg = reference.pack_and_unrotate(y_cos, y_sin, D, mmax)
        return reference.aggregate(msg, dst, n, scale, edge_weight)
    frames = Frames(D, mmax, dst, dst, n, row_ptr, path, validate=False)
    return frames.unrotate_and_aggregate(y_cos, y_sin, scale, edge_weight)


def pack_and_unrotate(y_cos, y_sin, D, mmax: int, *, variant=None):
    """:func:`ecekern.reference.pack_and_unrotate` by the same kernels: each edge its
    own destination (the per-edge message ``(E, S, C')`` is the output here)."""
    reference._float("D", D)
    E = D.shape[0]
    idx = torch.arange(E, device=D.device)
    row_ptr = torch.arange(E + 1, device=D.device)
    return unrotate_and_aggregate(y_cos, y_sin, D, mmax, idx, row_ptr, 1.0,
                                  variant=variant, validate=False)  # fmt: skip


def traffic(E: int, N: int, L: int, M: int, C: int, elem_size: int,
            packed: bool = True) -> dict:  # fmt: skip
    """The bytes model of the four kernels (C channels of h, C' = C of the message):

    rotation forward: x written ``2 E 2C(L+1) n_ang``, P (or D) read once per side,
    rho read; unrotation forward: y read ``2 E C(L+1) n_ang``, P read, w read, node
    rows written; the backwards: the same tensors once more, plus dP written (the
    rotation's second side reads and writes it again). ``floor_*`` counts each
    tensor once: what a kernel must move."""
    S, NA = (L + 1) ** 2, M + 1
    x = 2 * E * 2 * C * (L + 1) * NA
    y = 2 * E * C * (L + 1) * NA
    p = E * S * 2 * NA if packed else E * S * S
    rho, node = E * 2 * C * (L + 1), N * S * C
    b = elem_size
    return {
        "rotate_fwd": b * (x + 2 * p + rho + 2 * node) + 8 * 2 * (N + 1 + E),
        "floor_rotate_fwd": b * (x + p + rho + node),
        "rotate_bwd": b * (x + 5 * p + 2 * rho + 4 * node) + 8 * 2 * (N + 1 + E),
        "floor_rotate_bwd": b * (x + 2 * p + 2 * rho + 2 * node),
        "unrotate_fwd": b * (y + p + E + node) + 8 * (N + 1),
        "floor_unrotate_fwd": b * (y + p + E + node),
        "unrotate_bwd": b * (2 * y + 2 * p + 2 * E + node) + 8 * (N + 1),
        "floor_unrotate_bwd": b * (2 * y + 2 * p + 2 * E + node),
        "message_bytes": b * E * S * C,
    }
