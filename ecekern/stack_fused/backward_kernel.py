"""The fused stack's backward kernel: the force step's backward of the whole mixing
stack in one kernel per tile of edges, the tile on chip, from a kept z or making
each tile's z again (the recomputing backward) (:mod:`ecekern.stack_fused` runs it).

Formula (per edge e, order m, cos and sin alike)::

    du_K = W_out[m]^T dy;  dz_k = gate'(z_k) du_k;  du_(k-1) = du_k + W_k[m]^T dz_k
    dx = du_0

A program holds du as the forward holds u (:mod:`.forward_kernel`): ``W_out^T dy``
first, then for each gated layer the orders, m = 0 first (its ``dz`` needs ``t =
sum_(m>=1) du_m z_m`` of rows not yet overwritten); ``dz`` is made BK inputs at a time
from du, the kept z and p (loaded a K step ahead), cos and sin rows of an edge side by
side, and handed to the products through a ``[64, BK]`` buffer. The accumulators start
at du: the residual. In 3xTF32 and strict fp32 each chunk of inputs (64; 32 of dy in the
first stage) is summed from zero and added to them in fp32, so that the roundings of a
long sum are relative to the chunk's sum, not to du's. ``RECOMP`` (from x instead of a
kept z) first runs each tile's gated layers again, as the forward does, into its
program's slab of z, then the tile's backward from there: it writes only dx. The
weights' sequence then has three parts: W, W_out^T, W^T.

Shapes, bytes and FLOPs: :mod:`ecekern.stack_fused`.

Status: launched by ``ecekern.stack_fused.launch.backward`` (n_ang = 3, F = 192,
F' = 96, sm_90); compiled for sm_90 without a GPU in the tests.
"""

from __future__ import annotations

from .._triton import gl
from .forward_kernel import BOX, BOX16, _gated_layer, _load_x, _rows, _sigmoid
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

__all__: list[str] = []


# --------------------------------------------------------------------------------------
# the kernel and its helpers
# --------------------------------------------------------------------------------------
@_jit
def _half(e0, E, c0, BK: gl.constexpr, t_l: gl.constexpr):
    """Edge offsets, mask and input columns ``c0 ..`` of a ``[32, BK]`` half of a K
    step."""
    r = gl.arange(0, TILE_K, layout=gl.SliceLayout(1, t_l))
    col = c0 + gl.arange(0, BK, layout=gl.SliceLayout(0, t_l))[None, :]
    return (e0 + r)[:, None], (e0 + r < E)[:, None], col


@_jit
def _to_a(a_s, lo, hi, BK: gl.constexpr, a_l: gl.constexpr, FMA: gl.constexpr):
    """The cos half ``lo`` over the sin half ``hi`` through ``a_s``: the A operand
    (:func:`_operand`)."""
    gl.thread_barrier()  # the last K step's operand is read
    a_s.store(gl.join(lo, hi).permute((2, 0, 1)).reshape([64, BK]))
    gl.thread_barrier()
    return _operand(a_s, a_l, FMA)


@_jit
def _dy(a_s, dy_ptr, sd_m, sd_c, m, c0, e0, E,
        SIN0: gl.constexpr, FO: gl.constexpr, BK: gl.constexpr, a_l: gl.constexpr,
        t_l: gl.constexpr, FMA: gl.constexpr):  # fmt: skip
    """Outputs ``c0 ..`` of dy of order m as an A operand."""
    edge, ok, col = _half(e0, E, c0, BK, t_l)
    src = dy_ptr + m * sd_m.to(gl.int64) + edge * FO + col
    lo = gl.load(src, mask=ok, other=0.0, eviction_policy="evict_first")
    if SIN0:
        hi = gl.load(
            src + sd_c, mask=ok & (m != 0), other=0.0, eviction_policy="evict_first"
        )
    else:
        hi = gl.load(src + sd_c, mask=ok, other=0.0, eviction_policy="evict_first")
    return _to_a(a_s, lo, hi, BK, a_l, FMA)


