"""The fused stack's weights: made ready once a call on the host, streamed from L2
through a ring of ``[64, BK]`` boxes in shared memory by TMA, and multiplied a K step
(BK inputs) at a time on the tensor cores or the FMA units
(:mod:`ecekern.stack_fused` runs it).

Formula: one K step adds ``a[:, k0:k0+BK] @ W[n0:n0+64, k0:k0+BK]^T`` to each of a
tile's accumulators: by IEEE fp32 FMAs (``"ieee"``, a from shared memory); in
TF32; in bf16 (a rounded in registers, W once a call); or in 3xTF32 as
``lo hi + hi lo + hi hi`` with ``a = hi + lo`` split in registers
(``_round_tf32``) and W split once a call
(``ecekern._stack_common.split_tf32``), the small products first.

Shapes: the gated layers' W stacked ``(K 3 F, F)`` (W^T, last layer first, for the
backward; both, ``(2 K 3 F, F)``, for the backward that recomputes the forward),
W_out ``(3 F', F)`` (W_out^T ``(3 F, F')``); a ring stage holds three
boxes or three of each part (3xTF32), ``3 x 64 x BK x 4`` bytes a part (half that
in bf16).

Bytes: every program reads all the weights once a tile each way, from L2, the
gated layers' twice in the recomputing backward (twice that in 3xTF32, half in
bf16); 72 KiB of shared memory at ``STAGES = 3`` (36 KiB in
bf16).

Status: used by :mod:`ecekern.stack_fused` (sm_90); compiled for sm_90 without a
GPU in the tests, run against fp64 on the H200 through the fused stack's GPU tests.
"""

from __future__ import annotations

import torch

from .._stack_common import split_tf32
from .._triton import fma_dot, gl, gluon

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = [
    "BK",
    "F_IN",
    "F_OUT",
    "N_ANG",
    "STAGES",
    "TILE",
    "backward_weights",
    "forward_weights",
]

#: The shapes the kernels are written for: features, outputs, orders, and the edges
#: of a tile (64 rows of a product: its 32 cos rows over its 32 sin rows).
F_IN, F_OUT, N_ANG, TILE = 192, 96, 3, 32
#: Inputs a K step (a box of W is ``[64, BK]``, fp32, or bf16 in bf16) and K steps
#: of W in flight, per precision (the kernels' names: strict fp32 ``"ieee"`` on the
#: FMA units, or on the tensor cores TF32, fp32-accurate 3xTF32 ``"tf32x3"`` or bf16
#: operands): 3xTF32 streams W's TF32 part and remainder, twice the bytes a step.
BK = {"ieee": 32, "tf32": 32, "tf32x3": 16, "bf16": 32}
STAGES = 3


def _jit(fn=None, **kw):
    if fn is None:
        return lambda f: _jit(f, **kw)
    return gluon.jit(fn, **kw) if gluon is not None else fn


