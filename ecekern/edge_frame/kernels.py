"""The edge-frame kernels (chapter 3): rotation, unrotation and their merged
backwards, one Triton program per node and side. Formulas and shapes: the package
docstring, :mod:`ecekern.edge_frame`.

Every kernel reads D through :func:`_d_ptrs`: the packed tile ``P[e, s, t, :]`` as a
contiguous row of n_ang values, or D's rows ``row_t(l, m)`` in column s through the
table, one element per load. Degrees are unrolled with ``tl.static_range``: the slots
of degree l read the 2l+1 columns of degree l only.
"""

from __future__ import annotations

from .._triton import tl, triton


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
def _row_offsets(e, f0, offs_m, l: tl.constexpr, L: tl.constexpr, s_e, s_f, s_m):
    """Offsets ``[BLOCK_E, C_PAD, NA_PAD]`` of the rows' elements ``(e, f0 (L+1) +
    l, m)`` for element strides ``(s_e, s_f, s_m)``: the ``(E, F, n_ang)`` rows
    ``(F n_ang, n_ang, 1)``, or views of ``(n_ang, 2, E, F)`` planes ``(F, 1,
    2 E F)``, the layout chapter 6's layer kernels read (int64: a plane's stride
    passes 2^31 at a few million edges)."""
    f = (f0 * (L + 1) + l).to(tl.int64)
    return (e[:, None, None] * s_e + f[None, :, None] * s_f
            + offs_m.to(tl.int64)[None, None, :] * s_m)  # fmt: skip


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
def _d_pair(d_ptr, tab_ptr, e, mask_e, offs_m, s: tl.constexpr, l: tl.constexpr,
            S: tl.constexpr, NA: tl.constexpr, J: tl.constexpr,
            PACKED: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``(P[e, s, 0, :], P[e, s, 1, :])``, the cos and sin rows of column s, loaded
    in ``ACC``: ``[BLOCK_E, NA_PAD]`` each."""
    p, pm = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, s, l, 0, S, NA, J, PACKED)
    dc = tl.load(p, mask=pm, other=0.0).to(ACC)
    p, pm = _d_ptrs(d_ptr, tab_ptr, e, mask_e, offs_m, s, l, 1, S, NA, J, PACKED)
    return dc, tl.load(p, mask=pm, other=0.0).to(ACC)


@triton.jit
def _rotate_fwd_kernel(
    h_ptr, d_ptr, tab_ptr, rho_ptr, ptr_ptr, perm_ptr, xc_ptr, xs_ptr,
    E, C, stride_rho_e, stride_rho_f, sx_e, sx_f, sx_m,
    L: tl.constexpr, NA: tl.constexpr, NA_PAD: tl.constexpr, C_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr, SIDE: tl.constexpr, PERM: tl.constexpr,
    PACKED: tl.constexpr, HAS_RHO: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Node n, one side: ``x_t[e, SIDE*C + c, l, m]`` for the edges that read h[n]
    on this side, degree by degree (only the 2l+1 columns of degree l feed its
    slots); x_t's element ``(e, f, m)`` at ``e sx_e + f sx_f + m sx_m``."""
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
                dc, ds = _d_pair(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, S,
                                 NA, J, PACKED, ACC)  # fmt: skip
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
            off = _row_offsets(e, rows, offs_m, l, L, sx_e, sx_f, sx_m)
            tl.store(xc_ptr + off, acc_c.to(xc_ptr.dtype.element_ty), mask=m3)
            tl.store(xs_ptr + off, acc_s.to(xs_ptr.dtype.element_ty), mask=m3)


@triton.jit
def _rotate_bwd_kernel(
    gc_ptr, gs_ptr, h_ptr, d_ptr, tab_ptr, rho_ptr, ptr_ptr, perm_ptr,
    dh_ptr, dd_ptr, drho_ptr,
    E, C, stride_rho_e, stride_rho_f, sg_e, sg_f, sg_m,
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
            off = _row_offsets(e, rows, offs_m, l, L, sg_e, sg_f, sg_m)
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
                dc, ds = _d_pair(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, S,
                                 NA, J, PACKED, ACC)  # fmt: skip
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
    E, C, scale_hi, scale_lo, sy_e, sy_f, sy_m,
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
            off = _row_offsets(e, offs_c, offs_m, l, L, sy_e, sy_f, sy_m)
            y_c = tl.load(yc_ptr + off, mask=m3, other=0.0).to(ACC)
            y_s = tl.load(ys_ptr + off, mask=m3, other=0.0).to(ACC)
            if HAS_W:
                y_c = y_c * w[:, None, None]
                y_s = y_s * w[:, None, None]
            for i in tl.static_range(2 * l + 1):
                dc, ds = _d_pair(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, S,
                                 NA, J, PACKED, ACC)  # fmt: skip
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
    E, C, scale_hi, scale_lo, sy_e, sy_f, sy_m,
    L: tl.constexpr, NA: tl.constexpr, NA_PAD: tl.constexpr, C_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr, PACKED: tl.constexpr, HAS_W: tl.constexpr,
    NEED_D: tl.constexpr, NEED_W: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Node n, merged: G[n] is read once per column; each in-edge gets dy, its dP
    (or dD) and dw. Gathers only: nothing is summed across edges. y and dy share
    their element strides."""
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
            off = _row_offsets(e, offs_c, offs_m, l, L, sy_e, sy_f, sy_m)
            if NEED_D or NEED_W:
                y_c = tl.load(yc_ptr + off, mask=m3, other=0.0).to(ACC)
                y_s = tl.load(ys_ptr + off, mask=m3, other=0.0).to(ACC)
            t_c = tl.zeros([BLOCK_E, C_PAD, NA_PAD], ACC)
            t_s = tl.zeros([BLOCK_E, C_PAD, NA_PAD], ACC)
            for i in tl.static_range(2 * l + 1):
                grow = tl.load(g_ptr + n * (S * C) + (l * l + i) * C + offs_c,
                               mask=mask_c, other=0.0).to(ACC)  # fmt: skip
                dc, ds = _d_pair(d_ptr, tab_ptr, e, mask_e, offs_m, l * l + i, l, S,
                                 NA, J, PACKED, ACC)  # fmt: skip
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
