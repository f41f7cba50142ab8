"""EquivariantLinear's per-mode Triton kernel: one true dot per mode, no zero blocks.

``y[b, o, m] = sum_k x[b, k, m] w[m, o, k] (+ bias[o] at m = 0)``

    x (B, K, n_ang)  any strides
    w (n_ang, O, K)  any strides (the input backward passes W^T, a view)
    y (B, O, n_ang)  contiguous; fp64 (fp64 accumulation), fp32 (IEEE or TF32),
                     bf16 and fp16 (fp32 accumulation)

Each program owns a ``[BLOCK_B, BLOCK_O]`` tile of every mode. Per K step it loads each
mode's ``[BLOCK_K, BLOCK_B]`` tile of x (stride n_ang between neighbours, features
first: a warp's threads run along K, where x is contiguous) and does one ``tl.dot`` per
mode against that mode's ``[BLOCK_K, BLOCK_O]`` tile of W. Launch switches
(:class:`TritonLaunch`): ``prefetch`` keeps the next K step's tiles in flight,
``store3`` interleaves the modes in registers for one store, ``join`` builds that tile
with ``tl.join``, ``w_desc`` reads W by the bulk copy engine.

Bytes: ``s B n_ang (K + O)`` for x and y plus W; flops ``2 B K O n_ang``.

Status: n_ang <= ``MAX_N_ANG`` (the model's L <= 4), any B, K, O (masked), int64
offsets of x's rows and modes; runs in Triton's interpreter (bf16 and fp16
dots upcast there, where they are wrong). Serves every case the Gluon kernels do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import INTERPRET, TensorDescriptor, tl, triton

__all__ = ["MAX_N_ANG", "TritonLaunch", "triton_fwd"]

#: The largest n_ang the kernel is written for: the model's degrees go to L = 4.
MAX_N_ANG = 5


@dataclass(frozen=True)
class TritonLaunch:
    """A launch of :func:`triton_fwd`: tile sizes, warps, software-pipelining stages
    and the forward's switches (module docstring). Where n_ang > 3 the launcher halves
    the rows and caps BLOCK_K, so the registers of a program stay about the same."""

    block_b: int = 64
    block_k: int = 32
    block_o: int = 64
    warps: int = 4
    stages: int = 2
    prefetch: bool = False
    store3: bool = False
    w_desc: bool = False
    join: bool = False


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _x_tile(ptrs, mask, stride_m, m: tl.constexpr, N_ANG: tl.constexpr):
    """Mode m's ``[BLOCK_K, BLOCK_B]`` tile of one K step, loaded as its own strided
    tile (0.0 past n_ang). Features first: a load's threads go to the tile's first
    axis when the strides do not say which is contiguous, and rows first put a warp's
    32 threads on 32 different rows."""
    x = 0.0
    if m < N_ANG:
        x = tl.load(ptrs + m * stride_m, mask=mask, other=0.0)
    return x


@triton.jit
def _x_tiles(ptrs, mask, stride_m, N_ANG: tl.constexpr):
    """The n_ang mode tiles of one K step (:func:`_x_tile`)."""
    x0 = _x_tile(ptrs, mask, stride_m, 0, N_ANG)
    x1 = _x_tile(ptrs, mask, stride_m, 1, N_ANG)
    x2 = _x_tile(ptrs, mask, stride_m, 2, N_ANG)
    x3 = _x_tile(ptrs, mask, stride_m, 3, N_ANG)
    x4 = _x_tile(ptrs, mask, stride_m, 4, N_ANG)
    return x0, x1, x2, x3, x4


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
    xm, w_tile, acc, m: tl.constexpr, N_ANG: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, W_DESC: tl.constexpr,
):  # fmt: skip
    """``acc + x[:, :, m] @ W[m]^T`` for mode m < n_ang (else acc): one ``[BLOCK_K,
    BLOCK_B]`` tile of x and one ``[BLOCK_K, BLOCK_O]`` tile of W (``w_tile``: its
    pointers, mask and mode stride, W's descriptor, and the tile's origin), loaded by
    pointers (W_DESC 0) or by the bulk copy engine: from W's descriptor, K contiguous
    (1), or from a descriptor of W^T's storage, O contiguous (2: the input backward
    reads W^T without a copy)."""
    if m < N_ANG:
        w_tile_ptrs, w_mask, stride_w_m, w_desc, o0, k0 = w_tile
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
        acc = tl.dot(xm, wm, acc, input_precision=PRECISION, out_dtype=acc.dtype)
    return acc


@triton.jit
def _store_mode(yp, acc, ym, stride_y_m, m: tl.constexpr, N_ANG: tl.constexpr):
    """Mode m's ``[BLOCK_O, BLOCK_B]`` tile of y, strided (stride n_ang)."""
    if m < N_ANG:
        tl.store(yp + m * stride_y_m, tl.trans(acc).to(yp.dtype.element_ty), mask=ym)