#: Host functions the kernels call at compile time (layouts, box counts).
_constexpr_fn = gluon.constexpr_function if gluon is not None else (lambda fn: fn)
_cx = gl.constexpr if gluon is not None else (lambda v: v)
#: The shapes as the kernels read them (constexpr globals).
F_K, FO_K, TILE_K = _cx(F_IN), _cx(F_OUT), _cx(TILE)


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@_constexpr_fn
def _acc_layout(FMA, BF16, num_warps):
    """An accumulator ``[64 rows, 64 outputs]``: ``wgmma``'s (K 8 an instruction,
    16 in bf16), or on the FMA units each thread 4 x 4, rows and outputs 16 apart
    (:func:`_fma`)."""
    if FMA:
        return gl.BlockedLayout([1, 1], [4, 8], [4, num_warps // 4], [1, 0])
    warps = [4, num_warps // 4]
    k = 16 if BF16 else 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps,
                                     instr_shape=[16, 32, k])  # fmt: skip


@_constexpr_fn
def _operand_layout(acc_l, index, FMA, BF16):
    """The layout of a product's operand ``index`` (0: rows, 1: W) in registers."""
    k_width = 0 if FMA else 2 if BF16 else 1
    return gl.DotOperandLayout(operand_index=index, parent=acc_l, k_width=k_width)


@_jit
def _operand(view, a_l: gl.constexpr, FMA: gl.constexpr):
    """A ``[64, BK]`` A operand: read by the FMA products from shared memory as
    they go, or loaded into registers for ``wgmma``."""
    if FMA:
        return view
    else:
        return view.load(a_l)


@_jit
def _round_tf32(x):
    """fp32 ``x`` rounded to the nearest TF32 value (ties to even), kept in fp32:
    ``x - _round_tf32(x)`` is exact."""
    u = x.to(gl.uint32, bitcast=True)
    u = (u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000
    return u.to(gl.float32, bitcast=True)


@_jit
def _mma(a, ring, b, a0, a1, a2, NB: gl.constexpr):
    """``a [64, BK]`` (registers) times the NB ``[64 outputs, BK inputs]`` boxes of W
    from ring box b, into the accumulators (a2 untouched at NB = 2)."""
    a0 = warpgroup_mma(a, ring.index(b).permute((1, 0)), a0, is_async=True)
    a1 = warpgroup_mma(a, ring.index(b + 1).permute((1, 0)), a1, is_async=True)
    if NB == 3:
        a2 = warpgroup_mma(a, ring.index(b + 2).permute((1, 0)), a2, is_async=True)
    return a0, a1, a2


@_jit
def _fma(a, ring, b, a0, a1, a2, NB: gl.constexpr, BK: gl.constexpr,
         a_l: gl.constexpr, b_l: gl.constexpr):  # fmt: skip
    """``a [64, BK]`` (shared) times the NB boxes of W from ring box b by IEEE fp32
    FMAs, four inputs at a time: a thread holds 4 x 4 outputs of each accumulator,
    rows and outputs 16 apart, so that a warp's 16-byte reads of a and of W's
    K-contiguous boxes fall in distinct banks."""
    for kk in gl.static_range(BK // 4):
        ak = a.slice(4 * kk, 4, dim=1).load(a_l)
        w = ring.index(b).slice(4 * kk, 4, dim=1).permute((1, 0))
        a0 = fma_dot(ak, w.load(b_l), a0)
        w = ring.index(b + 1).slice(4 * kk, 4, dim=1).permute((1, 0))
        a1 = fma_dot(ak, w.load(b_l), a1)
        if NB == 3:
            w = ring.index(b + 2).slice(4 * kk, 4, dim=1).permute((1, 0))
            a2 = fma_dot(ak, w.load(b_l), a2)
    return a0, a1, a2


@_jit
def _step(a, lo, ring, st, c0, c1, c2, NB: gl.constexpr, X3: gl.constexpr,
          FMA: gl.constexpr, BK: gl.constexpr, a_l: gl.constexpr,
          b_l: gl.constexpr):  # fmt: skip
    """One K step's products, ``a [64, BK]`` times W from ring stage st, issued
    (on the FMA units: done, a in shared memory). In 3xTF32 the stage holds W's
    TF32 part (boxes 0-2) and remainder (3-5), a is split here into ``hi`` and
    ``lo``, and the small products go first: ``lo hi + hi lo + hi hi``; in bf16
    a is rounded to bf16 here. Returns the accumulators and the A operands in
    flight: ``a`` (in bf16, rounded) and, but in 3xTF32, ``lo`` as it came (a
    loop-invariant zero; on the FMA units both are that zero)."""
    if FMA:
        hi = lo
        c0, c1, c2 = _fma(a, ring, 3 * st, c0, c1, c2, NB, BK, a_l, b_l)
    elif ring.dtype == gl.bfloat16:
        hi = a.to(gl.bfloat16)
        c0, c1, c2 = _mma(hi, ring, 3 * st, c0, c1, c2, NB)
    # [book: fused-split]
    elif X3:
        hi = _round_tf32(a)
        lo = a - hi
        c0, c1, c2 = _mma(lo, ring, 6 * st, c0, c1, c2, NB)
        c0, c1, c2 = _mma(hi, ring, 6 * st + 3, c0, c1, c2, NB)
        c0, c1, c2 = _mma(hi, ring, 6 * st, c0, c1, c2, NB)
    # [/book: fused-split]
    else:
        hi = a
        c0, c1, c2 = _mma(a, ring, 3 * st, c0, c1, c2, NB)
    return c0, c1, c2, hi, lo


@_jit
def _retire(c0, c1, c2, hi, lo, NB: gl.constexpr, X3: gl.constexpr, N: gl.constexpr,
            FMA: gl.constexpr):  # fmt: skip
    """Wait until at most the last N K steps' products are in flight (N = 1: the
    step before is done with its operands ``hi``, ``lo`` and its ring stage; N = 0:
    every product is done). On the FMA units the products are done when issued.
    With N = 1 every warp then waits until all are past the step before: one
    thread issues the next load into its ring stage, and the other warpgroup's
    products may still read it."""
    if FMA:
        pass
    elif NB == 3:
        if X3:
            c0, c1, c2, hi, lo = warpgroup_mma_wait(9 * N, deps=[c0, c1, c2, hi, lo])
        else:
            c0, c1, c2, hi = warpgroup_mma_wait(3 * N, deps=[c0, c1, c2, hi])
    else:
        if X3:
            c0, c1, hi, lo = warpgroup_mma_wait(6 * N, deps=[c0, c1, hi, lo])
        else:
            c0, c1, hi = warpgroup_mma_wait(2 * N, deps=[c0, c1, hi])
    if N == 1:
        gl.thread_barrier()
    return c0, c1, c2


@_jit
def _chunk(a0, a1, a2, zero, X3: gl.constexpr, FMA: gl.constexpr):
    """The accumulators a chunk of inputs starts from: zero in 3xTF32 and with FMA
    (the strict-fp32 backward): its sums join a0 .. in fp32 adds, :func:`_fold`, so
    that a long sum's roundings are relative to the chunk's, not to a0's residual
    start; a0 .. themselves otherwise."""
    if X3 or FMA:
        c0, c1, c2 = zero, zero, zero
    else:
        c0, c1, c2 = a0, a1, a2
    return c0, c1, c2


@_jit
def _fold(a0, a1, a2, c0, c1, c2, hi, lo, NB: gl.constexpr, X3: gl.constexpr,
          FMA: gl.constexpr):  # fmt: skip
    """A chunk's sums into the accumulators: in 3xTF32 once its products are done
    (``hi``, ``lo``: the last step's operands), by fp32 adds, and so with FMA (the
    products done already); otherwise the chunk's accumulators are a0 .. already."""
    if X3 or FMA:
        if X3:
            c0, c1, c2 = _retire(c0, c1, c2, hi, lo, NB, X3, 0, False)
        a0 += c0
        a1 += c1
        if NB == 3:
            a2 += c2
    else:
        a0, a1, a2 = c0, c1, c2
    return a0, a1, a2


@_jit
def _boxes(desc, lo, row, col, n: gl.constexpr, ring, b, bar, X3: gl.constexpr):
    """n ``[64, BK]`` boxes of W from ``[row, col]``, 64 rows apart, into ring boxes
    ``b ..``; in 3xTF32 the remainder's (``lo``) into ``b + 3 ..``."""
    if X3:
        mbarrier.expect(bar, 2 * n * desc.block_type.nbytes)
    else:
        mbarrier.expect(bar, n * desc.block_type.nbytes)
    for j in gl.static_range(n):
        tma.async_copy_global_to_shared(desc, [row + 64 * j, col], bar,
                                        ring.index(b + j))  # fmt: skip
        if X3:
            tma.async_copy_global_to_shared(lo, [row + 64 * j, col], bar,
                                            ring.index(b + 3 + j))  # fmt: skip


@_jit
def _load_w(c, SEQ: gl.constexpr, W, R, g, STG: gl.constexpr, BK: gl.constexpr,
            X3: gl.constexpr):  # fmt: skip
    """Chunk c of a tile's weight sequence into ring stage ``s = g % STG`` of
    ``R = (ring, ready)`` as ``[64, BK]`` boxes (64 outputs, BK inputs). The
    sequence, ``SEQ = (NCH, NA, KA, NBC, KB, NB, RB)``: NCH chunks, the first NA
    from ``wa`` (three boxes each, ``KA`` K steps a matrix of F rows), then NBC of
    ``wb`` (``NB`` boxes, ``KB`` K steps, a matrix every ``RB`` rows), then
    ``wa``'s from chunk NA on; ``W = (wa, wb, wa_lo, wb_lo)``. A matrix is a
    ``[layer, order]`` block of rows of the descriptor's 2-d view; rows past the
    view arrive as zeros. In 3xTF32 the remainders (``wa_lo``, ``wb_lo``) follow
    the TF32 parts: boxes ``6 s + j`` and ``6 s + 3 + j``."""
    NCH, NA, KA, NBC, KB, NB, RB = SEQ
    wa, wb, wa_lo, wb_lo = W
    ring, ready = R
    s = g % STG
    if X3:
        b = 6 * s
    else:
        b = 3 * s
    bar = ready.index(s)
    if NA + NBC == NCH:  # wa's, then wb's (the forward)
        if c < NA:
            _boxes(wa, wa_lo, (c // KA) * F_K, (c % KA) * BK, 3, ring, b, bar, X3)
        else:
            _boxes(wb, wb_lo, (c - NA) // KB * RB, (c - NA) % KB * BK, NB, ring, b,
                   bar, X3)  # fmt: skip
    elif NA == 0:  # wb's, then wa's (the backward)
        if c < NBC:
            _boxes(wb, wb_lo, c // KB * RB, c % KB * BK, NB, ring, b, bar, X3)
        else:
            ca = c - NBC
            _boxes(wa, wa_lo, (ca // KA) * F_K, (ca % KA) * BK, 3, ring, b, bar, X3)
    else:  # wa's, wb's, wa's (the backward that recomputes the forward)
        if c < NA:
            _boxes(wa, wa_lo, (c // KA) * F_K, (c % KA) * BK, 3, ring, b, bar, X3)
        elif c < NA + NBC:
            _boxes(wb, wb_lo, (c - NA) // KB * RB, (c - NA) % KB * BK, NB, ring, b,
                   bar, X3)  # fmt: skip
        else:
            ca = c - NBC
            _boxes(wa, wa_lo, (ca // KA) * F_K, (ca % KA) * BK, 3, ring, b, bar, X3)


@_jit
def _next_w(c, SEQ: gl.constexpr, W, R, g, more, STG: gl.constexpr,
            BK: gl.constexpr, X3: gl.constexpr):  # fmt: skip
    """After chunk c (global count g) retired its predecessor: chunk
    ``c + STG - 1`` into the stage that predecessor freed, this tile's or, past
    its end, the next tile's (if ``more``); the sequence as :func:`_load_w`."""
    NCH: gl.constexpr = SEQ[0]
    if c + STG - 1 < NCH:
        _load_w(c + STG - 1, SEQ, W, R, g + STG - 1, STG, BK, X3)
    elif more:
        _load_w(c + STG - 1 - NCH, SEQ, W, R, g + STG - 1, STG, BK, X3)


@_jit
def _ring(desc, X3: gl.constexpr, STG: gl.constexpr, BK: gl.constexpr):
    """The weights' ring in shared memory, STG stages of three ``[64, BK]`` boxes of
    ``desc``'s type (six in 3xTF32), and a barrier a stage, initialised."""
    ring = gl.allocate_shared_memory(
        desc.dtype, [6 * STG if X3 else 3 * STG, 64, BK], desc.layout
    )
    ready = gl.allocate_shared_memory(gl.int64, [STG, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STG):
        mbarrier.init(ready.index(i), count=1)
    return ring, ready


@_jit
def _kstep(a, hi, lo, c, g, c0, c1, c2, R, more, W, NBOX: gl.constexpr,
           SEQ: gl.constexpr, X3: gl.constexpr, FMA: gl.constexpr, BK: gl.constexpr,
           STG: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr):  # fmt: skip
    """K step c of a tile's weight sequence (``SEQ``, ``W`` as :func:`_load_w` has
    them; count g), A operand ``a``: wait for its boxes in ``R = (ring, ready)``,
    issue the products with NBOX of them (:func:`_step`), retire the step before
    (its operands ``hi``, ``lo``), and load chunk ``c + STG - 1`` into the stage
    that frees (:func:`_next_w`). The accumulators and this step's operands."""
    # [book: fused-kstep]
    ring, ready = R
    mbarrier.wait(ready.index(g % STG), (g // STG) & 1)
    c0, c1, c2, n_hi, n_lo = _step(a, lo, ring, g % STG, c0, c1, c2, NBOX, X3, FMA, BK,
                                   a_l, b_l)  # fmt: skip
    c0, c1, c2 = _retire(c0, c1, c2, hi, lo, NBOX, X3, 1, FMA)
    _next_w(c, SEQ, W, R, g, more, STG, BK, X3)
    return c0, c1, c2, n_hi, n_lo
    # [/book: fused-kstep]


# --------------------------------------------------------------------------------------
# host: the weights as the ring streams them
# --------------------------------------------------------------------------------------
def _desc(w2d: torch.Tensor, bk: int):
    """A TMA descriptor of boxes ``[64, bk]`` over a contiguous fp32 or bf16
    matrix."""
    dt = gl.bfloat16 if w2d.dtype == torch.bfloat16 else gl.float32
    layout = gl.NVMMASharedLayout.get_default_for([64, bk], dt)
    return TensorDescriptor.from_tensor(w2d, [64, bk], layout)


def _descs(w2d: torch.Tensor, precision: str) -> tuple:
    """The descriptors of a weight's TF32 part and remainder (3xTF32, W split by
    ``ecekern._stack_common.split_tf32``), or of W twice: fp32 (strict
    fp32, TF32), or rounded to bf16 (bf16)."""
    bk = BK[precision]
    if precision == "tf32x3":
        hi, lo = split_tf32(w2d)
        return _desc(hi, bk), _desc(lo, bk)
    if precision == "bf16":  # rounded to nearest once a call, as the rows are
        w2d = w2d.to(torch.bfloat16)
    d = _desc(w2d.contiguous(), bk)
    return d, d


def _stacked(weights, transposed: bool) -> torch.Tensor:
    """The gated layers' W ``(K, 3, F, F)`` stacked: in the forward's order, or
    each transposed, last layer first (the backward's)."""
    if transposed:
        return torch.stack([w.detach().transpose(1, 2) for w in reversed(weights)])
    return torch.stack([w.detach() for w in weights])


def _biases(biases) -> torch.Tensor | None:
    """The gated layers' biases ``(K, F)`` (zeros for None), or None for none."""
    given = [bk for bk in biases if bk is not None]
    if not given:
        return None
    return torch.stack([given[0].new_zeros(F_IN) if bk is None else bk.detach()
                        for bk in biases]).contiguous()  # fmt: skip


def forward_weights(weights, biases, weight_out, bias_out, precision="tf32") -> tuple:
    """The forward's weights as the kernel takes them, once a call: descriptors of
    the gated layers' W stacked ``(K 3 F, F)`` and of W_out ``(3 F', F)`` (each
    split in 3xTF32, rounded in bf16: ``_descs``), the biases ``(K, F)`` (zeros for
    None) and ``(F',)`` or None."""
    K = len(weights)
    w = _stacked(weights, False).contiguous().view(K * N_ANG * F_IN, F_IN)
    wo = weight_out.detach().contiguous().view(N_ANG * F_OUT, F_IN)
    bo = None if bias_out is None else bias_out.detach().contiguous()
    return (_descs(w, precision), _descs(wo, precision), _biases(biases), bo, K,
            precision)  # fmt: skip


def backward_weights(weights, weight_out, precision="tf32", biases=None) -> tuple:
    """The backward's: descriptors of the gated layers' W^T stacked last layer
    first (the backward's order), ``(K 3 F, F)``, and of W_out^T ``(3 F, F')``.
    With ``biases`` (a list: the backward that recomputes the forward), the gated
    layers' W in the forward's order come first, ``(2 K 3 F, F)``, and their
    biases follow (``(K, F)`` or None)."""
    K = len(weights)
    w = _stacked(weights, True)
    if biases is not None:
        w = torch.cat([_stacked(weights, False), w])
    w = w.contiguous().view(-1, F_IN)
    wot = weight_out.detach().transpose(1, 2).contiguous().view(-1, F_OUT)
    got = (_descs(w, precision), _descs(wot, precision))
    if biases is not None:
        got += (_biases(biases),)
    return (*got, K, precision)
