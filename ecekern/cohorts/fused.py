"""The whole mixing stack in one kernel per tile of edges, the tile on chip: forward,
and the force backward, on the tensor cores (Gluon, Hopper ``wgmma``) or, in strict
fp32, on the FMA units.

Formula (``ecekern.cohorts.layers``; per edge e, order m, cos and sin alike)::

    u_0 = x;  z_k = W_k[m] u_(k-1) (+ b_k at m = 0, cos);  u_k = u_(k-1) + gate(z_k)
    y = W_out[m] u_K (+ b_out at m = 0, cos)
    du_K = W_out[m]^T dy;  dz_k = gate'(z_k) du_k;  du_(k-1) = du_k + W_k[m]^T dz_k
    dx = du_0

A program owns a tile of 32 edges at a time, its state in shared memory through
every layer, the weights streamed from L2 (the forward:
:mod:`~ecekern.cohorts.fused_forward`). The backward holds du as the forward holds
u: ``W_out^T dy`` first, then for each gated layer
the orders, m = 0 first (its ``dz`` needs ``t = sum_(m>=1) du_m z_m`` of rows not
yet overwritten); ``dz`` is made BK inputs at a time from du, the kept z and p
(loaded a K step ahead), cos and sin rows of an edge side by side, and handed to the
products through a ``[64, BK]`` buffer. The accumulators start at du: the residual.
In 3xTF32 and strict fp32 each chunk of inputs (64; 32 of dy in the first stage) is
summed from zero and added to them in fp32, so that the roundings of a long sum are
relative to the chunk's sum, not to du's. The recomputing backward (``RECOMP``,
from x instead of a kept z) first runs each tile's gated layers again, as the
forward does, into its program's slab of z, then the tile's backward from there: it
writes only dx. The weights' sequence then has three parts: W, W_out^T, W^T.

Shapes: planes ``x, y, dy, dx (n_ang, 2, n, width)`` (order, cos/sin, edge,
feature), rows contiguous, a plane's sin part and rows within 2**31 values (the
order's offset is int64: ``_check_planes``); ``z (K, n_ang, 2, n, F)`` a
cohort's rows of a contiguous z, or each program's slab ``(K n_ang 2 32 F)`` in
the recomputing backward; weights as ``ecekern.cohorts.layers``.

Bytes (DRAM), in activations of ``2 n F n_ang`` values (cos and sin): the forward
reads x and writes y and z (five of the six planes of each z_k),
``1 + F'/F + 5 K / 6``; the backward reads dy and z and writes dx, the same. At
K = 2, F' = F/2 that is 3.2 each way (2.9 with ``sin0``), against the layer
kernels' 6.3 and 9.6 (with ``sin0``). Recomputing: the forward reads x and
writes y (``1 + F'/F``, 1.25 with ``sin0``), the backward reads x and dy and
writes dx (``2 + F'/F``, 2.1 with ``sin0``), and z of a tile, ``K 5/6``
activations of 32 edges, goes to L2 and back. L2: all the weights, once a tile
each way, twice in the recomputing backward (twice that in 3xTF32: the TF32 part
and the remainder; half in bf16).
FLOPs: ``4 n_ang (K F^2 + F' F) n`` each way, the m = 0 sin rows included, and
``4 n_ang K F^2 n`` more in the recomputing backward; three times that on the
tensor cores in 3xTF32.

Precision (the weights' ring and the products: :mod:`~ecekern.cohorts.fused_ring`),
float32 rows only: ``"ieee"`` (strict fp32 FMAs; the backward chunked as 3xTF32,
the forward's sums from zero in one chunk), ``"tf32"``, fp32-accurate ``"tf32x3"``,
or ``"bf16"`` (rows rounded to bf16 in registers and W once a call; fp32 sums).

Status: n_ang = 3, F = 192, F' = 96, CUDA with validated Gluon (sm_90); option
``cohort_fused="ieee-stack"``, ``"tf32x3-stack"``, ``"tf32-stack"`` or
``"bf16-stack"`` (with ``cohort_recompute``: y only, and the recomputing
backward); compiles for sm_90 without a GPU (tests); its GPU tests compare it with
the fp64 reference by the three-way rule at its precision, both ways.
"""

from __future__ import annotations

import torch

from .._triton import GLUON_REASON, gl, gluon, triton
from .fused_forward import (
    BOX,
    BOX16,
    WARPS,
    _fused_fwd_kernel,
    _gated_layer,
    _load_x,
    _rows,
    _sigmoid,
)
from .fused_ring import (
    BK,
    F_IN,
    F_OUT,
    N_ANG,
    PRECISIONS,
    STAGES,
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
    backward_weights,
    forward_weights,
)