@triton.jit
def _eqlin_fwd_kernel(
    # pointers
    x_ptr, w_ptr, w_desc, b_ptr, y_ptr,
    # sizes
    B, K, O,
    # strides
    stride_x_b, stride_x_k, stride_x_m,
    stride_w_m, stride_w_o, stride_w_k,
    stride_y_b, stride_y_o, stride_y_m,
    # meta-parameters
    N_ANG: tl.constexpr, NA_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC_DTYPE: tl.constexpr,
    PREFETCH: tl.constexpr = False, STORE3: tl.constexpr = False,
    W_DESC: tl.constexpr = 0, JOIN: tl.constexpr = False,
):  # fmt: skip
    """One ``[BLOCK_B, BLOCK_O, n_ang]`` output tile of one of cos and sin (each is
    its own launch; the bias only on the cos launch)."""
    pid_o = tl.program_id(0)  # the O tiles of one row block run side by side:
    pid_b = tl.program_id(1)  # x is read from DRAM once, then from L2
    # int64: m times a planes pair's mode stride (2 E F) passes 2^31 from 2.8M edges
    # of F = 192, while the stride itself is an int32 (below 5.6M)
    stride_x_m = tl.cast(stride_x_m, tl.int64)
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
    # features-first [BLOCK_K, BLOCK_B] tiles of one mode; K step k0 adds k0 stride_x_k
    x_base = x_ptr + offs_kk[:, None] * stride_x_k + offs_b[None, :] * stride_x_b
    if PREFETCH:
        n0, n1, n2, n3, n4 = _x_tiles(
            x_base, (offs_kk[:, None] < K) & mask_b[None, :], stride_x_m, N_ANG
        )
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kk
        mask_k = offs_k < K
        # 1. each mode's strided [BLOCK_K, BLOCK_B] tile of x
        if PREFETCH:  # this step's tiles came last step; load the next one's
            x0, x1, x2, x3, x4 = n0, n1, n2, n3, n4
            n0, n1, n2, n3, n4 = _x_tiles(
                x_base + (k0 + BLOCK_K) * stride_x_k,
                ((offs_kk[:, None] + k0 + BLOCK_K) < K) & mask_b[None, :],
                stride_x_m,
                N_ANG,
            )
        else:
            x0, x1, x2, x3, x4 = _x_tiles(
                x_base + k0 * stride_x_k,
                mask_k[:, None] & mask_b[None, :],
                stride_x_m,
                N_ANG,
            )
        # 2. one true dot per mode against W[m]^T, [BLOCK_K, BLOCK_O]
        w_ptrs = w_ptr + offs_k[:, None] * stride_w_k + offs_o[None, :] * stride_w_o
        w_mask = mask_k[:, None] & mask_o[None, :]
        w_tile = (w_ptrs, w_mask, stride_w_m, w_desc, o0, k0)
        acc0 = _mode_dot(x0, w_tile, acc0, 0, N_ANG, PRECISION, UPCAST, W_DESC)
        acc1 = _mode_dot(x1, w_tile, acc1, 1, N_ANG, PRECISION, UPCAST, W_DESC)
        acc2 = _mode_dot(x2, w_tile, acc2, 2, N_ANG, PRECISION, UPCAST, W_DESC)
        acc3 = _mode_dot(x3, w_tile, acc3, 3, N_ANG, PRECISION, UPCAST, W_DESC)
        acc4 = _mode_dot(x4, w_tile, acc4, 4, N_ANG, PRECISION, UPCAST, W_DESC)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_o, mask=mask_o, other=0.0).to(ACC_DTYPE)
        acc0 += bias[None, :]
    ty = y_ptr.dtype.element_ty
    if STORE3 and JOIN and N_ANG > 1 and N_ANG <= 4:  # 3. one [BO, BB, NA_PAD] store
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
    else:  # 3. one strided [BO, BB] store per mode
        yp = y_ptr + offs_o[:, None] * stride_y_o + offs_b[None, :] * stride_y_b
        ym = mask_o[:, None] & mask_b[None, :]
        _store_mode(yp, acc0, ym, stride_y_m, 0, N_ANG)
        _store_mode(yp, acc1, ym, stride_y_m, 1, N_ANG)
        _store_mode(yp, acc2, ym, stride_y_m, 2, N_ANG)
        _store_mode(yp, acc3, ym, stride_y_m, 3, N_ANG)
        _store_mode(yp, acc4, ym, stride_y_m, 4, N_ANG)


