"""EquivariantLinear's strict-fp32 forward on the FMA units, written in Gluon.

``y[b, o, m] = sum_k x[b, k, m] w[m, o, k] (+ bias[o] at m = 0)`` for ``x (B, K, 3)``
with rows contiguous (``x.stride(1) == 3``, ``x.stride(2) == 1``), ``w (3, O, K)``
read with O contiguous (the input backward's ``W^T`` as it lies; the forward's W
through a transposed copy, 442 KB at K = O = 192, that ``linear._w_t_copy`` keeps
while the weight is unchanged), ``y (B, O, 3)`` contiguous;
fp32 in, IEEE fp32 FMAs, fp32 out.

Why a second kernel: in strict fp32 (TF32 off) the forward is arithmetic-bound
(48 flop/byte at K = O = 192). The Triton kernel of :mod:`ecekern.linear` ran at
873 us (E = 47k, F = 192, one of cos/sin) where cuBLAS's batched GEMM behind the
einsum takes about 400 us; Nsight Compute found its warps waiting on shared memory
(short scoreboard), and it spills at 255 registers. Gluon lets this kernel say where
every value lives: each thread owns a ``TM x TN`` tile of every mode's output, and
per input k reads TM values of x and TN of W (16-byte shared-memory loads, broadcast
across the warp) for ``TM TN`` FMAs.

One program: ``BB = 64`` rows by ``BO = 64`` outputs, all three modes, 4 warps. Per K
step of 16 inputs:

1. x's ``[64, 48]`` row segment comes in by 16-byte loads, a thread holding 4 inputs
   x 3 modes of one row (12 contiguous floats); the modes come apart in registers
   (``_modes``: splits and joins, no data leaves the thread);
2. each mode is stored to shared memory transposed, ``[k][row]``, and W's
   ``[k][o]`` tile beside it (rows of W with O contiguous: 16-byte loads and stores);
3. after one barrier every warp runs ``16 x 3`` rank-1 updates from shared memory
   (:func:`fma_dot`). The source issues the next step's global loads first, but
   ptxas sinks them below the FMAs, and the buffers' shared allocation costs six
   barriers per step; a loop rebuilt to keep loads in flight and one barrier per
   step was no faster (chapter 2, history ``session9_fma_v_*.csv``).

Launch: 8 x 4 tiles (lanes 4 along rows, 8 along outputs) and at most 168 registers
per thread, so that three programs share an SM (ptxas spills 16 bytes); chapter 2's
launch sweep times both tiles.

The three accumulators leave through one store: the modes joined in registers and
converted so that a warp writes 32 outputs x 3 modes, contiguous in y.

Scope: n_ang = 3 (the mode split is written for three), fp32 with TF32 off, a CUDA
device; any B, K, O (masked). :func:`fma_reason` says why a call cannot be served,
and :func:`ecekern.linear.eqlin_fwd` then runs the Triton kernel, which serves every
case. Gluon does not run in Triton's CPU interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import tensor as _gl_tensor
    from triton.language.core import builtin
except ImportError:  # Triton without Gluon (< 3.5) or no Triton: never launched
    gluon = gl = None

__all__ = ["fma_fwd", "fma_reason", "o_contiguous", "TILES"]

#: Register tiles (TM rows x TN outputs per thread and mode) and the thread layout
#: that puts them on a 64 x 64 program: (TM, TN, lanes along rows).
TILES = {"8x4": (8, 4, 4), "4x8": (4, 8, 8)}
BLOCK_B, BLOCK_O, BLOCK_K, WARPS = 64, 64, 16, 4
#: Registers per thread: three programs of 128 threads per SM (65536 registers).
#: Session 8's run 3 (history session8_fma2_*.csv): 325 against 357 us uncapped.
MAXNREG = 168


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
def _jit(fn):
    return gluon.jit(fn) if gluon is not None else fn


if gluon is not None:

    @builtin
    def fma_dot(a, b, acc, _semantic=None):
        """``acc + a @ b`` by IEEE fp32 FMAs in the layouts the caller chose (a and b
        ``DotOperandLayout`` of acc's ``BlockedLayout``). ``gl.dot_fma`` without the
        K >= 16 floor of ``tl.dot``'s shape check: a K of 4 keeps each rank-4 update's
        operands to 48 registers."""
        prec = _semantic._str_to_dot_input_precision("ieee")
        h = _semantic.builder.create_dot(a.handle, b.handle, acc.handle, prec, 0)
        return _gl_tensor(h, acc.type)

else:
    fma_dot = None


@_jit
def _half(t, N: gl.constexpr):
    return gl.split(t.reshape([t.shape[0], t.shape[1], N // 2, 2]))


@_jit
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


@_jit
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


@_jit
def _load_x(x_ptrs, x_mask, x_k, k0, K, EVEN_K: gl.constexpr):
    """The ``[BB, 4, 16]`` x tile of the K step at ``k0``: zeros past K (and, for
    ``k0 >= K``, everywhere: the loop's load after its last step)."""
    if EVEN_K:  # a mask that is constant along each 16-byte load keeps it one load
        return gl.load(x_ptrs + k0 * 3, mask=x_mask & (k0 < K), other=0.0)
    return gl.load(x_ptrs + k0 * 3, mask=x_mask & (k0 + x_k < K), other=0.0)


@_jit
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


@_jit
def _store_modes(
    acc0, acc1, acc2, y_ptr, b_ptr, row0, col0, B, O, stride_yb,
    HAS_BIAS: gl.constexpr, BB: gl.constexpr, BO: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Rows ``row0 ..`` and outputs ``col0 ..`` of y ``(B, O, 3)``, ``[BB, BO]`` per
    mode: each mode rounded to y's dtype, the modes joined in registers, ``[BB, BO,
    4]`` (slot 3 a dummy), converted so that lanes run along the outputs (a warp
    stores 32 outputs x 3 modes, 96 contiguous elements of y). Rounding before the
    conversion halves the bytes it moves through shared memory in bf16. The bias
    goes on the m = 0 slot here only for an fp32 y (this kernel), where rounding
    first changes nothing; :mod:`ecekern.linear_tc`, whose epilogue this also is,
    starts its m = 0 accumulator at the bias instead."""
    st_l: gl.constexpr = gl.BlockedLayout(
        [1, 1, 4], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0]
    )
    dt: gl.constexpr = y_ptr.dtype.element_ty
    gl.static_assert(dt == gl.float32 or not HAS_BIAS, "bias after rounding: fp32 y")
    a0, a1, a2 = acc0.to(dt), acc1.to(dt), acc2.to(dt)
    t4 = gl.join(gl.join(a0, a2), gl.join(a1, a2)).reshape([BB, BO, 4])
    t4 = gl.convert_layout(t4, st_l)
    r = gl.arange(0, BB, layout=gl.SliceLayout(1, gl.SliceLayout(2, st_l)))
    c = gl.arange(0, BO, layout=gl.SliceLayout(0, gl.SliceLayout(2, st_l)))
    mm = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, st_l)))
    mm = mm[None, None, :]
    rows = row0.to(gl.int64) + r[:, None, None]
    cols = col0 + c[None, :, None]
    if HAS_BIAS:
        bias = gl.load(b_ptr + col0 + c, mask=col0 + c < O, other=0.0)
        t4 = t4 + gl.where(mm == 0, bias.to(gl.float32)[None, :, None], 0.0)
    gl.store(
        y_ptr + rows * stride_yb + cols * 3 + mm,
        t4,
        mask=(rows < B) & (cols < O) & (mm < 3),
    )


@_jit
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

    _store_modes(
        acc0, acc1, acc2, y_ptr, b_ptr, rb * BB, o0, B, O, stride_yb, HAS_BIAS, BB,
        BO, num_warps,
    )  # fmt: skip


# --------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------
def fma_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why :func:`fma_fwd` cannot serve ``x (B, K, n_ang)``, ``w (n_ang, O, K)``, or
    None when it can."""
    if gluon is None:
        return "this Triton has no Gluon"
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        return f"{x.dtype}: the kernel is fp32 only"
    if torch.backends.cuda.matmul.allow_tf32:
        return "TF32 is on: the tensor cores are faster"
    if x.shape[2] != 3:
        return f"n_ang = {x.shape[2]}: the mode split is written for 3"
    if x.stride(2) != 1 or x.stride(1) != 3:
        return "x's rows are not contiguous"
    if x.device.type != "cuda" or w.device != x.device:
        return "not a CUDA tensor (or x and w on different devices)"
    return None


def fma_fwd(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile: str = "8x4"
) -> torch.Tensor:
    """``y (B, O, 3)`` for ``x (B, K, 3)``, ``w (3, O, K)``, ``bias (O,)`` or None:
    the forward, or the input backward with ``w`` the transpose of the weight. A
    ``w`` whose O axis is not contiguous is read through a transposed copy
    (``o_contiguous``; the Function's forward makes it once for cos and sin)."""
    reason = fma_reason(x, w)
    if reason is not None:
        raise ValueError(f"fma_fwd cannot serve this call: {reason}")
    B, K, _ = x.shape
    O = w.shape[1]
    w = o_contiguous(w)
    y = torch.empty((B, O, 3), device=x.device, dtype=x.dtype)
    if B == 0 or O == 0:
        return y
    if K == 0:  # nothing to sum, and no kernel should read an empty x: the bias alone
        y.zero_()
        if bias is not None:
            y[:, :, 0] += bias
        return y
    TM, TN, TR = TILES[tile]
    grid = (triton.cdiv(O, BLOCK_O), triton.cdiv(B, BLOCK_B))
    _eqlin_fwd_fma_kernel[grid](
        x, w, bias if bias is not None else w, y, B, K, O, x.stride(0), w.stride(0),
        w.stride(2), y.stride(0), HAS_BIAS=bias is not None, TM=TM, TN=TN, TR=TR,
        KS=4, EVEN_K=K % BLOCK_K == 0, num_warps=WARPS, maxnreg=MAXNREG,
    )  # fmt: skip
    return y


def o_contiguous(w: torch.Tensor) -> torch.Tensor:
    """``w (n, O, K)`` with its O axis contiguous (``stride(1) == 1``): as it is, or
    a transposed copy."""
    if w.stride(1) == 1:
        return w
    return w.transpose(1, 2).contiguous().transpose(1, 2)
