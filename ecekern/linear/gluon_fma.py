"""EquivariantLinear's strict-fp32 forward on the FMA units, written in Gluon.

``y[b, o, m] = sum_k x[b, k, m] w[m, o, k] (+ bias[o] at m = 0)``

    x (B, K, 3)  rows contiguous: stride(1) == 3, stride(2) == 1
    w (3, O, K)  read with O contiguous (stride(1) == 1): the input backward's W^T as
                 it lies, the forward's W through the kept transposed copy
    y (B, O, 3)  contiguous; fp32 in and out, IEEE fp32 FMAs

Why a kernel of its own: with TF32 off the forward is arithmetic-bound (48 flop/byte at
K = O = 192), and a Triton ``tl.dot`` on the FMA units waits on shared memory. Gluon
lets each thread own a ``TM x TN`` tile of every mode's output and read, per input k,
TM values of x and TN of W for ``TM TN`` FMAs.

One program: 64 rows by 64 outputs, all three modes, 4 warps. Per K step of 16 inputs:
(1) x's ``[64, 48]`` row segment arrives by 16-byte loads and its modes come apart in
registers (``_modes``); (2) each mode is stored to shared memory transposed,
``[k][row]``, beside W's ``[k][o]`` tile; (3) after one barrier every warp runs ``16 x
3`` rank-1 updates from shared memory (``fma_dot``). The epilogue joins the modes in
registers and stores 32 outputs x 3 modes per warp, contiguous in y
(``gluon_common.store_modes``).

Bytes: ``4 B 3 (K + O)`` plus W; flops ``2 B K O 3``. Gradients: this kernel is the
forward and the input backward (``dx = g W``, with W^T as w); the weight gradient is a
GEMM (``dense.bwd_w_gemm``).

Status: n_ang = 3, fp32 with TF32 off, CUDA with Gluon; any B, K, O (masked). The plan
(``linear.plan``) takes it only where :func:`fma_reason` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import fma_dot, gl, gluon, triton
from .gluon_common import jit, store_modes

__all__ = ["FmaLaunch", "fma_fwd", "fma_reason"]

#: Register tiles (TM rows x TN outputs per thread and mode) and the thread layout
#: that puts them on a 64 x 64 program: (TM, TN, lanes along rows).
TILES = {"8x4": (8, 4, 4), "4x8": (4, 8, 8)}
BLOCK_B, BLOCK_O, BLOCK_K, WARPS = 64, 64, 16, 4


@dataclass(frozen=True)
class FmaLaunch:
    """A launch of the FMA kernel: the register tile (``TILES``) and the register cap
    per thread (168 lets three programs of 128 threads share an SM)."""

    tile: str = "8x4"
    maxnreg: int | None = 168


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@jit
def _half(t, N: gl.constexpr):
    return gl.split(t.reshape([t.shape[0], t.shape[1], N // 2, 2]))


@jit
def _modes(t, BB: gl.constexpr):
    """A ``[BB, 4, 16]`` x tile (slot e = 3 j + m of group q holds input 4 q + j,
    mode m; slots 12-15 empty) as three ``[BB, 16]`` tiles, one per mode, column
    4 q + j. Splits halve the slot axis, joins put four slots back together; every
    value stays in the thread that loaded it."""
    e, o = _half(t, 16)
    ee, eo = _half(e, 8)
    oe, oo = _half(o, 8)
    eee, eeo = _half(ee, 4)
    eoe, eoo = _half(eo, 4)
    oee, oeo = _half(oe, 4)
    ooe, ooo = _half(oo, 4)
    c0, c8 = gl.split(eee)
    c4, c12 = gl.split(eeo)
    c2, c10 = gl.split(eoe)
    c6, c14 = gl.split(eoo)
    c1, c9 = gl.split(oee)
    c5, c13 = gl.split(oeo)
    c3, c11 = gl.split(ooe)
    c7, c15 = gl.split(ooo)
    a0 = gl.join(gl.join(c0, c6), gl.join(c3, c9)).reshape([BB, 16])
    a1 = gl.join(gl.join(c1, c7), gl.join(c4, c10)).reshape([BB, 16])
    a2 = gl.join(gl.join(c2, c8), gl.join(c5, c11)).reshape([BB, 16])
    return a0, a1, a2


@jit
def _load_w(
    w_ptr,
    k0,
    o0,
    K,
    O,
    stride_wm,
    stride_wk,
    BK: gl.constexpr,
    BO: gl.constexpr,
    num_warps: gl.constexpr,
):
    """W's three ``[BK, BO]`` tiles ``w[m, o0 + o, k0 + k]`` as ``[k, o]``, O
    contiguous: a warp loads two rows of 64 outputs by 16-byte loads."""
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
    k = gl.arange(0, BK, layout=gl.SliceLayout(1, lay))[:, None]
    o = gl.arange(0, BO, layout=gl.SliceLayout(0, lay))[None, :]
    p = w_ptr + (o0 + o) + (k0 + k) * stride_wk
    mask = (o0 + o < O) & (k0 + k < K)
    w0 = gl.load(p, mask=mask, other=0.0)
    w1 = gl.load(p + stride_wm, mask=mask, other=0.0)
    w2 = gl.load(p + 2 * stride_wm, mask=mask, other=0.0)
    return w0, w1, w2


@jit
def _load_x(x_ptrs, x_mask, x_k, k0, K, EVEN_K: gl.constexpr):
    """The ``[BB, 4, 16]`` x tile of the K step at ``k0``: zeros past K (and, for
    ``k0 >= K``, everywhere: the loop's load after its last step)."""
    if EVEN_K:  # a mask that is constant along each 16-byte load keeps it one load
        return gl.load(x_ptrs + k0 * 3, mask=x_mask & (k0 < K), other=0.0)
    return gl.load(x_ptrs + k0 * 3, mask=x_mask & (k0 + x_k < K), other=0.0)


@jit
def _stage(xs, ws, buf, xr, w0, w1, w2, BB: gl.constexpr):
    """One K step into shared buffer ``buf`` (of two): each mode of x transposed,
    ``[k][row]``, and W's three ``[k][o]`` tiles as loaded."""
    a0, a1, a2 = _modes(xr, BB)
    xs.index(buf).store(a0.permute((1, 0)))
    xs.index(buf + 1).store(a1.permute((1, 0)))
    xs.index(buf + 2).store(a2.permute((1, 0)))
    ws.index(buf).store(w0)
    ws.index(buf + 1).store(w1)
    ws.index(buf + 2).store(w2)


@jit
def _eqlin_fwd_fma_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    B,
    K,
    O,
    stride_xb,
    stride_wm,
    stride_wk,
    stride_yb,
    HAS_BIAS: gl.constexpr,
    TM: gl.constexpr,
    TN: gl.constexpr,
    TR: gl.constexpr,
    KS: gl.constexpr,
    EVEN_K: gl.constexpr,
    num_warps: gl.constexpr,
):
    BB: gl.constexpr = 64
    BO: gl.constexpr = 64
    BK: gl.constexpr = 16
    ob = gl.program_id(0)
    rb = gl.program_id(1)
    o0 = ob * BO

    # each thread a TM x TN tile of each mode's [BB, BO] output (2 x 2 warps)
    acc_l: gl.constexpr = gl.BlockedLayout([TM, TN], [TR, 32 // TR], [2, 2], [1, 0])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=0)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_l, k_width=0)

    # x: [BB, 4, 16], one thread one row's 4 inputs x 3 modes (12 contiguous floats)
    ld_l: gl.constexpr = gl.BlockedLayout(
        [1, 1, 16], [8, 4, 1], [num_warps, 1, 1], [2, 1, 0]
    )
    r_i = gl.arange(0, BB, layout=gl.SliceLayout(1, gl.SliceLayout(2, ld_l)))[
        :, None, None
    ]
    q_i = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, ld_l)))[
        None, :, None
    ]
    e_i = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, ld_l)))[
        None, None, :
    ]
    x_ptrs = x_ptr + rb.to(gl.int64) * BB * stride_xb + r_i * stride_xb + q_i * 12 + e_i
    x_mask = (rb * BB + r_i < B) & (e_i < 12) & (q_i >= 0)
    x_k = q_i * 4 + e_i // 3  # the input each slot holds, within the step

    sh_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    xs = gl.allocate_shared_memory(gl.float32, [6, BK, BB], sh_l)  # [buf, mode][k][b]
    ws = gl.allocate_shared_memory(gl.float32, [6, BK, BO], sh_l)  # [buf, mode][k][o]

    acc0 = gl.zeros([BB, BO], gl.float32, layout=acc_l)
    acc1 = gl.zeros([BB, BO], gl.float32, layout=acc_l)
    acc2 = gl.zeros([BB, BO], gl.float32, layout=acc_l)

    # [book: fma-loop]
    # step 0 into buffer 0
    xr = _load_x(x_ptrs, x_mask, x_k, 0, K, EVEN_K)
    w0, w1, w2 = _load_w(w_ptr, 0, o0, K, O, stride_wm, stride_wk, BK, BO, num_warps)
    _stage(xs, ws, 0, xr, w0, w1, w2, BB)
    gl.thread_barrier()

    for it in range((K + BK - 1) // BK):
        s = (it % 2) * 3
        nx = ((it + 1) % 2) * 3
        k1 = (it + 1) * BK
        # the next step's loads (masked off after the last), issued before the FMAs
        xr = _load_x(x_ptrs, x_mask, x_k, k1, K, EVEN_K)
        w0, w1, w2 = _load_w(
            w_ptr, k1, o0, K, O, stride_wm, stride_wk, BK, BO, num_warps
        )
        for kk in gl.static_range(BK // KS):
            a = xs.index(s).slice(kk * KS, KS).permute((1, 0)).load(a_l)
            b = ws.index(s).slice(kk * KS, KS).load(b_l)
            acc0 = fma_dot(a, b, acc0)
            a = xs.index(s + 1).slice(kk * KS, KS).permute((1, 0)).load(a_l)
            b = ws.index(s + 1).slice(kk * KS, KS).load(b_l)
            acc1 = fma_dot(a, b, acc1)
            a = xs.index(s + 2).slice(kk * KS, KS).permute((1, 0)).load(a_l)
            b = ws.index(s + 2).slice(kk * KS, KS).load(b_l)
            acc2 = fma_dot(a, b, acc2)
        _stage(xs, ws, nx, xr, w0, w1, w2, BB)
        gl.thread_barrier()  # buffer s is free, buffer nx is written
    # [book: end fma-loop]

    store_modes(
        acc0, acc1, acc2, y_ptr, b_ptr, rb * BB, o0, B, O, stride_yb, HAS_BIAS, BB,
        BO, num_warps,
    )  # fmt: skip


# --------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------
def fma_reason(x: torch.Tensor, w: torch.Tensor, tf32: bool) -> str | None:
    """Why :func:`fma_fwd` cannot serve ``x (B, K, n_ang)``, ``w (n_ang, O, K)`` with
    TF32 ``tf32``, or None when it can."""
    if gluon is None:
        return "no validated Gluon in this Triton"
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        return f"{x.dtype}: the kernel is fp32 only"
    if tf32:
        return "TF32 is on: the tensor cores are faster"
    if x.shape[2] != 3:
        return f"n_ang = {x.shape[2]}: the mode split is written for 3"
    if x.stride(2) != 1 or x.stride(1) != 3:
        return "x's rows are not contiguous"
    if x.device.type != "cuda" or w.device != x.device:
        return "not a CUDA tensor (or x and w on different devices)"
    return None


def fma_fwd(x, w, bias, launch: FmaLaunch = FmaLaunch()) -> torch.Tensor:
    """``y (B, O, 3)`` for ``x (B, K, 3)`` with rows contiguous, ``w (3, O, K)`` with O
    contiguous, ``bias (O,)`` contiguous or None. The caller checked
    :func:`fma_reason`."""
    B, K, _ = x.shape
    O = w.shape[1]
    y = torch.empty((B, O, 3), device=x.device, dtype=x.dtype)
    TM, TN, TR = TILES[launch.tile]
    grid = (triton.cdiv(O, BLOCK_O), triton.cdiv(B, BLOCK_B))
    opts = {} if launch.maxnreg is None else {"maxnreg": launch.maxnreg}
    _eqlin_fwd_fma_kernel[grid](
        x, w, bias if bias is not None else w, y, B, K, O, x.stride(0), w.stride(0),
        w.stride(2), y.stride(0), HAS_BIAS=bias is not None, TM=TM, TN=TN, TR=TR,
        KS=4, EVEN_K=K % BLOCK_K == 0, num_warps=WARPS, **opts,
    )  # fmt: skip
    return y