@_jit
def _zp(z_ptr, sz, ze0, k: gl.constexpr, m, c0, e0, E, ZEV: gl.constexpr,
        F: gl.constexpr, BK: gl.constexpr, t_l: gl.constexpr):  # fmt: skip
    """What ``dz_k`` of order m needs from z (its rows edges less ``ze0``) for
    inputs ``c0 ..`` (``[32, BK]`` each): p, and at m = 0 the z of the m = 1, 2
    rows, cos and sin (masked off, no traffic, at m > 0 and past F). Loaded a K
    step ahead."""
    edge, ok, col = _half(e0, E, c0, BK, t_l)
    ok = ok & (col < F)
    EF = sz.to(gl.int64)  # a plane of z
    at = (edge - ze0) * F + col
    p = gl.load(z_ptr + k * 6 * EF + at, mask=ok, other=0.0, eviction_policy=ZEV)
    zm = ok & (m == 0)
    z1 = z_ptr + (k * 3 + 1) * 2 * EF + at
    z2 = z_ptr + (k * 3 + 2) * 2 * EF + at
    z1c = gl.load(z1, mask=zm, other=0.0, eviction_policy=ZEV)
    z1s = gl.load(z1 + EF, mask=zm, other=0.0, eviction_policy=ZEV)
    z2c = gl.load(z2, mask=zm, other=0.0, eviction_policy=ZEV)
    z2s = gl.load(z2 + EF, mask=zm, other=0.0, eviction_policy=ZEV)
    return p, z1c, z1s, z2c, z2s


@_jit
def _dz(u_s, a_s, p, z1c, z1s, z2c, z2s, m, jb, kh: gl.constexpr,
        BK: gl.constexpr, a_l: gl.constexpr, t_l: gl.constexpr,
        FMA: gl.constexpr):  # fmt: skip
    """Inputs ``64 jb + BK kh ..`` of ``dz_k`` of order m as an A operand, from du
    (shared) and what :func:`_zp` loaded: cos and sin rows of an edge side by side,
    as the m = 0 cos row's ``t = sum_(m>=1) du_m z_m`` over both wants."""
    s = _sigmoid(p)
    box = u_s.index(m * 3 + jb).slice(BK * kh, BK, dim=1)
    du_c = box.slice(0, TILE_K, dim=0).load(t_l)
    du_s = box.slice(TILE_K, TILE_K, dim=0).load(t_l)
    if m == 0:
        b1 = u_s.index(3 + jb).slice(BK * kh, BK, dim=1)
        b2 = u_s.index(6 + jb).slice(BK * kh, BK, dim=1)
        t = b1.slice(0, TILE_K, dim=0).load(t_l) * z1c
        t += b1.slice(TILE_K, TILE_K, dim=0).load(t_l) * z1s
        t += b2.slice(0, TILE_K, dim=0).load(t_l) * z2c
        t += b2.slice(TILE_K, TILE_K, dim=0).load(t_l) * z2s
        ds = s * (1.0 - s)
        lo = du_c * (s + p * ds) + t * ds
        hi = du_s  # the m = 0 sin passes
    else:
        lo = du_c * s
        hi = du_s * s
    return _to_a(a_s, lo, hi, BK, a_l, FMA)


@_jit
def _bwd_epilogue(acc, j: gl.constexpr, m, LAST: gl.constexpr, u_s,
                  dx_ptr, sx_m, sx_c, e0, E, SIN0: gl.constexpr, F: gl.constexpr,
                  acc_l: gl.constexpr):  # fmt: skip
    """Outputs ``64 j ..`` of order m: du into u_s, or dx with LAST."""
    if LAST:
        part, edge, ok = _rows(e0, E, gl.SliceLayout(1, acc_l))
        col = 64 * j + gl.arange(0, 64, layout=gl.SliceLayout(0, acc_l))
        part, edge, ok = part[:, None], edge[:, None], ok[:, None]
        if SIN0:
            ok = ok & ((part == 0) | (m != 0))
        ptr = dx_ptr + m * sx_m.to(gl.int64) + (part * sx_c + edge * F + col[None, :])
        gl.store(ptr, acc, mask=ok, eviction_policy="evict_first")
    else:
        u_s.index(m * 3 + j).store(acc)


