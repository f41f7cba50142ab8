"""EquivariantLinear's forward on the tensor cores, the modes split by the tensor
cores themselves, written in Gluon: bf16, and TF32 (fp32 inputs).

``y[b, o, m] = sum_k x[b, k, m] w[m, o, k] (+ bias[o] at m = 0)``

    x (B, K, 3)  contiguous, 16-byte aligned
    w (3, O, K)  contiguous (the forward's W; the input backward's kept W^T copy)
    y (B, O, 3)  contiguous; bf16 or fp32 in and out, fp32 accumulation

Why: one mode of x is every third value of a row, and neither the bulk copy engine (TMA
strides apply to whole rows) nor a ``wgmma`` (operands contiguous along K) takes it as
it lies. Here the split is itself a product: for a group of G inputs (``group_size``:
16 in bf16, 8 in TF32, one ``wgmma``'s k; 3 G interleaved columns) and the 0/1 matrix
P (``mode_split_matrices``, 3 G x 4 G), ``X P`` holds each mode's G inputs in G columns
of its own. It is exact with fp32 accumulation and lands in a ``wgmma`` accumulator,
whose registers, split in place, are the A operand of the per-mode ``wgmma``: the modes
never pass through shared memory a second time. In TF32 P puts each input in the
accumulator column whose register the A operand wants (``_column_blocks``); every
hand-over is asserted free of data movement.

One program owns 64 outputs of every mode and keeps that slice of W in shared memory
for its life (TMA, once). C consumer warpgroups take its row blocks (64 rows) in turn,
fed by a loader warp that streams x into each consumer's ring of K steps by TMA. Per K
step, four groups: three ``wgmma`` against P, then three per-mode ``wgmma`` (A from
registers, B W's slice). The epilogue (``gluon_common.store_modes``) rounds each mode
to y's dtype before its layout conversion; the m = 0 accumulator starts at the bias.

Bytes: ``s B 3 (K + O)`` plus W per output block; tensor-core work: the products plus
an equal number of permutation products.

Status: bf16 and fp32 (TF32), n_ang = 3, O a multiple of 64, K a multiple of 4 G with
K <= ``MAX_K``, contiguous aligned x and w, CUDA with Gluon and host-side tensor
descriptors. The plan takes it only where :func:`tc_reason` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import gl, gluon, triton
from .gluon_common import jit, store_modes

if gluon is not None:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = [
    "Launch",
    "mode_split_matrices",
    "operand_reason",
    "shape_reason",
    "tc_fwd",
    "tc_reason",
]


def group_size(dtype: torch.dtype) -> int:
    """Inputs per group G, the k of one ``wgmma``: 16 in bf16, 8 in TF32."""
    return 16 if dtype == torch.bfloat16 else 8


@dataclass(frozen=True)
class Launch:
    """One launch of the kernel: outputs per program (each mode), consumer
    warpgroups per program (each 64 rows at a time, alternate row blocks; a loader
    warp feeds them), K steps of x in each consumer's ring, and the register cap of
    a second consumer (``setmaxnreg``; the first takes what the compiler gives it).
    One program per SM."""

    block_o: int
    consumers: int
    stages: int
    regs: int


#: Per dtype: inputs per K step (4 groups; a box row of x or W is 128 bytes), the
#: largest K (W's slice, ``3 x BO x K``, and the rings of x share the SM's 227 KB of
#: shared memory), the launch, and the launch past ``TWO_MAX_K``, where two rings no
#: longer fit beside W (offline sm_90 builds: ``python -m ecekern.tools.registers
#: --linear-tc``). The launches are chapter 2's fastest.
BLOCK_K = {dt: 4 * group_size(dt) for dt in (torch.bfloat16, torch.float32)}
MAX_K = {torch.bfloat16: 256, torch.float32: 192}
TWO_MAX_K = {torch.bfloat16: 192, torch.float32: 0}
LAUNCH = {
    torch.bfloat16: Launch(block_o=64, consumers=2, stages=2, regs=216),
    torch.float32: Launch(block_o=64, consumers=1, stages=2, regs=0),
}
ONE = {
    torch.bfloat16: Launch(block_o=64, consumers=1, stages=3, regs=0),
    torch.float32: Launch(block_o=64, consumers=1, stages=2, regs=0),
}


def default_launch(dtype: torch.dtype, K: int) -> Launch:
    """The launch for K inputs: ``LAUNCH`` where its rings fit, else ``ONE``."""
    return LAUNCH[dtype] if K <= TWO_MAX_K[dtype] else ONE[dtype]


# --------------------------------------------------------------------------------------
# the permutation, on the host
# --------------------------------------------------------------------------------------
def mode_split_matrices(
    dtype=torch.bfloat16, device="cpu", G: int | None = None
) -> torch.Tensor:
    """The 0/1 matrix P of one group of G inputs (``group_size``) as its three G-row
    slices, ``(3, 4 G, G)`` with ``S[j, n, c] = 1`` where ``G j + c = 3 f + m`` and n
    is the accumulator column of input f of mode m: slice j, transposed, is the B
    operand for columns ``G j .. G j + G - 1`` of the group (K contiguous).
    ``x_group (rows, 3 G) @ P`` puts mode m's inputs in columns ``G m .. G m + G - 1``
    and leaves the last G columns zero: in order in bf16 (``n = 16 m + f``), in the
    order of a TF32 ``wgmma``'s A registers in TF32 (``n = 8 m + 2 (f % 4) + f // 4``,
    see ``_column_blocks``). G defaults to ``group_size(dtype)``."""
    G = G or group_size(dtype)
    s = torch.zeros(3, 4 * G, G, dtype=dtype, device=device)
    for f in range(G):
        for m in range(3):
            j, c = divmod(3 * f + m, G)
            n = G * m + (f if G == 16 else 2 * (f % 4) + f // 4)
            s[j, n, c] = 1
    return s


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@jit
def _x_slice(xs, s, col: gl.constexpr, G: gl.constexpr):
    """Columns ``col .. col + G - 1`` of stage s's three ``[64, 4 G]`` boxes of x."""
    return xs.index(3 * s + col // (4 * G)).slice(col % (4 * G), G, dim=1)


@jit
def _split_modes(xs, ps, s, g: gl.constexpr, zero, G: gl.constexpr):
    """``X_g P`` for input group g of stage s, ``[64, 4 G]`` (mode m's G inputs in
    columns ``G m .. G m + G - 1``, in the order ``_column_blocks`` undoes), as three
    queued ``wgmma``."""
    acc = warpgroup_mma(
        _x_slice(xs, s, 3 * G * g, G), ps.index(0).permute((1, 0)), zero,
        use_acc=False, is_async=True,
    )  # fmt: skip
    for j in gl.static_range(1, 3):
        acc = warpgroup_mma(
            _x_slice(xs, s, 3 * G * g + G * j, G), ps.index(j).permute((1, 0)), acc,
            is_async=True,
        )  # fmt: skip
    return acc


@jit
def _column_blocks(t, BB: gl.constexpr, G: gl.constexpr):
    """``[BB, 4 G]`` as four ``[BB, G]`` column blocks, each in the register order
    of a ``wgmma`` A operand; splits along the register axis of the accumulator
    layout, so no value leaves its thread.

    bf16 (G = 16): block i is columns ``16 i .. 16 i + 15``. TF32 (G = 8): a thread
    holds accumulator columns ``2 t, 2 t + 1`` of each 8, and A columns ``t, t + 4``,
    so block i's column ``t + 4 b`` is accumulator column ``8 i + 2 t + b``
    (``mode_split_matrices`` puts the inputs there)."""
    if G == 16:
        t = t.reshape([BB, 2, 2, 16]).permute((0, 3, 1, 2))
    else:
        t = t.reshape([BB, 2, 2, 4, 2]).permute((0, 4, 3, 1, 2)).reshape([BB, 8, 2, 2])
    a, b = gl.split(t)
    q0, q2 = gl.split(a)
    q1, q3 = gl.split(b)
    return q0, q1, q2, q3


@jit
def _products(
    pq, ws, kk, g: gl.constexpr, acc0, acc1, acc2,
    a_l: gl.constexpr, BB: gl.constexpr, NKB: gl.constexpr, G: gl.constexpr,
):  # fmt: skip
    """The three modes' ``wgmma`` of input group g: A the split modes (registers, in
    x's dtype), B W's ``[BO, G]`` slice of K box kk, added to the accumulators."""
    q0, q1, q2, _ = _column_blocks(pq.to(ws.dtype), BB, G)
    b0 = ws.index(kk).slice(G * g, G, dim=1).permute((1, 0))
    b1 = ws.index(NKB + kk).slice(G * g, G, dim=1).permute((1, 0))
    b2 = ws.index(2 * NKB + kk).slice(G * g, G, dim=1).permute((1, 0))
    acc0 = warpgroup_mma(
        gl.convert_layout(q0, a_l, assert_trivial=True), b0, acc0,
        is_async=True,
    )  # fmt: skip
    acc1 = warpgroup_mma(
        gl.convert_layout(q1, a_l, assert_trivial=True), b1, acc1,
        is_async=True,
    )  # fmt: skip
    acc2 = warpgroup_mma(
        gl.convert_layout(q2, a_l, assert_trivial=True), b2, acc2,
        is_async=True,
    )  # fmt: skip
    return acc0, acc1, acc2


@jit
def _consume(
    shared, c: gl.constexpr, C: gl.constexpr, HAS_BIAS: gl.constexpr,
    BO: gl.constexpr, NKB: gl.constexpr, STAGES: gl.constexpr, G: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """Consumer c of C (one warpgroup): the program's row blocks c, c + C, ..,
    each K step from its own ring (stages ``c STAGES ..``), which it hands back
    to the loader as soon as the step's permutations are done."""
    (xs, ws, ps, bs, ready, empty, y_ptr, B, O, stride_yb, o0, pid_r, nprog_r,
     n_mine) = shared  # fmt: skip
    BB: gl.constexpr = 64  # rows: one warpgroup, 16 a warp
    BX: gl.constexpr = 4 * G  # inputs per K step; columns of one box of x or W
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BO, G]
    )
    p_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BX, G]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(
        operand_index=0, parent=acc_l, k_width=G // 8
    )
    zero = gl.zeros([BB, BX], gl.float32, layout=p_l)
    j = 0  # this consumer's K steps so far
    # [book: tc-consumer]
    for i in range(c, n_mine, C):
        # the accumulators start at the bias (m = 0) and zero: y's rounding is then
        # the epilogue's last step, and the epilogue can move bf16. (The bias comes
        # from shared memory: loaded from global memory in this layout its 64-bit
        # pointers made the consumer spill.)
        acc0 = gl.zeros([BB, BO], gl.float32, layout=acc_l)
        if HAS_BIAS:
            bias = bs.load(gl.SliceLayout(0, acc_l))
            acc0 = acc0 + bias.to(gl.float32)[None, :]
        acc1 = gl.zeros([BB, BO], gl.float32, layout=acc_l)
        acc2 = gl.zeros([BB, BO], gl.float32, layout=acc_l)
        for kk in gl.static_range(NKB):  # the K steps, unrolled: no drain between
            s = c * STAGES + j % STAGES
            mbarrier.wait(ready.index(s), (j // STAGES) & 1)
            # four groups: at most two permutations and two sets of products
            # queued, waited for oldest first (wgmma groups retire in order)
            p0 = _split_modes(xs, ps, s, 0, zero, G)
            p1 = _split_modes(xs, ps, s, 1, zero, G)
            p0 = warpgroup_mma_wait(3, deps=[p0])
            acc0, acc1, acc2 = _products(
                p0, ws, kk, 0, acc0, acc1, acc2, a_l, BB, NKB, G
            )
            p2 = _split_modes(xs, ps, s, 2, zero, G)
            p1 = warpgroup_mma_wait(6, deps=[p1])
            acc0, acc1, acc2 = _products(
                p1, ws, kk, 1, acc0, acc1, acc2, a_l, BB, NKB, G
            )
            p3 = _split_modes(xs, ps, s, 3, zero, G)
            p2 = warpgroup_mma_wait(6, deps=[p2])
            acc0, acc1, acc2 = _products(
                p2, ws, kk, 2, acc0, acc1, acc2, a_l, BB, NKB, G
            )
            p3 = warpgroup_mma_wait(3, deps=[p3])
            # the stage's permutations are done (the products read registers and
            # W): it goes back to the loader
            mbarrier.arrive(empty.index(s), count=1)
            acc0, acc1, acc2 = _products(
                p3, ws, kk, 3, acc0, acc1, acc2, a_l, BB, NKB, G
            )
            j += 1
        # [book: end tc-consumer]
        # the row block's y: the modes joined, stored
        acc0, acc1, acc2 = warpgroup_mma_wait(0, deps=[acc0, acc1, acc2])
        store_modes(  # the bias is in acc0: no b_ptr (y_ptr stands in)
            acc0, acc1, acc2, y_ptr, y_ptr, (pid_r + i * nprog_r) * BB, o0, B, O,
            stride_yb, False, BB, BO, num_warps,
        )  # fmt: skip


@jit
def _load_step(
    x_desc, xs, ready, empty, s, t, rb, kk: gl.constexpr, STAGES: gl.constexpr
):
    """K box kk of row block rb into stage s, the t-th use of that stage's ring
    position: wait until its consumer gave it back, then three TMA boxes of
    ``[64, 4 G]`` that signal its ready barrier."""
    BB: gl.constexpr = x_desc.block_type.shape[0]
    BX: gl.constexpr = x_desc.block_type.shape[1]
    mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # the first pass is free
    mbarrier.expect(ready.index(s), 3 * x_desc.block_type.nbytes)
    for b in gl.static_range(3):
        tma.async_copy_global_to_shared(
            x_desc, [rb * BB, 3 * BX * kk + BX * b], ready.index(s), xs.index(3 * s + b)
        )


@jit
def _load(
    x_desc, xs, ready, empty, pid_r, nprog_r, n_mine,
    C: gl.constexpr, NKB: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """The loader (one warp): x's K steps into the C rings, row block i to
    consumer i mod C, a round of C row blocks at a time."""
    t = 0  # K steps per ring so far (the same for every ring)
    for i in range(0, n_mine, C):
        for kk in gl.static_range(NKB):
            for c in gl.static_range(C):
                if i + c < n_mine:
                    _load_step(
                        x_desc, xs, ready, empty, c * STAGES + t % STAGES, t,
                        pid_r + (i + c) * nprog_r, kk, STAGES,
                    )  # fmt: skip
            t += 1


@jit
def _eqlin_fwd_tc_kernel(
    x_desc,
    w_desc,
    p_ptr,
    b_ptr,
    y_ptr,
    B,
    O,
    stride_yb,
    n_rb,
    HAS_BIAS: gl.constexpr,
    BO: gl.constexpr,
    NKB: gl.constexpr,
    C: gl.constexpr,
    STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    BB: gl.constexpr = x_desc.block_type.shape[0]  # rows: 16 a warp
    dt: gl.constexpr = x_desc.dtype
    G: gl.constexpr = 16 if dt == gl.bfloat16 else 8  # inputs per group, wgmma's k
    BX: gl.constexpr = 4 * G  # inputs per K step; columns of one box of x or W
    ob = gl.program_id(0)
    pid_r = gl.program_id(1)
    nprog_r = gl.num_programs(1)
    o0 = ob * BO

    xs = gl.allocate_shared_memory(dt, [3 * C * STAGES, BB, BX], x_desc.layout)
    ws = gl.allocate_shared_memory(dt, [3 * NKB, BO, BX], w_desc.layout)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BX, G], dt)
    ps = gl.allocate_shared_memory(dt, [3, BX, G], p_sl)
    bl: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [C * STAGES, 1], bl)
    empty = gl.allocate_shared_memory(gl.int64, [C * STAGES, 1], bl)
    wbar = gl.allocate_shared_memory(gl.int64, [1, 1], bl)
    for i in gl.static_range(C * STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(wbar.index(0), count=1)

    # 1. this program's slice of W, once: mode m, K box kb -> ws[m NKB + kb]
    mbarrier.expect(wbar.index(0), 3 * NKB * w_desc.block_type.nbytes)
    for m in gl.static_range(3):
        for kb in gl.static_range(NKB):
            tma.async_copy_global_to_shared(
                w_desc, [m * O + o0, BX * kb], wbar.index(0), ws.index(m * NKB + kb)
            )
    # the three slices of P
    pl: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [num_warps, 1], [1, 0])
    pn = gl.arange(0, BX, layout=gl.SliceLayout(1, pl))[:, None]
    pc = gl.arange(0, G, layout=gl.SliceLayout(0, pl))[None, :]
    for j in gl.static_range(3):
        ps.index(j).store(gl.load(p_ptr + j * BX * G + pn * G + pc))
    # the bias of this program's outputs
    bs = gl.allocate_shared_memory(dt, [BO], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if HAS_BIAS:
        bo = o0 + gl.arange(0, BO, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        bs.store(gl.load(b_ptr + bo, mask=bo < O, other=0.0))
    fence_async_shared()
    mbarrier.wait(wbar.index(0), 0)
    gl.thread_barrier()

    # 2. C consumer warpgroups on alternate row blocks, a loader warp feeding them
    # (the consumers' shared values go as one tuple; constexprs cannot)
    n_mine = gl.cdiv(n_rb - pid_r, nprog_r)  # this program's row blocks
    shared = (xs, ws, ps, bs, ready, empty, y_ptr, B, O, stride_yb, o0, pid_r, nprog_r,
              n_mine)  # fmt: skip
    if C == 2:
        gl.warp_specialize(
            [
                (_consume, (shared, 0, C, HAS_BIAS, BO, NKB, STAGES, G, num_warps)),
                (_consume, (shared, 1, C, HAS_BIAS, BO, NKB, STAGES, G, num_warps)),
                (
                    _load,
                    (x_desc, xs, ready, empty, pid_r, nprog_r, n_mine, C, NKB, STAGES),
                ),
            ],
            [num_warps, 1],
            [CONSUMER_REGS, 24],
        )
    else:
        gl.warp_specialize(
            [
                (_consume, (shared, 0, C, HAS_BIAS, BO, NKB, STAGES, G, num_warps)),
                (
                    _load,
                    (x_desc, xs, ready, empty, pid_r, nprog_r, n_mine, C, NKB, STAGES),
                ),
            ],
            [1],
            [24],
        )


# --------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------
#: Per CUDA device and dtype, made on the first call: the 0/1 matrices there, the SM
#: count, and the shared layout of a box of 128-byte rows (x's boxes and W's alike).
_DEVICE: dict = {}


def _device_state(x: torch.Tensor) -> tuple:
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if (dev, x.dtype) not in _DEVICE:
        gl_dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float32
        _DEVICE[dev, x.dtype] = (
            mode_split_matrices(x.dtype, x.device).contiguous(),
            torch.cuda.get_device_properties(dev).multi_processor_count,
            gl.NVMMASharedLayout.get_default_for([64, BLOCK_K[x.dtype]], gl_dt),
        )
    return _DEVICE[dev, x.dtype]


def shape_reason(
    dtype: torch.dtype, n_ang: int, K: int, O: int, device_type: str
) -> str | None:
    """Why the kernel cannot serve a call of this dtype, n_ang, K (inputs), O
    (outputs) and device, before any tensor is looked at; None when it can."""
    if gluon is None:
        return "no validated Gluon in this Triton"
    if dtype not in BLOCK_K:
        return f"{dtype}: the kernel is bf16 and fp32 (TF32) only"
    if n_ang != 3:
        return f"n_ang = {n_ang}: the mode split is written for 3"
    bk, bo = BLOCK_K[dtype], LAUNCH[dtype].block_o
    if K % bk or O % bo or K == 0 or O == 0:
        return f"K = {K}, O = {O}: K must be a positive multiple of {bk}, O of {bo}"
    if K > MAX_K[dtype]:
        return f"K = {K} > {MAX_K[dtype]}: W's slice would not fit in shared memory"
    if device_type != "cuda":
        return "not a CUDA tensor"
    return None


def tc_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why :func:`tc_fwd` cannot serve ``x (B, K, n_ang)``, ``w (n_ang, O, K)``, or
    None when it can."""
    reason = shape_reason(x.dtype, x.shape[2], x.shape[1], w.shape[1], x.device.type)
    return reason if reason is not None else operand_reason(x, w)


def operand_reason(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the kernel cannot take x and w as they lie (dtype, device, layout,
    alignment), whatever their shapes, or None when it can."""
    if w.dtype != x.dtype or w.device != x.device:
        return "w's dtype or device is not x's"
    if not x.is_contiguous() or not w.is_contiguous():
        return "x or w is not contiguous"
    if x.data_ptr() % 16 or w.data_ptr() % 16:
        return "x or w is not 16-byte aligned"
    return None


def tc_fwd(x, w, bias, launch: Launch | None = None) -> torch.Tensor:
    """``y (B, O, 3)`` for ``x (B, K, 3)``, ``w (3, O, K)`` (both contiguous, 16-byte
    aligned), ``bias (O,)`` contiguous or None: the forward, or the input backward with
    ``w`` the contiguous W^T. The caller checked :func:`tc_reason`; ``launch``
    defaults to :func:`default_launch` for K."""
    B, K, _ = x.shape
    O = w.shape[1]
    y = torch.empty((B, O, 3), device=x.device, dtype=x.dtype)
    p, n_sms, box = _device_state(x)
    ln = launch or default_launch(x.dtype, K)
    bo = ln.block_o
    bk = BLOCK_K[x.dtype]
    x_desc = TensorDescriptor.from_tensor(x.view(B, 3 * K), [64, bk], box)
    w_desc = TensorDescriptor.from_tensor(w.view(3 * O, K), [bo, bk], box)
    n_ot, n_rb = O // bo, triton.cdiv(B, 64)
    # one program per SM: each output block gets a share of them, its programs walk
    # the row blocks
    grid = (n_ot, max(1, min(n_rb, n_sms // n_ot)))
    _eqlin_fwd_tc_kernel[grid](
        x_desc, w_desc, p, bias if bias is not None else w, y, B, O,
        y.stride(0), n_rb, HAS_BIAS=bias is not None, BO=bo, NKB=K // bk,
        C=ln.consumers, STAGES=ln.stages, CONSUMER_REGS=ln.regs, num_warps=4,
    )  # fmt: skip
    return y