if gluon is not None:
    pass

__all__ = [
    "backward",
    "backward_weights",
    "forward",
    "forward_weights",
    "fused_backward",
    "fused_forward",
    "why_not_fused",
]


# --------------------------------------------------------------------------------------
# kernels (the backward's; the forward's: fused_forward)
# --------------------------------------------------------------------------------------
@_jit
def _half(e0, E, c0, BK: gl.constexpr, t_l: gl.constexpr):
    """Edge offsets, mask and input columns ``c0 ..`` of a ``[32, BK]`` half of a K
    step."""
    r = gl.arange(0, 32, layout=gl.SliceLayout(1, t_l))
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
    du_c = box.slice(0, 32, dim=0).load(t_l)
    du_s = box.slice(32, 32, dim=0).load(t_l)
    if m == 0:
        b1 = u_s.index(3 + jb).slice(BK * kh, BK, dim=1)
        b2 = u_s.index(6 + jb).slice(BK * kh, BK, dim=1)
        t = b1.slice(0, 32, dim=0).load(t_l) * z1c
        t += b1.slice(32, 32, dim=0).load(t_l) * z1s
        t += b2.slice(0, 32, dim=0).load(t_l) * z2c
        t += b2.slice(32, 32, dim=0).load(t_l) * z2s
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
    F: gl.constexpr = 192
    FO: gl.constexpr = 96
    KS: gl.constexpr = 64 // BK  # K steps a box of du
    KH: gl.constexpr = 32 // BK  # K steps of 32 outputs of dy
    KO: gl.constexpr = 96 // BK  # K steps of W_out^T, [192, BK] each
    NO: gl.constexpr = 3 * KO
    KA: gl.constexpr = 192 // BK  # K steps of a gated layer's W or W^T
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
    ring, ready = _ring(wt_desc, X3, STG, BK)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_mine = gl.cdiv(n_tiles - pid, nprog)
    if RECOMP:  # z of a tile in the program's own rows, 32 edges
        z_ptr = z_ptr + pid * (K * 6 * 32 * F)
    for cp in gl.static_range(STG - 1):
        _load_w(cp, NCH, NA, KA, NO, KO, 3, 192, wt_desc, wot_desc, wtl_desc,
                wotl_desc, ring, ready, cp, STG, BK, X3)  # fmt: skip
    zero = gl.zeros([64, 64], gl.float32, layout=acc_l)
    gl.thread_barrier()
    for it in range(n_mine):
        e0 = (pid + it * nprog) * 32
        more = it + 1 < n_mine
        g0 = it * NCH
        if RECOMP:  # 0. the gated layers again, from x: z of the tile
            ze0 = e0
            _load_x(u_s, x_ptr, si_m, si_c, e0, E, SIN0, F, ld_l)
            gl.thread_barrier()
            for k in gl.static_range(K):
                _gated_layer(k, u_s, g0, zero, ring, ready, wt_desc, wot_desc,
                             wtl_desc, wotl_desc, more, b_ptr, z_ptr, sz, ze0, e0, E,
                             HAS_B, True, ZEV, NCH, NA, KA, NO, KO, 3, 192, X3, FMA, BK,
                             STG, acc_l, a_l, b_l)  # fmt: skip
        else:
            ze0 = 0
        # 1. du_K = W_out^T dy, an order at a time
        for m in range(3):
            a0, a1, a2 = zero, zero, zero
            hi = gl.zeros([64, BK], wt_desc.dtype, layout=a_l)
            lo = hi
            for kc in range(3):  # 32 outputs of dy, KH K steps
                c0, c1, c2 = _chunk(a0, a1, a2, zero, X3, FMA)
                for kh in gl.static_range(KH):
                    c = NA + m * KO + KH * kc + kh
                    a = _dy(a_s, dy_ptr, sd_m, sd_c, m, BK * (KH * kc + kh), e0, E,
                            SIN0, FO, BK, a_l, t_l, FMA)  # fmt: skip
                    c0, c1, c2, hi, lo = _kstep(a, hi, lo, c, g0 + c, c0, c1, c2, ring,
                                                ready, more, wt_desc, wot_desc,
                                                wtl_desc, wotl_desc, 3, NCH, NA, KA,
                                                NO, KO, 3, 192, X3, FMA, BK, STG, a_l,
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
                                                    ring, ready, more, wt_desc,
                                                    wot_desc, wtl_desc, wotl_desc, 3,
                                                    NCH, NA, KA, NO, KO, 3, 192, X3,
                                                    FMA, BK, STG, a_l,
                                                    b_l)  # fmt: skip
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


