"""The fused stack's forward kernel, and the gated layers that the recomputing
backward (:mod:`.backward_kernel`) runs again: one kernel per tile of edges,
the tile on chip, on the tensor cores (Gluon, Hopper ``wgmma``) or, in strict fp32,
on the FMA units.

Formula (:mod:`ecekern.stack_fused`; per edge e, order m, cos and sin alike)::

    u_0 = x;  z_k = W_k[m] u_(k-1) (+ b_k at m = 0, cos);  u_k = u_(k-1) + gate(z_k)
    y = W_out[m] u_K (+ b_out at m = 0, cos)

A program owns a tile of 32 edges at a time: 64 rows per order, the 32 cos rows over
the 32 sin rows, one ``wgmma`` row block. Its state u, ``3 x 64 x F`` fp32 (147 KB
at F = 192), stays in shared memory through every layer; the weights stream through
a ring of ``[64, BK]`` boxes by TMA, from L2 (every program reads all of them, once
a tile), three K steps in flight (:mod:`.ring`). For each
layer and order the tile's rows meet the box of each 64 outputs, BK inputs at a
time: on the tensor cores from registers (the A operand), two warpgroups each taking
half of every box's outputs; on the FMA units from shared memory, four inputs at a
time, four warps each taking half the rows. The epilogue applies bias, gate and
residual and writes the order's new state back in place (the orders are
block-diagonal: nothing else reads it), and z to global memory. The gate's
``s = sigmoid(p)`` of an edge's m >= 1 rows comes from the m = 0 cos row of z,
which the same program wrote an order before. Without a z to keep (``SLAB``) the
forward writes only y: p goes through the program's own rows of a slab (32 edges,
reused tile after tile, so it stays in L2). x and y stream through L2
(``evict_first``); the slab stays (``evict_last``).

Shapes: planes ``x (n_ang, 2, n, F)``, ``y (n_ang, 2, n, F')`` (order, cos/sin,
edge, feature), rows contiguous, a plane's sin part and rows within 2**31 values;
``z (K, n_ang, 2, n, F)`` a cohort's rows of a contiguous z, or the slab
``(programs, K n_ang 2 32 F)``.

Bytes (DRAM), in activations of ``2 n F n_ang`` values: reads x, writes y and z
(five of the six planes of each z_k), ``1 + F'/F + 5 K / 6``: 3.2 at K = 2,
F' = F/2 (2.9 with ``sin0``); y only, ``1 + F'/F``: 1.5 (1.25). L2: all the weights,
once a tile. FLOPs: ``4 n_ang (K F^2 + F' F) n``, the m = 0 sin rows included;
three times that on the tensor cores in 3xTF32.

Status: launched by ``ecekern.stack_fused.launch.forward`` (n_ang = 3, F = 192,
F' = 96, sm_90); its gated layers also run in the recomputing backward kernel.
"""

from __future__ import annotations

from .._triton import gl, gluon
from .ring import (
    F_K,
    FO_K,
    TILE_K,
    _acc_layout,
    _chunk,
    _fold,
    _jit,
    _kstep,
    _load_w,
    _operand,
    _operand_layout,
    _retire,
    _ring,
)

__all__ = ["WARPS"]

#: Warps a program, two warpgroups, each half of every product's outputs (on the FMA
#: units four warps each half the rows).
WARPS = 8