@_jit(do_not_specialize=["E", "n_tiles"])
def _fused_bwd_kernel(
    dy_ptr, sd_m, sd_c, wt_desc, wot_desc, wtl_desc, wotl_desc, z_ptr, sz, dx_ptr,
    sx_m, sx_c, x_ptr, si_m, si_c, b_ptr, E, n_tiles,
    K: gl.constexpr, SIN0: gl.constexpr, X3: gl.constexpr, FMA: gl.constexpr,
    BK: gl.constexpr, STG: gl.constexpr, RECOMP: gl.constexpr, HAS_B: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    F: gl.constexpr = F_K
    FO: gl.constexpr = FO_K
    KS: gl.constexpr = 64 // BK  # K steps a box of du
    KH: gl.constexpr = FO // 3 // BK  # K steps of a third of dy's outputs (32)
    KO: gl.constexpr = FO // BK  # K steps of W_out^T, [F, BK] each
    NO: gl.constexpr = 3 * KO
    KA: gl.constexpr = F // BK  # K steps of a gated layer's W or W^T
    # the sequence: with RECOMP the gated layers' W first (NA chunks), then W_out^T,
    # then the gated layers' W^T, last layer first
    NA: gl.constexpr = K * 3 * KA if RECOMP else 0
    NCH: gl.constexpr = NA + NO + K * 3 * KA
    BF16: gl.constexpr = wt_desc.dtype == gl.bfloat16
    acc_l: gl.constexpr = _acc_layout(FMA, BF16, num_warps)
    a_l: gl.constexpr = _operand_layout(acc_l, 0, FMA, BF16)
    b_l: gl.constexpr = _operand_layout(acc_l, 1, FMA, BF16)
    t_l: gl.constexpr = gl.BlockedLayout([1, BK // 8], [4, 8], [num_warps, 1], [1, 0])
    ld_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    ZEV: gl.constexpr = "evict_last" if RECOMP else "evict_first"
    u_s = gl.allocate_shared_memory(gl.float32, [9, 64, 64], BOX)
    if BK == 32:
        a_s = gl.allocate_shared_memory(gl.float32, [64, BK], BOX)
    else:
        a_s = gl.allocate_shared_memory(gl.float32, [64, BK], BOX16)
    rr = _ring(wt_desc, X3, STG, BK)
    # the weights' sequence (ring._load_w): (W,) W_out^T in three boxes, F rows each,
    # then W^T
    seq: gl.constexpr = (NCH, NA, KA, NO, KO, 3, F)
    prod: gl.constexpr = (X3, FMA, BK, STG)
    w = (wt_desc, wot_desc, wtl_desc, wotl_desc)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    if RECOMP:  # z of a tile in the program's own rows, 32 edges
        z_ptr = z_ptr + pid * (K * 6 * TILE_K * F)
    for cp in gl.static_range(STG - 1):
        _load_w(cp, seq, w, rr, cp, STG, BK, X3)
    zero = gl.zeros([64, 64], gl.float32, layout=acc_l)
    gl.thread_barrier()
    for it in range(n_mine):
        e0 = (pid + it * nprog) * TILE_K
        more = it + 1 < n_mine
        g0 = it * NCH
        if RECOMP:  # 0. the gated layers again, from x: z of the tile
            ze0 = e0
            _load_x(u_s, x_ptr, si_m, si_c, e0, E, SIN0, F, ld_l)
            gl.thread_barrier()
            for k in gl.static_range(K):
                _gated_layer(k, u_s, g0, zero, rr, w, more, b_ptr, (z_ptr, sz, ze0),
                             e0, E, HAS_B, True, ZEV, seq, prod, acc_l, a_l,
                             b_l)  # fmt: skip
        else:
            ze0 = 0
        # 1. du_K = W_out^T dy, an order at a time
        for m in range(3):
            a0, a1, a2 = zero, zero, zero
            hi = gl.zeros([64, BK], wt_desc.dtype, layout=a_l)
            lo = hi
            for kc in range(3):  # a third of dy's outputs, KH K steps
                c0, c1, c2 = _chunk(a0, a1, a2, zero, X3, FMA)
                for kh in gl.static_range(KH):
                    c = NA + m * KO + KH * kc + kh
                    a = _dy(a_s, dy_ptr, sd_m, sd_c, m, BK * (KH * kc + kh), e0, E,
                            SIN0, FO, BK, a_l, t_l, FMA)  # fmt: skip
                    c0, c1, c2, hi, lo = _kstep(a, hi, lo, c, g0 + c, c0, c1, c2, rr,
                                                more, w, 3, seq, X3, FMA, BK, STG, a_l,
                                                b_l)  # fmt: skip
                a0, a1, a2 = _fold(a0, a1, a2, c0, c1, c2, hi, lo, 3, X3, FMA)
            a0, a1, a2 = _retire(a0, a1, a2, hi, lo, 3, X3, 0, FMA)
            _bwd_epilogue(a0, 0, m, False, u_s, dx_ptr, sx_m, sx_c, e0, E, SIN0, F,
                          acc_l)  # fmt: skip
            _bwd_epilogue(a1, 1, m, False, u_s, dx_ptr, sx_m, sx_c, e0, E, SIN0, F,
                          acc_l)  # fmt: skip
            _bwd_epilogue(a2, 2, m, False, u_s, dx_ptr, sx_m, sx_c, e0, E, SIN0, F,
                          acc_l)  # fmt: skip
        gl.thread_barrier()
        # 2. the gated layers, last first; in each, m = 0 first
        for kk in gl.static_range(K):
            k = K - 1 - kk
            for m in range(3):
                # the accumulators start at du_k: the residual
                a0 = u_s.index(m * 3 + 0).load(acc_l)
                a1 = u_s.index(m * 3 + 1).load(acc_l)
                a2 = u_s.index(m * 3 + 2).load(acc_l)
                hi = gl.zeros([64, BK], wt_desc.dtype, layout=a_l)
                lo = hi
                n0, n1, n2, n3, n4 = _zp(
                    z_ptr, sz, ze0, k, m, 0, e0, E, ZEV, F, BK, t_l
                )
                for jb in range(3):
                    c0, c1, c2 = _chunk(a0, a1, a2, zero, X3, FMA)
                    for kh in gl.static_range(KS):
                        c = NA + NO + (kk * 3 + m) * KA + KS * jb + kh
                        q0, q1, q2, q3, q4 = n0, n1, n2, n3, n4
                        # the next K step's loads in flight while this one computes
                        c1st = 64 * jb + BK * kh + BK
                        n0, n1, n2, n3, n4 = _zp(z_ptr, sz, ze0, k, m, c1st, e0, E,
                                                 ZEV, F, BK, t_l)  # fmt: skip
                        a = _dz(u_s, a_s, q0, q1, q2, q3, q4, m, jb, kh, BK, a_l, t_l,
                                FMA)  # fmt: skip
                        c0, c1, c2, hi, lo = _kstep(a, hi, lo, c, g0 + c, c0, c1, c2,
                                                    rr, more, w, 3, seq, X3, FMA, BK,
                                                    STG, a_l, b_l)  # fmt: skip
                    a0, a1, a2 = _fold(a0, a1, a2, c0, c1, c2, hi, lo, 3, X3, FMA)
                a0, a1, a2 = _retire(a0, a1, a2, hi, lo, 3, X3, 0, FMA)
                gl.thread_barrier()  # every K step read du of this order
                _bwd_epilogue(a0, 0, m, kk == K - 1, u_s, dx_ptr, sx_m, sx_c, e0, E,
                              SIN0, F, acc_l)  # fmt: skip
                _bwd_epilogue(a1, 1, m, kk == K - 1, u_s, dx_ptr, sx_m, sx_c, e0, E,
                              SIN0, F, acc_l)  # fmt: skip
                _bwd_epilogue(a2, 2, m, kk == K - 1, u_s, dx_ptr, sx_m, sx_c, e0, E,
                              SIN0, F, acc_l)  # fmt: skip
                gl.thread_barrier()