# --------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------
def _grid(n_tiles: int, dev) -> int:
    return max(
        1, min(n_tiles, torch.cuda.get_device_properties(dev).multi_processor_count)
    )


def why_not_fused(F: int, FO: int, n_ang: int, dtype, device_type: str,
                  precision: str, capability: tuple | None = None):  # fmt: skip
    """Why the fused kernels cannot serve a stack of this shape, or None
    (``capability``: the CUDA device's ``(major, minor)``; the kernels are
    Hopper's, sm_90)."""
    if device_type != "cuda":
        return "not a CUDA tensor"
    if capability is not None and tuple(capability)[0] != 9:
        major, minor = tuple(capability)[:2]
        return (f"sm_{major}{minor} is not Hopper: the fused stack's TMA (and "
                "wgmma) kernels are sm_90's")  # fmt: skip
    if gluon is None:
        return GLUON_REASON or "no Gluon in this Triton"
    if dtype != torch.float32 or precision not in PRECISIONS:
        return (f"{dtype} in {precision!r}: the fused stack is float32 in "
                f"{' or '.join(map(repr, PRECISIONS))}")  # fmt: skip
    if (F, FO, n_ang) != (F_IN, F_OUT, N_ANG):
        return (f"F = {F}, F' = {FO}, n_ang = {n_ang}: the fused stack is written for "
                f"{F_IN}, {F_OUT}, {N_ANG}")  # fmt: skip
    return None


def _z_plane(z: torch.Tensor, K: int, n: int) -> int:
    """The plane stride of ``z (K, 3, 2, n, F)``, planes one after another (a
    cohort's rows of a contiguous z are). The kernels offset a plane in int64 and
    index within one, sin part included, in int32."""
    sk, sm, sc, se, sf = z.stride()
    if z.shape != (K, N_ANG, 2, n, F_IN) or (sf, se) != (1, F_IN) or sm != 2 * sc \
            or sk != N_ANG * sm or sc + n * F_IN >= 2**31:  # fmt: skip
        raise ValueError(f"z {tuple(z.shape)} with strides {z.stride()} is not a "
                         "cohort's rows of a contiguous (K, 3, 2, E, F)")  # fmt: skip
    return sc


def _check_planes(n: int, **planes) -> None:
    """Each ``name=(P, width)``: planes ``(3, 2, n, width)``, rows contiguous, that
    the kernels can index: an order's offset in int64, the rest (sin part, edge,
    feature) in int32, so ``P.stride(1) + n width < 2**31``. A ValueError
    otherwise."""
    for name, (P, width) in planes.items():
        if tuple(P.shape) != (N_ANG, 2, n, width):
            raise ValueError(f"{name} is {tuple(P.shape)}, not the fused stack's "
                             f"planes ({N_ANG}, 2, {n}, {width})")  # fmt: skip
        if P.stride(1) + n * width >= 2**31 or P.stride(2) != width or \
                P.stride(3) != 1:  # fmt: skip
            raise ValueError(
                f"{name} {tuple(P.shape)} with strides {P.stride()}: the fused stack "
                "takes planes whose sin part and rows span fewer than 2**31 values, "
                "rows contiguous"
            )


def _slab(like: torch.Tensor, K: int, grid: int) -> tuple:
    """Each program's own rows of z, 32 edges (a tile), and their plane stride:
    what the gates need from z stays in L2, written and read back a tile at a
    time."""
    return like.new_empty((grid, K * 2 * N_ANG * 32 * F_IN)), 32 * F_IN


