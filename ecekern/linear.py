"""EquivariantLinear: ``y[b, o, m] = sum_i x[b, i, m] W[m, o, i]`` (+ bias, m = 0 cos).

Shapes: ``x_cos, x_sin (..., K, n_ang)`` with K = in features, ``W (n_ang, O, K)``,
``bias (O,)``, ``y_cos, y_sin (..., O, n_ang)``; the leading dims flatten to B rows.
The same ``W[m]`` acts on cos and sin (that is what makes the map commute with rotations
about the edge axis); the bias enters only the m = 0 cos slot.

Gradients (what is saved: x_cos, x_sin and W; nothing is recomputed)::

    dx[b, i, m] = sum_o dy[b, o, m] W[m, o, i]       the forward with W transposed
    dW[m, o, i] = sum_b dy[b, o, m] x[b, i, m]       over cos and sin
    dbias[o]    = sum_b dy_cos[b, o, 0]

Paths (``path=``):

* ``einsum``: the reference (:func:`ecekern.reference.equivariant_linear`), a batched
  matmul over the angular axis that copies x into m-major order and back;
* ``dense``: one row-major ``addmm`` of ``x (B, K n_ang)`` against the per-m
  block-diagonal ``(K n_ang, O n_ang)`` weight assembled from W each call (autograd
  flows through the assembly); no copies, but n_ang times the needed flops;
* ``triton``: a per-mode Triton kernel that loads each mode's tile of x with stride
  n_ang, features first (or, ``ECEKERN_TRITON_SPLIT=1``, one contiguous
  ``[BLOCK_K, n_ang, BLOCK_B]`` tile split in registers), does one dot per mode (no
  zero blocks) and stores each mode back the same way; the input
  gradient is the same kernel with W's strides swapped; the weight gradient is a
  deterministic two-stage reduction (per-chunk partial sums, then a sum over chunks;
  no atomics), skipped when W does not require grad.

Bytes moved (triton, one direction): ``2 B n_ang (K + O) s`` for cos and sin, s the
element size, plus W; flops ``4 B K O n_ang``, so ``K O / (2 (K + O))`` flop/byte in
fp32 (48 at K = O = 192): arithmetic-bound on the FMA units in strict fp32,
memory-bound on the tensor cores (TF32, bf16).

Status: forward, first and second derivatives in fp64/fp32 (IEEE or TF32)/bf16/fp16
(fp32 accumulation), n_ang <= 8, any K, O, B (masked), int64 offsets. In Triton's
interpreter every configuration matches the einsum in fp64 to 1e-12; on the H200
(2026-11-29, ``python -m ecekern.captures.diagnose``) every output matches float64
einsum (fp32 2.5e-7, TF32 7.7e-4, fp64 exactly) at one software-pipelining stage. The
wrong fp32 results seen in an earlier H200 run did not come back with the current
kernels; the strict expected-failure tests that held them now run as plain tests.
Faster, not yet fast: until 2026-11-30 every tile was laid out rows first, and with
strides that do not say which axis is contiguous Triton's coalescing gave a warp's 32
threads to 32 different rows, one 32-byte sector per element; the best forward launch
(one of cos/sin, E = 47k, F = 192, n_ang = 3) took 326 us in bf16, 403 us in TF32 and
1348 us in strict fp32. Features first (``_mode_of``), chapter 2's launch sweep
(ee10e9b) measured 149, 224 and 932 us, against floors of 25 and 50 us (DRAM) and
203 us (the FMA units of strict fp32). Copies without a dot (2026-11-30) showed the
strided loads cost nothing (L1 serves the other modes) and the strided stores about
twice a contiguous copy; the forward's switches PREFETCH (the next K step in flight),
STORE3 (one interleaved store) and W_DESC (W by the bulk copy engine, pipelined at two
stages) followed, then JOIN (the interleaved tile built by ``tl.join``); chapter 2's
launch sweep at c2b3968 chose 118 us (bf16, PREFETCH and W_DESC), 144 us (TF32, all
four) and 874 us (strict fp32, none). Cos and sin together the path beats the einsum
in every tensor-core cell of the sweep and loses to the dense GEMM in every one but bf16
at n_ang = 3 (TF32, n_ang = 3: 0.284 against 0.238 ms at 47k; the dense rows
re-taken at 51554fe: the older ones, from before the dense weight stopped being copied,
had put this path 11 % ahead). Nsight Compute: low occupancy and warps waiting on loads;
Gluon prototypes that keep W in shared memory, and a Triton one that loads x by TMA,
were 2x slower; a Gluon one with the A operand in registers and one interleaved store
runs at about this kernel's speed (chapter 2, not in the library). bf16 at n_ang = 3 (K
and O multiples of 64, K <= 256) runs the Gluon kernel of :mod:`ecekern.linear_tc`
instead, in which a ``wgmma`` against 0/1 matrices splits the modes and its accumulator
feeds the per-mode ``wgmma`` from registers, a loader warp and two consumer
warpgroups per program: 58.9 against 115.0 us for the best Triton launch (launch sweep
at 054b254), 0.114 against 0.129 ms for the dense GEMM cos and sin at 47k, 784 against
828 us at 365k (medians of seven alternating rounds, history session12_ab_dense.csv).
Its TF32 version took 157.1 us against 144.5 for the Triton kernel, so TF32 keeps the
Triton kernel (``TF32_TRITON``).
Strict fp32 at n_ang = 3 runs the Gluon kernel of :mod:`ecekern.linear_fma` instead (the
Triton kernel's shared-memory loads were 77 % bank conflicts): 324 against 874 us
(3f0d85e), faster than the einsum (0.64 against 0.98 ms cos and sin at 47k). The input
gradient reads W^T in place in strict fp32 and fp16 (and bf16 where linear_tc does not
serve), and from a contiguous copy in TF32, where the in-place read cost 58 %
(2026-11-30, one-run A/B), and for linear_tc, which takes W^T contiguous; that copy, and
the strict-fp32 forward's W with O contiguous, are one W^T kept per weight until it
changes (``_w_t_copy``). The weight gradient is one GEMM per cos and sin on CUDA outside
fp64 (``_bwd_w_gemm``), the Triton reduction elsewhere; it and the bias's gradient are
not computed when the backward pass will not use them (forces).
``path="auto"`` picks the path in strict fp32 at n_ang = 3, where its force step is
the fastest, and in bf16 at n_ang = 3 where linear_tc serves the call (forward, force
pattern and training all faster in GPU time); with TF32 the dense GEMM's force step
is (``ecekern.linear.auto_path``).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton < 3.4: no host-side descriptors
        TensorDescriptor = None
except ImportError:  # no Triton wheels on this platform: reference paths only
    from . import _no_triton as triton

    tl = triton.language
    TensorDescriptor = None
from torch import nn

from . import linear_fma, linear_tc, options, reference

__all__ = ["EquivariantLinear", "equivariant_linear"]

#: Triton kernels run on CPU tensors only when decorated under the interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_N_ANG = 8
#: (dtype, largest n_ang) that matched the reference on the H200; other CUDA calls
#: fall back to the reference loudly (see the status line above).
CUDA_VALIDATED = {
    torch.float64: MAX_N_ANG,
    torch.float32: MAX_N_ANG,
    torch.bfloat16: MAX_N_ANG,
    torch.float16: MAX_N_ANG,
}
#: Software-pipelining depth (``ECEKERN_TRITON_STAGES``) of the launches that do not
#: fix their own: the strict-fp32 and bf16 forwards run two stages (chapter 2's
#: launch sweep, which checks every launch against float64); deeper pipelines of the
#: larger tiles need more shared memory than the SM has (Triton raises
#: OutOfResources).
STAGES = int(os.environ.get("ECEKERN_TRITON_STAGES", "1"))
#: Split the modes of one contiguous tile in registers (True) or load each mode as its
#: own strided tile (False): the same bytes from DRAM, the second leans on L1. With
#: features-first tiles the strided loads won every launch measured on the H200
#: (the split sums across the lanes that hold one feature's modes).
SPLIT = os.environ.get("ECEKERN_TRITON_SPLIT", "0") == "1"


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _mode(t3, offs_m, m: tl.constexpr):
    """Slot m of a ``[C, NA_PAD, R]`` register tile, as ``[C, R]``."""
    return tl.sum(tl.where(offs_m[None, :, None] == m, t3, 0.0), axis=1)


@triton.jit
def _mode_of(t3, offs_m, ptrs2, mask2, stride_m, m: tl.constexpr, SPLIT: tl.constexpr):
    """Mode m as a features-by-rows ``[C, R]`` tile: split from the contiguous tile t3
    in registers (SPLIT), or loaded directly as a strided tile (stride n_ang between
    neighbours).

    Every tile of x, g and y is laid out features first, rows last, and transposed
    in registers where a dot wants rows first. Triton's coalescing gives a load's
    threads to the tile's first axis when the strides do not say which is contiguous:
    rows first put a warp's 32 threads on 32 different rows, one 32-byte sector per
    element, and made the forward 1.4-2.2x slower on the H200 (chapter 2)."""
    if SPLIT:
        return _mode(t3, offs_m, m)
    else:
        return tl.load(ptrs2 + m * stride_m, mask=mask2, other=0.0)


@triton.jit
def _x_tiles(
    t3, offs_m, ptrs2, mask2, stride_m, N_ANG: tl.constexpr, SPLIT: tl.constexpr
):
    """The n_ang mode tiles of one K step (``_mode_of``); 0.0 for the unused slots."""
    x0 = _mode_of(t3, offs_m, ptrs2, mask2, stride_m, 0, SPLIT)
    x1 = 0.0
    x2 = 0.0
    x3 = 0.0
    x4 = 0.0
    x5 = 0.0
    x6 = 0.0
    x7 = 0.0
    if N_ANG > 1:
        x1 = _mode_of(t3, offs_m, ptrs2, mask2, stride_m, 1, SPLIT)
    if N_ANG > 2:
        x2 = _mode_of(t3, offs_m, ptrs2, mask2, stride_m, 2, SPLIT)
    if N_ANG > 3:
        x3 = _mode_of(t3, offs_m, ptrs2, mask2, stride_m, 3, SPLIT)
    if N_ANG > 4:
        x4 = _mode_of(t3, offs_m, ptrs2, mask2, stride_m, 4, SPLIT)
    if N_ANG > 5:
        x5 = _mode_of(t3, offs_m, ptrs2, mask2, stride_m, 5, SPLIT)
    if N_ANG > 6:
        x6 = _mode_of(t3, offs_m, ptrs2, mask2, stride_m, 6, SPLIT)
    if N_ANG > 7:
        x7 = _mode_of(t3, offs_m, ptrs2, mask2, stride_m, 7, SPLIT)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _join_modes(y0, y1, y2, y3, N_ANG: tl.constexpr):
    """Two to four ``[R, C]`` tiles as one ``[R, C, NA_PAD]`` tile, mode m at slot m
    (slot 3 zero for n_ang = 3); ``tl.join`` puts the new axis inside one thread."""
    if N_ANG == 2:
        return tl.join(y0, y1)
    else:
        if N_ANG == 3:
            y3 = tl.zeros_like(y0)
        # join(join(y0, y2), join(y1, y3)) is [R, C, 2, 2] with mode 2 p + q at (p, q)
        y4 = tl.join(tl.join(y0, y2), tl.join(y1, y3))
        return tl.reshape(y4, [y0.shape[0], y0.shape[1], 4])


@triton.jit
def _mode_dot(
    xm,
    w_tile_ptrs,
    w_mask,
    stride_w_m,
    w_desc,
    o0,
    k0,
    acc,
    m: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    W_DESC: tl.constexpr,
):
    """``acc + x[:, :, m] @ W[m]^T`` for one ``[BLOCK_K, BLOCK_B]`` tile of mode m and
    one ``[BLOCK_K, BLOCK_O]`` tile of W, loaded by pointers (W_DESC 0) or by the bulk
    copy engine from a tensor descriptor: of W ``(n_ang, O, K)``, K contiguous
    (W_DESC 1), or of the storage of W^T ``(n_ang, K, O)``, O contiguous (W_DESC 2:
    the input backward passes W transposed, and this reads it without a copy). Mode 2
    is free in 16-bit types; TF32's wgmma wants W's tile K-major, so there Triton
    turns it around through shared memory (offline sm_90 TTGIR: three more
    ``local_load`` per K step than mode 1), and TF32 launches copy W^T instead."""
    if W_DESC == 1:
        wt = w_desc.load([m, o0, k0])  # [1, BLOCK_O, BLOCK_K], zeros past the edges
        wm = tl.trans(tl.reshape(wt, [wt.shape[1], wt.shape[2]]))
    elif W_DESC == 2:
        wt = w_desc.load([m, k0, o0])  # [1, BLOCK_K, BLOCK_O]
        wm = tl.reshape(wt, [wt.shape[1], wt.shape[2]])
    else:
        wm = tl.load(w_tile_ptrs + m * stride_w_m, mask=w_mask, other=0.0)
    xm = tl.trans(xm)
    if UPCAST:  # the interpreter's bf16/fp16 dot is wrong: do it in fp32
        xm = xm.to(tl.float32)
        wm = wm.to(tl.float32)
    else:
        xm = xm.to(wm.dtype)
    return tl.dot(xm, wm, acc, input_precision=PRECISION, out_dtype=acc.dtype)


@triton.jit
def _eqlin_fwd_kernel(
    # pointers
    x_ptr,
    w_ptr,
    w_desc,
    b_ptr,
    y_ptr,
    # sizes
    B,
    K,
    O,
    # strides
    stride_x_b,
    stride_x_k,
    stride_x_m,
    stride_w_m,
    stride_w_o,
    stride_w_k,
    stride_y_b,
    stride_y_o,
    stride_y_m,
    # meta-parameters
    N_ANG: tl.constexpr,
    NA_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_O: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    STORE3: tl.constexpr = False,
    W_DESC: tl.constexpr = 0,
    JOIN: tl.constexpr = False,
):
    """One ``[BLOCK_B, BLOCK_O, n_ang]`` output tile of one of cos and sin: each is its
    own launch (bias only for cos: the launcher passes HAS_BIAS for the cos launch).

    PREFETCH: load the tiles of the next K step before the dots of this one (a
    register double buffer: the loads are in flight while the tensor cores work).
    STORE3: interleave the modes in registers and store one ``[BO, NA_PAD, BB]``
    tile, lanes along the modes (every byte of a warp's span written by one
    instruction; per-mode strided stores write each 32-byte sector in n_ang pieces).
    W_DESC: W through a tensor descriptor (no per-element pointers in registers): 0
    pointers, 1 W's descriptor, 2 a descriptor of W^T's storage (``_mode_dot``).
    JOIN (with STORE3, n_ang 2 to 4): build the interleaved tile with ``tl.join``,
    which keeps one row's modes in one thread, instead of selecting and adding."""
    pid_o = tl.program_id(0)  # the O tiles of one row block run side by side:
    pid_b = tl.program_id(1)  # x is read from DRAM once, then from L2
    # int64 row offsets: B * row stride can pass 2^31
    offs_b = pid_b.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    o0 = pid_o * BLOCK_O
    offs_o = o0 + tl.arange(0, BLOCK_O)
    offs_m = tl.arange(0, NA_PAD)
    offs_kk = tl.arange(0, BLOCK_K)
    mask_b = offs_b < B
    mask_o = offs_o < O
    mask_m = offs_m < N_ANG
    acc0 = tl.zeros([BLOCK_B, BLOCK_O], ACC_DTYPE)
    acc1 = tl.zeros([BLOCK_B, BLOCK_O], ACC_DTYPE)
    acc2 = tl.zeros([BLOCK_B, BLOCK_O], ACC_DTYPE)
    acc3 = tl.zeros([BLOCK_B, BLOCK_O], ACC_DTYPE)
    acc4 = tl.zeros([BLOCK_B, BLOCK_O], ACC_DTYPE)
    acc5 = tl.zeros([BLOCK_B, BLOCK_O], ACC_DTYPE)
    acc6 = tl.zeros([BLOCK_B, BLOCK_O], ACC_DTYPE)
    acc7 = tl.zeros([BLOCK_B, BLOCK_O], ACC_DTYPE)
    # features-first [BLOCK_K, BLOCK_B] tiles of one mode; K step k0 adds k0 stride_x_k
    x_base = x_ptr + offs_kk[:, None] * stride_x_k + offs_b[None, :] * stride_x_b
    if PREFETCH and not SPLIT:
        n0, n1, n2, n3, n4, n5, n6, n7 = _x_tiles(
            x_base,
            offs_m,
            x_base,
            (offs_kk[:, None] < K) & mask_b[None, :],
            stride_x_m,
            N_ANG,
            False,
        )
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kk
        mask_k = offs_k < K
        if SPLIT:  # 1. one contiguous [BLOCK_K, NA_PAD, BLOCK_B] tile of x, split
            x_ptrs = (
                x_ptr
                + offs_k[:, None, None] * stride_x_k
                + offs_m[None, :, None] * stride_x_m
                + offs_b[None, None, :] * stride_x_b
            )
            x_mask = (
                mask_k[:, None, None] & mask_m[None, :, None] & mask_b[None, None, :]
            )
            t3 = tl.load(x_ptrs, mask=x_mask, other=0.0)
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_tiles(
                t3, offs_m, x_base, x_mask, stride_x_m, N_ANG, True
            )
        elif PREFETCH:  # 1. this step's tiles came last step; load the next one's
            x0, x1, x2, x3, x4, x5, x6, x7 = n0, n1, n2, n3, n4, n5, n6, n7
            n0, n1, n2, n3, n4, n5, n6, n7 = _x_tiles(
                x_base,
                offs_m,
                x_base + (k0 + BLOCK_K) * stride_x_k,
                ((offs_kk[:, None] + k0 + BLOCK_K) < K) & mask_b[None, :],
                stride_x_m,
                N_ANG,
                False,
            )
        else:  # 1. each mode's strided [BLOCK_K, BLOCK_B] tile
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_tiles(
                x_base,
                offs_m,
                x_base + k0 * stride_x_k,
                mask_k[:, None] & mask_b[None, :],
                stride_x_m,
                N_ANG,
                False,
            )
        # 2. one true dot per mode against W[m]^T, [BLOCK_K, BLOCK_O]
        w_ptrs = w_ptr + offs_k[:, None] * stride_w_k + offs_o[None, :] * stride_w_o
        w_mask = mask_k[:, None] & mask_o[None, :]
        acc0 = _mode_dot(
            x0, w_ptrs, w_mask, stride_w_m, w_desc, o0, k0, acc0, 0,
            PRECISION, UPCAST, W_DESC,
        )  # fmt: skip
        if N_ANG > 1:
            acc1 = _mode_dot(
                x1, w_ptrs, w_mask, stride_w_m, w_desc, o0, k0, acc1, 1,
                PRECISION, UPCAST, W_DESC,
            )  # fmt: skip
        if N_ANG > 2:
            acc2 = _mode_dot(
                x2, w_ptrs, w_mask, stride_w_m, w_desc, o0, k0, acc2, 2,
                PRECISION, UPCAST, W_DESC,
            )  # fmt: skip
        if N_ANG > 3:
            acc3 = _mode_dot(
                x3, w_ptrs, w_mask, stride_w_m, w_desc, o0, k0, acc3, 3,
                PRECISION, UPCAST, W_DESC,
            )  # fmt: skip
        if N_ANG > 4:
            acc4 = _mode_dot(
                x4, w_ptrs, w_mask, stride_w_m, w_desc, o0, k0, acc4, 4,
                PRECISION, UPCAST, W_DESC,
            )  # fmt: skip
        if N_ANG > 5:
            acc5 = _mode_dot(
                x5, w_ptrs, w_mask, stride_w_m, w_desc, o0, k0, acc5, 5,
                PRECISION, UPCAST, W_DESC,
            )  # fmt: skip
        if N_ANG > 6:
            acc6 = _mode_dot(
                x6, w_ptrs, w_mask, stride_w_m, w_desc, o0, k0, acc6, 6,
                PRECISION, UPCAST, W_DESC,
            )  # fmt: skip
        if N_ANG > 7:
            acc7 = _mode_dot(
                x7, w_ptrs, w_mask, stride_w_m, w_desc, o0, k0, acc7, 7,
                PRECISION, UPCAST, W_DESC,
            )  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_o, mask=mask_o, other=0.0).to(ACC_DTYPE)
        acc0 += bias[None, :]
    if STORE3 and JOIN and N_ANG > 1 and N_ANG <= 4:  # 3. one [BO, BB, NA_PAD] store
        ty = y_ptr.dtype.element_ty
        y3 = _join_modes(
            tl.trans(acc0).to(ty),
            tl.trans(acc1).to(ty),
            tl.trans(acc2).to(ty),
            tl.trans(acc3).to(ty),
            N_ANG,
        )
        y_ptrs = (
            y_ptr
            + offs_o[:, None, None] * stride_y_o
            + offs_b[None, :, None] * stride_y_b
            + offs_m[None, None, :] * stride_y_m
        )
        y_mask = mask_o[:, None, None] & mask_b[None, :, None] & mask_m[None, None, :]
        tl.store(y_ptrs, y3, mask=y_mask)
    elif SPLIT or STORE3:  # 3. interleave the modes in registers; one [BO, NA_PAD, BB]
        sel = offs_m[None, :, None]  # store
        y3 = tl.where(sel == 0, tl.trans(acc0)[:, None, :], 0.0)
        if N_ANG > 1:
            y3 += tl.where(sel == 1, tl.trans(acc1)[:, None, :], 0.0)
        if N_ANG > 2:
            y3 += tl.where(sel == 2, tl.trans(acc2)[:, None, :], 0.0)
        if N_ANG > 3:
            y3 += tl.where(sel == 3, tl.trans(acc3)[:, None, :], 0.0)
        if N_ANG > 4:
            y3 += tl.where(sel == 4, tl.trans(acc4)[:, None, :], 0.0)
        if N_ANG > 5:
            y3 += tl.where(sel == 5, tl.trans(acc5)[:, None, :], 0.0)
        if N_ANG > 6:
            y3 += tl.where(sel == 6, tl.trans(acc6)[:, None, :], 0.0)
        if N_ANG > 7:
            y3 += tl.where(sel == 7, tl.trans(acc7)[:, None, :], 0.0)
        y_ptrs = (
            y_ptr
            + offs_o[:, None, None] * stride_y_o
            + offs_m[None, :, None] * stride_y_m
            + offs_b[None, None, :] * stride_y_b
        )
        y_mask = mask_o[:, None, None] & mask_m[None, :, None] & mask_b[None, None, :]
        tl.store(y_ptrs, y3.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:  # 3. one strided [BO, BB] store per mode
        yp = y_ptr + offs_o[:, None] * stride_y_o + offs_b[None, :] * stride_y_b
        ym = mask_o[:, None] & mask_b[None, :]
        ty = y_ptr.dtype.element_ty
        tl.store(yp, tl.trans(acc0).to(ty), mask=ym)
        if N_ANG > 1:
            tl.store(yp + stride_y_m, tl.trans(acc1).to(ty), mask=ym)
        if N_ANG > 2:
            tl.store(yp + 2 * stride_y_m, tl.trans(acc2).to(ty), mask=ym)
        if N_ANG > 3:
            tl.store(yp + 3 * stride_y_m, tl.trans(acc3).to(ty), mask=ym)
        if N_ANG > 4:
            tl.store(yp + 4 * stride_y_m, tl.trans(acc4).to(ty), mask=ym)
        if N_ANG > 5:
            tl.store(yp + 5 * stride_y_m, tl.trans(acc5).to(ty), mask=ym)
        if N_ANG > 6:
            tl.store(yp + 6 * stride_y_m, tl.trans(acc6).to(ty), mask=ym)
        if N_ANG > 7:
            tl.store(yp + 7 * stride_y_m, tl.trans(acc7).to(ty), mask=ym)


@triton.jit
def _eqlin_fwd_bdot_kernel(
    # pointers
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    # sizes
    B,
    K,
    O,
    # strides
    stride_x_b,
    stride_x_k,
    stride_x_m,
    stride_w_m,
    stride_w_o,
    stride_w_k,
    stride_y_b,
    stride_y_o,
    stride_y_m,
    # meta-parameters
    N_ANG: tl.constexpr,
    NA_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_O: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    """The same tile as ``_eqlin_fwd_kernel``, with the modes as the batch axis of one
    3-D dot: ``[NA, BB, BK] @ [NA, BK, BO]``; the tile is permuted, not split."""
    pid_o = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_b = pid_b.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_m = tl.arange(0, NA_PAD)
    mask_b = offs_b < B
    mask_o = offs_o < O
    mask_m = offs_m < N_ANG
    acc = tl.zeros([NA_PAD, BLOCK_B, BLOCK_O], ACC_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x3 = tl.load(
            x_ptr
            + offs_k[:, None, None] * stride_x_k
            + offs_m[None, :, None] * stride_x_m
            + offs_b[None, None, :] * stride_x_b,
            mask=mask_k[:, None, None] & mask_m[None, :, None] & mask_b[None, None, :],
            other=0.0,
        )  # [BK, NA, BB]: contiguous rows of K * n_ang, features first
        w3 = tl.load(
            w_ptr
            + offs_m[:, None, None] * stride_w_m
            + offs_k[None, :, None] * stride_w_k
            + offs_o[None, None, :] * stride_w_o,
            mask=mask_m[:, None, None] & mask_k[None, :, None] & mask_o[None, None, :],
            other=0.0,
        )  # [NA, BK, BO]
        xm = tl.permute(x3, (1, 2, 0))  # [NA, BB, BK]
        if UPCAST:
            xm = xm.to(tl.float32)
            w3 = w3.to(tl.float32)
        else:
            xm = xm.to(w3.dtype)
        acc = tl.dot(xm, w3, acc, input_precision=PRECISION, out_dtype=ACC_DTYPE)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_o, mask=mask_o, other=0.0).to(ACC_DTYPE)
        acc += tl.where(offs_m[:, None, None] == 0, bias[None, None, :], 0.0)
    y3 = tl.permute(acc, (2, 0, 1))  # [BO, NA, BB]
    tl.store(
        y_ptr
        + offs_o[:, None, None] * stride_y_o
        + offs_m[None, :, None] * stride_y_m
        + offs_b[None, None, :] * stride_y_b,
        y3.to(y_ptr.dtype.element_ty),
        mask=mask_o[:, None, None] & mask_m[None, :, None] & mask_b[None, None, :],
    )


@triton.jit
def _mode_outer(
    g3,
    x3,
    offs_m,
    g_ptrs2,
    g_mask2,
    stride_g_m,
    x_ptrs2,
    x_mask2,
    stride_x_m,
    acc,
    m: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """``acc + g[:, :, m]^T @ x[:, :, m]``: ``[BLOCK_O, BLOCK_K]``."""
    gm = _mode_of(g3, offs_m, g_ptrs2, g_mask2, stride_g_m, m, SPLIT)  # [BO, BB]
    xm = tl.trans(_mode_of(x3, offs_m, x_ptrs2, x_mask2, stride_x_m, m, SPLIT))
    if UPCAST:
        gm = gm.to(tl.float32)
        xm = xm.to(tl.float32)
    else:
        gm = gm.to(g_ptrs2.dtype.element_ty)
        xm = xm.to(x_ptrs2.dtype.element_ty)
    return tl.dot(gm, xm, acc, input_precision=PRECISION, out_dtype=acc.dtype)


@triton.jit
def _eqlin_bwd_w_kernel(
    # pointers
    gc_ptr,
    gs_ptr,
    xc_ptr,
    xs_ptr,
    part_ptr,
    # sizes
    B,
    K,
    O,
    ROWS_PER_CHUNK,
    # strides (g and x as (B, O|K, n_ang), same strides for cos and sin)
    stride_g_b,
    stride_g_o,
    stride_g_m,
    stride_x_b,
    stride_x_k,
    stride_x_m,
    stride_p_c,
    stride_p_m,
    stride_p_o,
    # meta-parameters
    N_ANG: tl.constexpr,
    NA_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_O: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Partial ``dW[m, o, k]`` over one chunk of rows: ``part[chunk, m, o, k]``.

    A fixed chunk per program and a sum over chunks afterwards: the same order of
    summation on every run (deterministic), no atomics."""
    pid_c = tl.program_id(0)
    pid_o = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, NA_PAD)
    mask_o = offs_o < O
    mask_k = offs_k < K
    mask_m = offs_m < N_ANG
    acc0 = tl.zeros([BLOCK_O, BLOCK_K], ACC_DTYPE)
    acc1 = tl.zeros([BLOCK_O, BLOCK_K], ACC_DTYPE)
    acc2 = tl.zeros([BLOCK_O, BLOCK_K], ACC_DTYPE)
    acc3 = tl.zeros([BLOCK_O, BLOCK_K], ACC_DTYPE)
    acc4 = tl.zeros([BLOCK_O, BLOCK_K], ACC_DTYPE)
    acc5 = tl.zeros([BLOCK_O, BLOCK_K], ACC_DTYPE)
    acc6 = tl.zeros([BLOCK_O, BLOCK_K], ACC_DTYPE)
    acc7 = tl.zeros([BLOCK_O, BLOCK_K], ACC_DTYPE)
    row0 = pid_c.to(tl.int64) * ROWS_PER_CHUNK
    for r in range(0, ROWS_PER_CHUNK, BLOCK_B):
        offs_b = row0 + r + tl.arange(0, BLOCK_B)
        mask_b = offs_b < B
        g_off = (
            offs_o[:, None, None] * stride_g_o
            + offs_m[None, :, None] * stride_g_m
            + offs_b[None, None, :] * stride_g_b
        )
        g_mask = mask_o[:, None, None] & mask_m[None, :, None] & mask_b[None, None, :]
        x_off = (
            offs_k[:, None, None] * stride_x_k
            + offs_m[None, :, None] * stride_x_m
            + offs_b[None, None, :] * stride_x_b
        )
        x_mask = mask_k[:, None, None] & mask_m[None, :, None] & mask_b[None, None, :]
        g_off2 = offs_o[:, None] * stride_g_o + offs_b[None, :] * stride_g_b
        g_mask2 = mask_o[:, None] & mask_b[None, :]
        x_off2 = offs_k[:, None] * stride_x_k + offs_b[None, :] * stride_x_b
        x_mask2 = mask_k[:, None] & mask_b[None, :]
        for part in tl.static_range(2):  # cos, then sin
            if part == 0:
                g_ptrs2 = gc_ptr + g_off2
                x_ptrs2 = xc_ptr + x_off2
                if SPLIT:
                    g3 = tl.load(gc_ptr + g_off, mask=g_mask, other=0.0)
                    x3 = tl.load(xc_ptr + x_off, mask=x_mask, other=0.0)
            else:
                g_ptrs2 = gs_ptr + g_off2
                x_ptrs2 = xs_ptr + x_off2
                if SPLIT:
                    g3 = tl.load(gs_ptr + g_off, mask=g_mask, other=0.0)
                    x3 = tl.load(xs_ptr + x_off, mask=x_mask, other=0.0)
            if not SPLIT:
                g3 = g_ptrs2  # unused
                x3 = x_ptrs2
            acc0 = _mode_outer(
                g3,
                x3,
                offs_m,
                g_ptrs2,
                g_mask2,
                stride_g_m,
                x_ptrs2,
                x_mask2,
                stride_x_m,
                acc0,
                0,
                PRECISION,
                UPCAST,
                SPLIT,
            )
            if N_ANG > 1:
                acc1 = _mode_outer(
                    g3,
                    x3,
                    offs_m,
                    g_ptrs2,
                    g_mask2,
                    stride_g_m,
                    x_ptrs2,
                    x_mask2,
                    stride_x_m,
                    acc1,
                    1,
                    PRECISION,
                    UPCAST,
                    SPLIT,
                )
            if N_ANG > 2:
                acc2 = _mode_outer(
                    g3,
                    x3,
                    offs_m,
                    g_ptrs2,
                    g_mask2,
                    stride_g_m,
                    x_ptrs2,
                    x_mask2,
                    stride_x_m,
                    acc2,
                    2,
                    PRECISION,
                    UPCAST,
                    SPLIT,
                )
            if N_ANG > 3:
                acc3 = _mode_outer(
                    g3,
                    x3,
                    offs_m,
                    g_ptrs2,
                    g_mask2,
                    stride_g_m,
                    x_ptrs2,
                    x_mask2,
                    stride_x_m,
                    acc3,
                    3,
                    PRECISION,
                    UPCAST,
                    SPLIT,
                )
            if N_ANG > 4:
                acc4 = _mode_outer(
                    g3,
                    x3,
                    offs_m,
                    g_ptrs2,
                    g_mask2,
                    stride_g_m,
                    x_ptrs2,
                    x_mask2,
                    stride_x_m,
                    acc4,
                    4,
                    PRECISION,
                    UPCAST,
                    SPLIT,
                )
            if N_ANG > 5:
                acc5 = _mode_outer(
                    g3,
                    x3,
                    offs_m,
                    g_ptrs2,
                    g_mask2,
                    stride_g_m,
                    x_ptrs2,
                    x_mask2,
                    stride_x_m,
                    acc5,
                    5,
                    PRECISION,
                    UPCAST,
                    SPLIT,
                )
            if N_ANG > 6:
                acc6 = _mode_outer(
                    g3,
                    x3,
                    offs_m,
                    g_ptrs2,
                    g_mask2,
                    stride_g_m,
                    x_ptrs2,
                    x_mask2,
                    stride_x_m,
                    acc6,
                    6,
                    PRECISION,
                    UPCAST,
                    SPLIT,
                )
            if N_ANG > 7:
                acc7 = _mode_outer(
                    g3,
                    x3,
                    offs_m,
                    g_ptrs2,
                    g_mask2,
                    stride_g_m,
                    x_ptrs2,
                    x_mask2,
                    stride_x_m,
                    acc7,
                    7,
                    PRECISION,
                    UPCAST,
                    SPLIT,
                )
    # part is (n_chunks, n_ang, O, K) contiguous in K
    p_ptrs = (
        part_ptr
        + pid_c.to(tl.int64) * stride_p_c
        + offs_o[:, None] * stride_p_o
        + offs_k[None, :]
    )
    p_mask = mask_o[:, None] & mask_k[None, :]
    tl.store(p_ptrs, acc0, mask=p_mask)
    if N_ANG > 1:
        tl.store(p_ptrs + stride_p_m, acc1, mask=p_mask)
    if N_ANG > 2:
        tl.store(p_ptrs + 2 * stride_p_m, acc2, mask=p_mask)
    if N_ANG > 3:
        tl.store(p_ptrs + 3 * stride_p_m, acc3, mask=p_mask)
    if N_ANG > 4:
        tl.store(p_ptrs + 4 * stride_p_m, acc4, mask=p_mask)
    if N_ANG > 5:
        tl.store(p_ptrs + 5 * stride_p_m, acc5, mask=p_mask)
    if N_ANG > 6:
        tl.store(p_ptrs + 6 * stride_p_m, acc6, mask=p_mask)
    if N_ANG > 7:
        tl.store(p_ptrs + 7 * stride_p_m, acc7, mask=p_mask)


# --------------------------------------------------------------------------------------
# launchers: check, allocate, launch
# --------------------------------------------------------------------------------------
def _precision(dtype: torch.dtype) -> tuple[str, object, bool]:
    """(input_precision, accumulator dtype, upcast operands) for a tensor dtype."""
    if dtype == torch.float64:
        return "ieee", tl.float64, False
    if dtype == torch.float32:
        tf32 = torch.backends.cuda.matmul.allow_tf32 and not INTERPRET
        return ("tf32" if tf32 else "ieee"), tl.float32, False
    return "ieee", tl.float32, INTERPRET  # bf16 / fp16: fp32 accumulation


class Config(NamedTuple):
    """One launch configuration of the kernels."""

    block_b: int
    block_k: int
    block_o: int
    warps: int
    stages: int
    split: bool
    bdot: bool = False  # forward: the 3-D batched-dot kernel
    prefetch: bool = False  # forward: the next K step's x in flight (PREFETCH)
    store3: bool = False  # forward: modes interleaved in registers, one store
    w_desc: bool = False  # forward: W by the bulk copy engine (tensor descriptor)
    join: bool = False  # forward, with store3: interleave by tl.join (n_ang 2-4)
    fma: str = ""  # strict-fp32 forward: the Gluon FMA kernel's register tile
    tc: bool = False  # forward: linear_tc's kernel where it serves (bf16)


def _config(dtype: torch.dtype, kind: str = "fwd") -> Config:
    """The launch configuration for a dtype and kernel (``fwd`` or ``bwd_w``)."""
    if INTERPRET:
        return Config(16, 16, 16, 1, 1, SPLIT)
    if dtype == torch.float64:
        return Config(32, 16, 32, 4, STAGES, SPLIT)
    if kind == "fwd":  # the fastest forward launches of chapter 2's launch sweep
        if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
            return FP32_FMA  # the Gluon kernel where it serves, else FP32_TRITON
        if dtype == torch.float32:  # TF32: prefetch, one joined store, W by descriptor
            return TF32_TRITON
        if dtype == torch.bfloat16:
            return BF16_TC  # the modes split on the tensor cores, where it serves
        return Config(64, 32, 64, 4, 2, SPLIT, False, True, False, True)  # fp16
    # the weight-gradient kernel: on CUDA only fp64 runs it (above); every other
    # dtype takes the GEMM (``_bwd_w_by_gemm``) and reaches this launch only where a
    # benchmark forces the kernel
    return Config(64, 32, 64, 4, STAGES, SPLIT)


#: Strict fp32: the Gluon kernel of :mod:`ecekern.linear_fma` (64 x 64 programs, an
#: 8 x 4 register tile per thread and mode) where it serves the call (n_ang = 3, rows
#: of x contiguous), else the Triton kernel at its fastest launch of chapter 2's
#: launch sweep (874 us at c2b3968, against 325 us for the Gluon kernel in session
#: 8's run 3, history session8_fma2_*.csv; both one of cos/sin at E = 47k).
FP32_FMA = Config(64, 16, 64, 4, 1, False, fma="8x4")
FP32_TRITON = Config(64, 32, 64, 4, 2, SPLIT)
#: bf16: the Gluon kernel of :mod:`ecekern.linear_tc` (the modes split by a
#: ``wgmma`` against 0/1 matrices, W kept in shared memory) where it serves the call
#: (n_ang = 3, K and O multiples of 64, K <= 256, contiguous x and w), else the
#: Triton kernel at this launch (prefetch, W by descriptor; chapter 2's launch
#: sweep). 59 against 115 us (E = 47k, one of cos/sin; launch sweep at 054b254).
BF16_TC = Config(64, 32, 64, 4, 2, SPLIT, False, True, False, True, tc=True)
#: TF32: the Triton kernel at its fastest launch of chapter 2's launch sweep (prefetch,
#: one joined store, W by descriptor). linear_tc's TF32 version (``tc=True``) is
#: slower: 157 against 145 us (E = 47k, one of cos/sin; launch sweep at 054b254).
TF32_TRITON = Config(64, 32, 64, 4, 2, SPLIT, False, True, True, True, True)


def _reads_w_t_in_place(dtype: torch.dtype) -> bool:
    """Whether the input backward reads W^T where it lies (``_w_descriptor``'s mode
    2) or from a contiguous copy: a copy in TF32 (see ``_w_descriptor``). The one rule
    for the launcher and for the backward, which makes the copy once for cos and
    sin (the backward also copies where :mod:`ecekern.linear_tc` will read W^T,
    ``_tc_input_backward``)."""
    return _precision(dtype)[0] != "tf32"


def _w_descriptor(w: torch.Tensor, BO: int, BK: int, transposed: bool = True):
    """``(w, descriptor, W_DESC)`` for W ``(n_ang, O, K)``: W_DESC 1, a descriptor of
    W with ``[1, BO, BK]`` blocks (W made contiguous first if it is not); W_DESC 2
    where W is the transpose of a contiguous tensor (the input backward's W^T) and
    ``transposed`` allows it, a descriptor of that tensor with ``[1, BK, BO]`` blocks,
    no copy; ``(w, None, 0)`` where the bulk copy engine cannot serve it: strides or
    base not 16-byte aligned, or Triton without host-side descriptors. Every way the
    kernel computes the same thing (pointers for 0). The launcher passes
    ``transposed=False`` for TF32: its wgmma wants W's tile K-major, Triton turns a
    mode-2 tile around in shared memory in every program, and that cost 58 % more
    time than copying W^T once (history session7_tx_144d813.csv: 231.6 against
    146.6 us at 47k rows, 442 KB copied)."""
    if TensorDescriptor is None:
        return w, None, 0
    s = w.element_size()
    w_t = w.transpose(1, 2)
    if transposed and w_t.is_contiguous() and not w.is_contiguous():
        if w_t.data_ptr() % 16 or (w_t.stride(1) * s) % 16 or (BO * s) % 16:
            return w, None, 0
        return w, TensorDescriptor.from_tensor(w_t, [1, BK, BO]), 2
    w = w.contiguous()
    if w.data_ptr() % 16 or (w.stride(1) * s) % 16 or (BK * s) % 16:
        return w, None, 0
    return w, TensorDescriptor.from_tensor(w, [1, BO, BK]), 1


def eqlin_fwd(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``y[b, o, m] = sum_k x[b, k, m] w[m, o, k] (+ bias[o] at m = 0)`` for a 3-D x
    ``(B, K, n_ang)`` of any strides and a w ``(n_ang, O, K)`` of any strides."""
    B, K, n_ang = x.shape
    O = w.shape[1]
    y = torch.empty((B, O, n_ang), device=x.device, dtype=x.dtype)
    if B == 0 or O == 0:
        return y
    if K == 0:
        y.zero_()
        if bias is not None:
            y[:, :, 0] += bias
        return y
    cfg = _config(x.dtype, "fwd")
    if cfg.fma:  # strict fp32: the Gluon FMA kernel, where it serves the call
        if linear_fma.fma_reason(x, w) is None:
            if w.stride(1) != 1:  # it reads W with O contiguous: the kept W^T
                w = _w_t_copy(w).transpose(1, 2)
            return linear_fma.fma_fwd(x, w, bias, cfg.fma)
        cfg = FP32_TRITON
    if cfg.tc:  # the tensor cores split the modes (bf16's config), where it serves
        if linear_tc.tc_reason(x, w) is None:
            return linear_tc.tc_fwd(x, w, bias)
        cfg = cfg._replace(tc=False)
    BB, BK, BO, warps, stages, split, bdot = cfg[:7]
    # the launches are chosen at n_ang = 3; the accumulators and x tiles grow with
    # n_ang, so fewer rows per program keep the registers of one program about the
    # same (offline sm_90 builds of 64 rows or 64 features spill at n_ang = 4, 5)
    if n_ang > 3:
        BB, BK = max(16, BB // (2 if n_ang <= 6 else 4)), min(BK, 32)
    precision, acc, upcast = _precision(x.dtype)
    grid = (triton.cdiv(O, BO), triton.cdiv(B, BB))
    if bdot:
        kernel, extra, wd = _eqlin_fwd_bdot_kernel, {}, ()
    else:
        w, desc, w_mode = (
            _w_descriptor(w, BO, BK, transposed=_reads_w_t_in_place(x.dtype))
            if cfg.w_desc
            else (w, None, 0)
        )
        kernel, wd = _eqlin_fwd_kernel, (desc if desc is not None else w,)
        extra = dict(
            SPLIT=split,
            PREFETCH=cfg.prefetch,
            STORE3=cfg.store3,
            W_DESC=w_mode,
            JOIN=cfg.join,
        )
    kernel[grid](
        x,
        w,
        *wd,
        bias if bias is not None else w,
        y,
        B,
        K,
        O,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        N_ANG=n_ang,
        NA_PAD=triton.next_power_of_2(n_ang),
        HAS_BIAS=bias is not None,
        BLOCK_B=BB,
        BLOCK_K=BK,
        BLOCK_O=BO,
        PRECISION=precision,
        UPCAST=upcast,
        ACC_DTYPE=acc,
        **extra,
        num_warps=warps,
        num_stages=stages,
    )
    return y


def _bwd_w_by_gemm(x: torch.Tensor) -> bool:
    """Whether the weight gradient runs as :func:`_bwd_w_gemm`: on CUDA in every
    dtype but fp64. Cos and sin together at F = 192, n_ang = 3, against the Triton
    reduction kernel (history ``session8_bwd_w_043bf46.csv`` and
    ``session9_bwd_w_9246eff.csv``): strict fp32 1.47 against 18.08 ms at E = 47k
    (11.1 against 140.7 at 365k), TF32 0.45 against 0.81 (3.06 against 6.02), bf16
    0.12 against 0.44 (0.77 against 3.18)."""
    return x.is_cuda and x.dtype != torch.float64 and not INTERPRET


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 16-bit ``a, b`` with the fp32 sums kept (``torch.mm``'s
    ``out_dtype``, CUDA); a torch without it rounds the product to the input dtype
    once and widens it."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except TypeError:  # torch without mm(..., out_dtype)
        return torch.mm(a, b).float()


def _bwd_w_gemm(gc, gs, xc, xs) -> torch.Tensor:
    """The weight gradient as the block diagonal of one GEMM per cos and sin over
    the flattened (feature, mode) axes: ``M = g2^T x2`` with ``g2 = g (B, O n)`` and
    ``x2 = x (B, K n)`` (views of contiguous g and x), ``dW[m, o, k] =
    M[o n + m, k n + m]``.
    n_ang times the flops, on cuBLAS's tuned GEMM, deterministic; M is summed in
    fp32 for 16-bit inputs too, and rounded once, like the Triton reduction."""
    B, O, n = gc.shape
    K = xc.shape[1]
    (g2c, x2c), (g2s, x2s) = (
        (g.reshape(B, O * n).t(), x.reshape(B, K * n)) for g, x in ((gc, xc), (gs, xs))
    )
    if gc.dtype in (torch.bfloat16, torch.float16):
        m = _mm_fp32(g2c, x2c)
        m += _mm_fp32(g2s, x2s)
    else:
        m = g2c @ x2c
        m.addmm_(g2s, x2s)
    d = m.view(O, n, K, n).diagonal(dim1=1, dim2=3).permute(2, 0, 1)
    return d.to(gc.dtype).contiguous()


def eqlin_bwd_w(gc, gs, xc, xs) -> torch.Tensor:
    """``dW[m, o, k] = sum_b gc[b, o, m] xc[b, k, m] + gs[b, o, m] xs[b, k, m]``,
    deterministic: fixed chunks of rows, then a sum over chunks in a fixed order (or,
    on CUDA outside fp64, :func:`_bwd_w_gemm`)."""
    B, O, n_ang = gc.shape
    K = xc.shape[1]
    acc_dtype = torch.float64 if xc.dtype == torch.float64 else torch.float32
    if B == 0 or K == 0 or O == 0:
        return torch.zeros((n_ang, O, K), device=xc.device, dtype=xc.dtype)
    if _bwd_w_by_gemm(xc):
        return _bwd_w_gemm(gc, gs, xc, xs)
    BB, BK, BO, warps, stages, split = _config(xc.dtype, "bwd_w")[:6]
    rows = (
        max(BB, triton.cdiv(triton.cdiv(B, 64), BB) * BB) if not INTERPRET else 4 * BB
    )
    chunks = triton.cdiv(B, rows)
    # the x strides must match between cos and sin, and the g strides likewise
    if xs.stride() != xc.stride():
        xs = xs.contiguous()
        xc = xc.contiguous()
    if gs.stride() != gc.stride():
        gs = gs.contiguous()
        gc = gc.contiguous()
    part = torch.empty((chunks, n_ang, O, K), device=xc.device, dtype=acc_dtype)
    precision, acc, upcast = _precision(xc.dtype)
    grid = (chunks, triton.cdiv(O, BO), triton.cdiv(K, BK))
    _eqlin_bwd_w_kernel[grid](
        gc,
        gs,
        xc,
        xs,
        part,
        B,
        K,
        O,
        rows,
        gc.stride(0),
        gc.stride(1),
        gc.stride(2),
        xc.stride(0),
        xc.stride(1),
        xc.stride(2),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        N_ANG=n_ang,
        NA_PAD=triton.next_power_of_2(n_ang),
        BLOCK_B=BB,
        BLOCK_K=BK,
        BLOCK_O=BO,
        PRECISION=precision,
        UPCAST=upcast,
        ACC_DTYPE=acc,
        SPLIT=split,
        num_warps=warps,
        num_stages=stages,
    )
    return part.sum(0).to(xc.dtype)


# --------------------------------------------------------------------------------------
# the transposed weight, kept while the weight does not change
# --------------------------------------------------------------------------------------
#: id(weight) -> (weakref to weight, (version, data_ptr, shape, stride), W^T copy)
_W_T: dict[int, tuple] = {}


def _w_t_copy(weight: torch.Tensor) -> torch.Tensor:
    """``weight.transpose(1, 2).contiguous()``, ``(n_ang, K, O)``, made once per
    weight and kept until the weight changes. The strict-fp32 forward reads it as
    W with O contiguous (the FMA kernel's tile), the TF32 input backward as a
    contiguous W^T (wgmma's K-major tile); without the cache every force step copied
    each layer's weight (442 KB at F = 192) in one of the two, the only
    ``aten::copy_`` left of this layer.

    The copy is reused only for the same tensor object at the same version counter
    (every in-place change bumps it), storage address, shape and strides, and an
    entry leaves with its weight. While a CUDA graph is being captured nothing is
    cached: a replay runs no Python, so the copy must be inside the graph to follow
    in-place updates of the weight between replays."""
    capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
    key = id(weight)
    state = (weight._version, weight.data_ptr(), weight.shape, weight.stride())
    hit = _W_T.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == state and not capturing:
        return hit[2]
    with torch.no_grad():
        w_t = weight.detach().transpose(1, 2).contiguous()
    if not capturing:
        ref = weakref.ref(weight, lambda _, k=key: _W_T.pop(k, None))
        _W_T[key] = (ref, state, w_t)
    return w_t


# --------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------
def _tc_input_backward(g: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the input backward (``g (B, O, n_ang)`` against W^T) can run the
    kernel of :mod:`ecekern.linear_tc`, which takes W^T contiguous: then the
    backward passes the kept copy (``_w_t_copy``)."""
    n_ang, O, K = weight.shape
    return _config(weight.dtype).tc and (
        linear_tc.shape_reason(g.dtype, n_ang, O, K, g.device.type) is None
    )


def _grad_node(t: torch.Tensor):
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or for a
    leaf (a parameter) its ``AccumulateGrad`` node; None if t does not require grad."""
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]


def _engine_uses(node) -> bool:
    """Whether the running backward pass will execute ``node``: False when
    ``torch.autograd.grad`` asks for other inputs only (forces ask for positions,
    not weights), True for ``.backward()`` and wherever PyTorch cannot say.
    ``ctx.needs_input_grad`` only says whether an input requires grad."""
    will = getattr(torch._C, "_will_engine_execute_node", None)
    if node is None or will is None:
        return node is not None
    try:
        return bool(will(node))
    except RuntimeError:  # not inside a backward pass of the autograd engine
        return True


def _bias_grad(g_cos: torch.Tensor) -> torch.Tensor:
    """The bias's gradient, ``(O,)``: g_cos's m = 0 slots summed over the rows."""
    return g_cos[:, :, 0].sum(0)


class _EquivariantLinearFn(torch.autograd.Function):
    """Forward and first derivatives by the kernels; the backward is itself built from
    this Function (dx) and an einsum (dW), so it is differentiable again."""

    @staticmethod
    def forward(ctx, x_cos, x_sin, weight, bias):
        ctx.save_for_backward(x_cos, x_sin, weight)
        ctx.has_bias = bias is not None
        ctx.w_node = _grad_node(weight)
        ctx.b_node = _grad_node(bias) if bias is not None else None
        return eqlin_fwd(x_cos, weight, bias), eqlin_fwd(x_sin, weight, None)

    @staticmethod
    def backward(ctx, g_cos, g_sin):
        x_cos, x_sin, weight = ctx.saved_tensors
        dx_cos = dx_sin = dw = db = None
        # a force step asks autograd for d(energy)/d(positions) only: the weight
        # gradient, the costliest kernel of the backward, is then not computed
        want_w = ctx.needs_input_grad[2] and _engine_uses(ctx.w_node)
        # and the bias's, a strided pass over all of g_cos: skipped the same way
        want_b = ctx.has_bias and ctx.needs_input_grad[3] and _engine_uses(ctx.b_node)
        w_t = weight.transpose(1, 2)  # (n_ang, K, O): the same kernel, strides swapped
        if torch.is_grad_enabled():  # double backward: stay differentiable
            if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
                dx_cos, dx_sin = _EquivariantLinearFn.apply(g_cos, g_sin, w_t, None)
            if want_w:
                dw = torch.einsum("bom,bkm->mok", g_cos, x_cos) + torch.einsum(
                    "bom,bkm->mok", g_sin, x_sin
                )
        else:
            if any(ctx.needs_input_grad[:2]) and (
                not _reads_w_t_in_place(weight.dtype)
                or _tc_input_backward(g_cos, weight)
            ):  # TF32's wgmma wants W^T's tile K-major; linear_tc a contiguous W^T
                w_t = _w_t_copy(weight)
            if ctx.needs_input_grad[0]:
                dx_cos = eqlin_fwd(g_cos, w_t, None)
            if ctx.needs_input_grad[1]:
                dx_sin = eqlin_fwd(g_sin, w_t, None)
            if want_w:
                dw = eqlin_bwd_w(g_cos, g_sin, x_cos, x_sin)
        if want_b:
            db = _bias_grad(g_cos)
        return dx_cos, dx_sin, dw, db


# --------------------------------------------------------------------------------------
# public function and module
# --------------------------------------------------------------------------------------
def _dense(x_cos, x_sin, weight, bias):
    """One row-major GEMM against the per-m block-diagonal weight.

    The weight is built transposed, ``w_t[o n_ang + n, k n_ang + m] = W[m, o, k]
    (m == n)``, one contiguous ``(O, K, n_ang)`` slab per mode stacked along a new
    axis: no permute and so no copy, forward or backward (an einsum or a reshape of a
    permuted weight costs two ``aten::copy_`` per call). The GEMM reads it transposed,
    which cuBLAS does for free."""
    n_ang, O, K = weight.shape
    lead = x_cos.shape[:-2]
    eye = torch.eye(n_ang, dtype=weight.dtype, device=weight.device)
    w_t = torch.stack(
        [w_m[:, :, None] * eye[m] for m, w_m in enumerate(weight.unbind(0))], dim=1
    ).reshape(O * n_ang, K * n_ang)
    xc = x_cos.reshape(-1, K * n_ang)
    xs = x_sin.reshape(-1, K * n_ang)
    if bias is not None:
        b_bd = (bias[:, None] * eye[0]).reshape(-1)  # on the m = 0 slots only
        y_cos = torch.addmm(b_bd, xc, w_t.t())
    else:
        y_cos = xc @ w_t.t()
    y_sin = xs @ w_t.t()
    return y_cos.reshape(*lead, O, n_ang), y_sin.reshape(*lead, O, n_ang)


def _tc_serves(x_cos, x_sin, weight) -> bool:
    """Whether :mod:`ecekern.linear_tc` will take both forwards' operands as they
    lie (``linear_tc.operand_reason``; the shape is ``auto_path``'s to check)."""
    return all(linear_tc.operand_reason(x, weight) is None for x in (x_cos, x_sin))


def _triton_reason(x_cos, weight) -> str | None:
    """Why the Triton path cannot serve this call, or None."""
    if not getattr(triton, "AVAILABLE", True):
        return "Triton is not installed on this platform"
    if x_cos.device.type == "cpu" and not INTERPRET:
        return (
            "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before import)"
        )
    if x_cos.device.type not in ("cpu", "cuda"):
        return f"device {x_cos.device.type} is not supported"
    n_ang = weight.shape[0]
    if n_ang > MAX_N_ANG:
        return f"n_ang = {n_ang} > {MAX_N_ANG}"
    if x_cos.device.type == "cuda" and n_ang > CUDA_VALIDATED.get(x_cos.dtype, 0):
        return (
            f"{x_cos.dtype} with n_ang = {n_ang} is not validated on CUDA "
            "(wrong results seen on the H200; see ecekern.linear's status)"
        )
    return None


#: ``path="auto"``, from chapter 2's H200 capture (``book/captures/
#: 02_block_diagonal_gemm``; E = 47k, F = 192, cos and sin, GPU time; dense rows at
#: 51554fe, einsum rows at b7b3dea): the dense GEMM beat the einsum by more than 5 %
#: wherever its GEMM ran on tensor cores, at every n_ang measured (TF32: 0.13 / 0.24
#: / 0.35 / 0.57 ms against 0.41 / 0.54 / 0.76 / 1.03 ms at n_ang = 2..5; bf16: 0.08
#: / 0.13 / 0.19 / 0.28 against 0.23 / 0.36 / 0.49 / 0.66 ms) and lost or tied in
#: strict fp32, where it does n_ang times the flops on the FMA units (1.43 against
#: 0.97 ms at n_ang = 3; 0.70 against 0.69 ms at n_ang = 2). ``auto`` serves the
#: force step, so the Triton path is taken where its force step is the fastest:
#: strict fp32 at n_ang = 3, on the Gluon FMA kernel (8bd266f: 203.1 against 228.1 ms
#: for the einsum at 4096 atoms, 33.7 against 34.7 at 512; forward 0.645 against
#: 0.973 ms). In TF32 both its forward (0.284 against 0.238 ms) and its force step
#: (170.3 against 166.2 ms at 4096 atoms) lose to the dense GEMM. In bf16 at
#: n_ang = 3 the Triton path takes ``linear_tc`` where it serves the call's shape
#: (``AUTO_TRITON_TC``): in GPU time its forward, a force step's pattern (the forward
#: and x's gradient) and training's (every gradient) were all faster than the dense
#: GEMM's in every round at 47k and 365k (history
#: ``session13_bf16_fwd_bwd_1557acd.csv``: 0.226 against 0.238 ms for the force
#: pattern at 47k, 1.599 against 1.659 at 365k, medians). Not measured, so left on
#: the einsum: n_ang > 5 on tensor cores, fp16, fp64, any device but CUDA.
AUTO_DENSE = {torch.bfloat16: 5, "tf32": 5}
#: (dtype, n_ang) where ``auto`` takes the Triton path on CUDA (when Triton has
#: Gluon: without it the strict-fp32 forward is the slower Triton kernel).
AUTO_TRITON = {(torch.float32, 3)}
#: (dtype, n_ang) where ``auto`` takes the Triton path on CUDA when
#: :mod:`ecekern.linear_tc` serves the call (its shape, and contiguous, aligned x and
#: W: ``_tc_serves``); where it does not, the Triton kernel would be slower than the
#: dense GEMM, and ``auto`` keeps the dense GEMM.
AUTO_TRITON_TC = {(torch.bfloat16, 3)}


def auto_path(
    device_type: str,
    dtype: torch.dtype,
    n_ang: int,
    tf32: bool,
    K: int | None = None,
    O: int | None = None,
) -> str:
    """The path ``"auto"`` takes for a call: ``"dense"``, ``"triton"`` or
    ``"einsum"``. ``K`` and ``O`` (in and out features) decide where the Triton
    path depends on ``linear_tc`` serving the shape; without them it is not
    taken there."""
    if device_type != "cuda":
        return "einsum"
    if not tf32 and (dtype, n_ang) in AUTO_TRITON and linear_fma.gluon is not None:
        return "triton"
    if (
        (dtype, n_ang) in AUTO_TRITON_TC
        and K is not None
        and O is not None
        and linear_tc.shape_reason(dtype, n_ang, K, O, device_type) is None
    ):
        return "triton"
    key = "tf32" if dtype == torch.float32 and tf32 else dtype
    return "dense" if n_ang <= AUTO_DENSE.get(key, 0) else "einsum"


def equivariant_linear(x_cos, x_sin, weight, bias, path: str = "auto"):
    """Computes the same as :func:`ecekern.reference.equivariant_linear`.

    Args:
        x_cos, x_sin: ``(..., in, n_ang)``, any strides.
        weight: ``(n_ang, out, in)``.
        bias: ``(out,)`` or None.
        path: ``"einsum"``, ``"dense"``, ``"triton"``, or ``"auto"`` (the
            process-wide option :attr:`ecekern.options.Options.linear`, whose
            ``"auto"`` is the measured dispatch of ``ecekern.linear.auto_path``).

    Returns:
        ``y_cos, y_sin``, each ``(..., out, n_ang)``, contiguous.
    """
    if path == "auto":
        path = options.current().linear
    if path not in options.LINEAR_PATHS:
        raise ValueError(f"path must be one of {options.LINEAR_PATHS}, got {path!r}")
    if path == "auto":
        tf32 = torch.backends.cuda.matmul.allow_tf32
        n_ang, O, K = weight.shape
        path = auto_path(x_cos.device.type, x_cos.dtype, n_ang, tf32, K, O)
        if path == "triton" and (x_cos.dtype, n_ang) in AUTO_TRITON_TC:
            if not _tc_serves(x_cos, x_sin, weight):
                path = "dense"  # the Triton kernel would be slower than the GEMM
    if path == "einsum":
        return reference.equivariant_linear(x_cos, x_sin, weight, bias)
    # the reference's checks: shapes, dtypes, devices
    reference._check_equivariant_linear(x_cos, x_sin, weight, bias)
    if path == "dense":
        return _dense(x_cos, x_sin, weight, bias)
    reason = _triton_reason(x_cos, weight)
    if reason is not None:
        options.fallback("equivariant_linear[triton]", reason)
        return reference.equivariant_linear(x_cos, x_sin, weight, bias)
    n_ang, O, K = weight.shape
    lead = x_cos.shape[:-2]
    xc = x_cos if x_cos.dim() == 3 else x_cos.reshape(-1, K, n_ang)
    xs = x_sin if x_sin.dim() == 3 else x_sin.reshape(-1, K, n_ang)
    y_cos, y_sin = _EquivariantLinearFn.apply(xc, xs, weight, bias)
    return y_cos.reshape(*lead, O, n_ang), y_sin.reshape(*lead, O, n_ang)


class EquivariantLinear(nn.Module):
    """SO(2)-equivariant linear map of the angular layout, ``(..., in, n_ang)`` pairs.

    Commutes with rotations about the edge axis: the same ``W[m]`` acts on the cos
    and sin parts of order m; the bias enters only the m = 0 cos slot. The parameters
    ``weight (n_ang, out, in)`` and ``bias (out,)`` are the same for every path, so a
    ``state_dict`` loads across paths unchanged.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        n_ang: int,
        bias: bool = True,
        path: str = "auto",
    ):
        super().__init__()
        for name, v in (
            ("in_features", in_features),
            ("out_features", out_features),
            ("n_ang", n_ang),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if path not in options.LINEAR_PATHS:
            raise ValueError(
                f"path must be one of {options.LINEAR_PATHS}, got {path!r}"
            )
        self.in_features, self.out_features, self.n_ang = (
            in_features,
            out_features,
            n_ang,
        )
        self.path = path
        self.weight = nn.Parameter(torch.empty(n_ang, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.in_features))
        if self.bias is not None:
            nn.init.normal_(self.bias, std=0.1)

    def forward(self, x_cos: torch.Tensor, x_sin: torch.Tensor):
        return equivariant_linear(x_cos, x_sin, self.weight, self.bias, self.path)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"n_ang={self.n_ang}, bias={self.bias is not None}, path={self.path!r}"
        )


def traffic(B: int, K: int, O: int, n_ang: int, elem_size: int) -> dict:
    """The bytes and flops model of one forward call (cos and sin) on B rows.

    ``bytes``: x read once, y written once, W read once; ``flops``: the needed
    multiply-adds of the per-mode products (what the Triton path does);
    ``flops_dense``: what the block-diagonal GEMM does (n_ang times more).
    """
    return {
        "bytes": elem_size * (2 * B * n_ang * (K + O) + n_ang * O * K + O),
        "flops": 2 * 2 * B * K * O * n_ang,
        "flops_dense": 2 * 2 * B * K * O * n_ang * n_ang,
    }