def _swizzle(bk: int):
    """Shared layout of a ``[64, bk]`` fp32 box read as an A operand."""
    return gl.SwizzledSharedLayout(4, 32 // bk, 8 * bk // 32, [1, 0])


BOX = gl.constexpr(_swizzle(32)) if gluon is not None else None
BOX16 = gl.constexpr(_swizzle(16)) if gluon is not None else None


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@_jit
def _sigmoid(p):
    return 1.0 / (1.0 + gl.exp(-p))


@_jit
def _rows(e0, E, layout: gl.constexpr):
    """Row r of a tile: part ``r // 32`` (0 cos, 1 sin) of edge ``e0 + r % 32``."""
    r = gl.arange(0, 2 * TILE_K, layout=layout)
    edge = e0 + r % TILE_K
    return r // TILE_K, edge, edge < E


@_jit
def _fwd_epilogue(acc, j: gl.constexpr, k: gl.constexpr, m, u_s,
                  b_ptr, z_ptr, sz, ze0, e0, E, HAS_B: gl.constexpr,
                  ZALL: gl.constexpr, ZEV: gl.constexpr, F: gl.constexpr,
                  acc_l: gl.constexpr):  # fmt: skip
    """Outputs ``64 j ..`` of order m of gated layer k: ``u += gate(z)``; z's m = 0
    cos row p out (the other orders' gates read it), and with ZALL the m >= 1 rows
    too. z's rows are edges less ``ze0``; ZEV: z's L2 eviction policy."""
    part, edge, ok = _rows(e0, E, gl.SliceLayout(1, acc_l))
    col = 64 * j + gl.arange(0, 64, layout=gl.SliceLayout(0, acc_l))
    part, edge, ok = part[:, None], edge[:, None], ok[:, None]
    EF = sz.to(gl.int64)  # a plane of z
    at = (edge - ze0) * F + col[None, :]  # int32 within a plane (the launcher checks)
    if m == 0:
        if HAS_B:
            acc = acc + gl.where(part == 0, gl.load(b_ptr + k * F + col)[None, :], 0.0)
        s = _sigmoid(acc)
        g = gl.where(part == 0, acc * s, acc)  # SiLU on p; the m = 0 sin passes
        gl.store(
            z_ptr + k * 6 * EF + at, acc, mask=ok & (part == 0), eviction_policy=ZEV
        )
    else:
        p = gl.load(z_ptr + k * 6 * EF + at, mask=ok, other=0.0, eviction_policy=ZEV)
        g = acc * _sigmoid(p)
        if ZALL:
            at = at + part * sz  # the sin plane follows the cos plane
            gl.store(
                z_ptr + (k * 3 + m) * 2 * EF + at, acc, mask=ok, eviction_policy=ZEV
            )
    box = u_s.index(m * 3 + j)
    box.store(box.load(acc_l) + g)


@_jit
def _out_epilogue(acc, j: gl.constexpr, m, bo_ptr, y_ptr, sy_m, sy_c,
                  e0, E, HAS_BO: gl.constexpr, SIN0: gl.constexpr, FO: gl.constexpr,
                  acc_l: gl.constexpr):  # fmt: skip
    """Outputs ``64 j ..`` (those below F') of order m of the output layer."""
    part, edge, ok = _rows(e0, E, gl.SliceLayout(1, acc_l))
    col = 64 * j + gl.arange(0, 64, layout=gl.SliceLayout(0, acc_l))
    part, edge, ok = part[:, None], edge[:, None], ok[:, None]
    if HAS_BO:
        bias = gl.load(bo_ptr + col, mask=col < FO, other=0.0)
        acc = acc + gl.where((part == 0) & (m == 0), bias[None, :], 0.0)
    if SIN0:
        ok = ok & ((part == 0) | (m != 0))
    ptr = y_ptr + m * sy_m.to(gl.int64) + (part * sy_c + edge * FO + col[None, :])
    gl.store(ptr, acc, mask=ok & (col < FO)[None, :], eviction_policy="evict_first")


@_jit
def _load_x(u_s, x_ptr, sx_m, sx_c, e0, E, SIN0: gl.constexpr, F: gl.constexpr,
            ld_l: gl.constexpr):  # fmt: skip
    """The tile's x into u (the m = 0 sin rows zero with SIN0)."""
    part, edge, ok = _rows(e0, E, gl.SliceLayout(1, ld_l))
    part, edge, ok = part[:, None], edge[:, None], ok[:, None]
    col = gl.arange(0, 64, layout=gl.SliceLayout(0, ld_l))[None, :]
    for m in range(3):  # a loop, not unrolled: three loads in flight
        okm = ok & ((part == 0) | (m != 0) | (not SIN0))
        src = x_ptr + m * sx_m.to(gl.int64) + (part * sx_c + edge * F + col)
        for jb in gl.static_range(3):
            xv = gl.load(
                src + 64 * jb, mask=okm, other=0.0, eviction_policy="evict_first"
            )
            u_s.index(m * 3 + jb).store(xv)


@_jit
def _fwd_product(u_s, m, cb, g0, zero, R, W, more, SEQ: gl.constexpr,
                 NBOX: gl.constexpr, P: gl.constexpr, a_l: gl.constexpr,
                 b_l: gl.constexpr):  # fmt: skip
    """The tile's rows of order m (u, shared) times a matrix's NBOX boxes of 64
    outputs: the ring sequence's chunks ``cb ..`` (the tile's first at count g0;
    the sequence ``SEQ``, the weights ``W`` and the ring ``R`` as
    :func:`.ring._load_w` has them; ``P = (X3, FMA, BK, STG)``, the products). The
    accumulators, every product done; the forward's strict fp32 sums from zero in
    one chunk."""
    # [book: fused-product]
    X3, FMA, BK, STG = P
    KS: gl.constexpr = 64 // BK  # K steps a box of u
    a0, a1, a2 = zero, zero, zero
    hi = gl.zeros([64, BK], W[0].dtype, layout=a_l)
    lo = hi
    for jb in range(3):  # a box of u: 64 inputs, KS K steps
        c0, c1, c2 = _chunk(a0, a1, a2, zero, X3, False)
        for kh in gl.static_range(KS):
            c = cb + KS * jb + kh
            a = _operand(u_s.index(m * 3 + jb).slice(BK * kh, BK, dim=1), a_l, FMA)
            c0, c1, c2, hi, lo = _kstep(a, hi, lo, c, g0 + c, c0, c1, c2, R, more, W,
                                        NBOX, SEQ, X3, FMA, BK, STG, a_l,
                                        b_l)  # fmt: skip
        a0, a1, a2 = _fold(a0, a1, a2, c0, c1, c2, hi, lo, NBOX, X3, False)
    return _retire(a0, a1, a2, hi, lo, NBOX, X3, 0, FMA)
    # [/book: fused-product]


@_jit
def _gated_layer(k: gl.constexpr, u_s, g0, zero, R, W, more, b_ptr, Z, e0, E,
                 HAS_B: gl.constexpr, ZALL: gl.constexpr, ZEV: gl.constexpr,
                 SEQ: gl.constexpr, P: gl.constexpr, acc_l: gl.constexpr,
                 a_l: gl.constexpr, b_l: gl.constexpr):  # fmt: skip
    """Gated layer k on the tile, an order at a time, m = 0 first (its p gates the
    others): u updated in place, z out (:func:`_fwd_epilogue`; ``Z = (z_ptr, sz,
    ze0)``). Its W are the ring sequence's matrices ``3 k ..`` (``R``, ``W``,
    ``SEQ``, ``P`` as :func:`_fwd_product` has them)."""
    z_ptr, sz, ze0 = Z
    KA: gl.constexpr = SEQ[2]
    for m in range(3):
        a0, a1, a2 = _fwd_product(u_s, m, (k * 3 + m) * KA, g0, zero, R, W, more,
                                  SEQ, 3, P, a_l, b_l)  # fmt: skip
        _fwd_epilogue(a0, 0, k, m, u_s, b_ptr, z_ptr, sz, ze0, e0, E, HAS_B, ZALL,
                      ZEV, F_K, acc_l)  # fmt: skip
        _fwd_epilogue(a1, 1, k, m, u_s, b_ptr, z_ptr, sz, ze0, e0, E, HAS_B, ZALL,
                      ZEV, F_K, acc_l)  # fmt: skip
        _fwd_epilogue(a2, 2, k, m, u_s, b_ptr, z_ptr, sz, ze0, e0, E, HAS_B, ZALL,
                      ZEV, F_K, acc_l)  # fmt: skip
        gl.thread_barrier()


@_jit(do_not_specialize=["E", "n_tiles"])
def _fused_fwd_kernel(
    x_ptr, sx_m, sx_c, w_desc, wo_desc, wl_desc, wol_desc, b_ptr, bo_ptr, z_ptr, sz,
    y_ptr, sy_m, sy_c, E, n_tiles,
    K: gl.constexpr, HAS_B: gl.constexpr, HAS_BO: gl.constexpr, SIN0: gl.constexpr,
    X3: gl.constexpr, FMA: gl.constexpr, BK: gl.constexpr, STG: gl.constexpr,
    SLAB: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    F: gl.constexpr = F_K
    FO: gl.constexpr = FO_K
    KA: gl.constexpr = F // BK  # K steps a matrix
    NA: gl.constexpr = K * 3 * KA  # the gated layers' W chunks, [F, BK] each
    NCH: gl.constexpr = NA + 3 * KA  # and W_out's, [128, BK] (F' rows and past)
    # the weights' sequence (ring._load_w): W, then W_out in two boxes, F' rows each
    seq: gl.constexpr = (NCH, NA, KA, 3 * KA, KA, 2, FO)
    prod: gl.constexpr = (X3, FMA, BK, STG)
    w = (w_desc, wo_desc, wl_desc, wol_desc)
    BF16: gl.constexpr = w_desc.dtype == gl.bfloat16
    acc_l: gl.constexpr = _acc_layout(FMA, BF16, num_warps)
    a_l: gl.constexpr = _operand_layout(acc_l, 0, FMA, BF16)
    b_l: gl.constexpr = _operand_layout(acc_l, 1, FMA, BF16)
    ld_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    # x, y stream through L2; a program's slab of z stays there, a kept z need not
    ZEV: gl.constexpr = "evict_last" if SLAB else "evict_first"
    u_s = gl.allocate_shared_memory(gl.float32, [9, 64, 64], BOX)
    rr = _ring(w_desc, X3, STG, BK)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    if SLAB:  # p through the program's own rows of z, a tile at a time
        z_ptr = z_ptr + pid * (K * 6 * TILE_K * F)
    for cp in gl.static_range(STG - 1):
        _load_w(cp, seq, w, rr, cp, STG, BK, X3)
    zero = gl.zeros([64, 64], gl.float32, layout=acc_l)
    for it in range(n_mine):
        e0 = (pid + it * nprog) * TILE_K
        more = it + 1 < n_mine
        ze0 = e0 if SLAB else 0
        _load_x(u_s, x_ptr, sx_m, sx_c, e0, E, SIN0, F, ld_l)
        gl.thread_barrier()
        g0 = it * NCH
        for k in gl.static_range(K):
            _gated_layer(k, u_s, g0, zero, rr, w, more, b_ptr, (z_ptr, sz, ze0), e0,
                         E, HAS_B, not SLAB, ZEV, seq, prod, acc_l, a_l,
                         b_l)  # fmt: skip
        for m in range(3):  # the output layer
            a0, a1, a2 = _fwd_product(u_s, m, NA + m * KA, g0, zero, rr, w, more, seq,
                                      2, prod, a_l, b_l)  # fmt: skip
            _out_epilogue(a0, 0, m, bo_ptr, y_ptr, sy_m, sy_c, e0, E, HAS_BO, SIN0, FO,
                          acc_l)  # fmt: skip
            _out_epilogue(a1, 1, m, bo_ptr, y_ptr, sy_m, sy_c, e0, E, HAS_BO, SIN0, FO,
                          acc_l)  # fmt: skip
        gl.thread_barrier()  # u is the next tile's