# --------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------
def precision(dtype: torch.dtype, tf32: bool) -> tuple[str, object, bool]:
    """``(input_precision, accumulator dtype, upcast operands)`` for a tensor dtype and
    the TF32 switch (the interpreter computes fp32 exactly: never TF32 there)."""
    if dtype == torch.float64:
        return "ieee", tl.float64, False
    if dtype == torch.float32:
        return ("tf32" if tf32 and not INTERPRET else "ieee"), tl.float32, False
    return "ieee", tl.float32, INTERPRET  # bf16 / fp16: fp32 accumulation


def _w_descriptor(w: torch.Tensor, BO: int, BK: int, transposed: bool):
    """``(w, descriptor, W_DESC)``: 1, a descriptor of W with ``[1, BO, BK]`` blocks
    (W made contiguous first); 2, where W is the transpose of a contiguous tensor and
    ``transposed`` allows it, a descriptor of that tensor, no copy; ``(w, None, 0)``
    where the bulk copy engine cannot serve it (unaligned, or no host descriptors)."""
    if TensorDescriptor is None or INTERPRET:
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


def triton_fwd(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    launch: TritonLaunch,
    tf32: bool = False,
) -> torch.Tensor:
    """``y (B, O, n_ang)`` for ``x (B, K, n_ang)`` and ``w (n_ang, O, K)`` of any
    strides, ``bias (O,)`` contiguous or None; B, K, O > 0, n_ang <= MAX_N_ANG."""
    B, K, n_ang = x.shape
    O = w.shape[1]
    y = torch.empty((B, O, n_ang), device=x.device, dtype=x.dtype)
    BB, BK, BO = launch.block_b, launch.block_k, launch.block_o
    if INTERPRET:  # a few hundred programs at most: the interpreter is slow
        BB = BK = BO = 16
    elif n_ang > 3:  # the accumulators and x tiles grow with n_ang
        BB, BK = max(16, BB // 2), min(BK, 32)
    prec, acc, upcast = precision(x.dtype, tf32)
    w, desc, w_mode = (
        # TF32's wgmma wants W's tile K-major: a mode-2 tile would be turned around
        # in shared memory by every program, so TF32 reads a contiguous W^T copy
        _w_descriptor(w, BO, BK, transposed=prec != "tf32")
        if launch.w_desc
        else (w, None, 0)
    )
    grid = (triton.cdiv(O, BO), triton.cdiv(B, BB))
    _eqlin_fwd_kernel[grid](
        x, w, desc if desc is not None else w, bias if bias is not None else w, y,
        B, K, O, *x.stride(), *w.stride(), *y.stride(),
        N_ANG=n_ang, NA_PAD=triton.next_power_of_2(n_ang), HAS_BIAS=bias is not None,
        BLOCK_B=BB, BLOCK_K=BK, BLOCK_O=BO, PRECISION=prec, UPCAST=upcast,
        ACC_DTYPE=acc, PREFETCH=launch.prefetch, STORE3=launch.store3,
        W_DESC=w_mode, JOIN=launch.join, num_warps=launch.warps,
        num_stages=launch.stages,
    )  # fmt: skip
    return y