def forward(xp, prep: tuple, z, yp, sin0: bool) -> None:
    """The stack on planes ``xp (3, 2, n, F)`` into planes ``yp (3, 2, n, F')``,
    with the weights of :func:`~ecekern.cohorts.fused_ring.forward_weights`; the
    pre-activations into ``z (K, 3, 2, n, F)`` (a cohort's rows of a contiguous z;
    its m = 0 sin planes are not written), or with ``z=None`` only y (the gates' p
    through each program's rows of an L2-sized slab). With ``sin0`` the m = 0 sin
    plane of x is not read and that of y not written. Shapes and precision checked
    by the caller (:func:`why_not_fused`)."""
    (w, wl), (wo, wol), b, bo, K, precision = prep
    n = xp.shape[2]
    n_tiles = triton.cdiv(n, 32)
    if n_tiles == 0:
        return
    _check_planes(n, x=(xp, F_IN), y=(yp, F_OUT))
    grid = _grid(n_tiles, xp.device)
    z, sz = _slab(xp, K, grid) if z is None else (z, _z_plane(z, K, n))
    _fused_fwd_kernel[(grid,)](
        xp, xp.stride(0), xp.stride(1), w, wo, wl, wol,
        xp if b is None else b, xp if bo is None else bo, z, sz,
        yp, yp.stride(0), yp.stride(1), n, n_tiles, K=K, HAS_B=b is not None,
        HAS_BO=bo is not None, SIN0=sin0, X3=precision == "tf32x3",
        FMA=precision == "ieee", BK=BK[precision], STG=STAGES, SLAB=z.ndim == 2,
        num_warps=WARPS,
    )  # fmt: skip


def backward(gp, prep: tuple, z, dxp, sin0: bool, xp=None) -> None:
    """dx into planes ``dxp (3, 2, n, F)`` for the output gradient's planes
    ``gp (3, 2, n, F')``: from the kept ``z (K, 3, 2, n, F)`` (as :func:`forward`
    wrote it), with the weights of
    :func:`~ecekern.cohorts.fused_ring.backward_weights`; or, with ``z=None`` and
    the stack's input planes ``xp``, recomputing each tile's z from x on chip (the
    weights of ``backward_weights(..., biases=)``; xp may be dxp: a tile reads its
    x before it writes its dx). With ``sin0`` the m = 0 sin planes of the gradient
    and x are not read and that of dx not written."""
    (wt, wtl), (wot, wotl), *b, K, precision = prep
    recomp = z is None
    if recomp != (xp is not None) or recomp != bool(b):
        raise ValueError("the fused backward takes a kept z, or x (z=None) with the "
                         "recomputing backward's weights (their biases)")  # fmt: skip
    n = gp.shape[2]
    n_tiles = triton.cdiv(n, 32)
    if n_tiles == 0:
        return
    _check_planes(n, dy=(gp, F_OUT), dx=(dxp, F_IN),
                  **({} if xp is None else {"x": (xp, F_IN)}))  # fmt: skip
    grid = _grid(n_tiles, gp.device)
    z, sz = _slab(gp, K, grid) if recomp else (z, _z_plane(z, K, n))
    b = b[0] if recomp else None
    xp = gp if xp is None else xp
    _fused_bwd_kernel[(grid,)](
        gp, gp.stride(0), gp.stride(1), wt, wot, wtl, wotl, z, sz, dxp,
        dxp.stride(0), dxp.stride(1), xp, xp.stride(0), xp.stride(1),
        gp if b is None else b, n, n_tiles, K=K, SIN0=sin0,
        X3=precision == "tf32x3", FMA=precision == "ieee", BK=BK[precision],
        STG=STAGES, RECOMP=recomp, HAS_B=b is not None, num_warps=WARPS,
    )  # fmt: skip


def _serves(xp, weight_out, precision: str) -> None:
    """A ValueError, with the reason, where the kernels cannot serve a call."""
    n_ang, FO, F = weight_out.shape
    cap = torch.cuda.get_device_capability(xp.device) if xp.is_cuda else None
    why = why_not_fused(F, FO, n_ang, xp.dtype, xp.device.type, precision, cap)
    if why:
        raise ValueError(f"the fused stack cannot serve this call: {why}")


def fused_forward(xp, weights, biases, weight_out, bias_out, z, yp, sin0: bool,
                  precision: str = "tf32"):  # fmt: skip
    """:func:`forward` with the weights as the model holds them (a ValueError
    where the kernels cannot serve the call, :func:`why_not_fused`)."""
    _serves(xp, weight_out, precision)
    prep = forward_weights(weights, biases, weight_out, bias_out, precision)
    forward(xp, prep, z, yp, sin0)


def fused_backward(gp, weights, weight_out, z, dxp, sin0: bool,
                   precision: str = "tf32", xp=None, biases=None):  # fmt: skip
    """:func:`backward` with the weights as the model holds them (a ValueError
    where the kernels cannot serve the call, :func:`why_not_fused`); with
    ``z=None``, from x (``xp``) and the gated layers' ``biases``."""
    _serves(gp, weight_out, precision)
    if z is None and biases is None:
        biases = [None] * len(weights)
    prep = backward_weights(weights, weight_out, precision,
                            biases if z is None else None)  # fmt: skip
    backward(gp, prep, z, dxp, sin0, xp)
