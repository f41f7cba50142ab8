"""The fused zonal scatter of the geometric initial embedding (chapter 5).

Formula and shapes (s >= 1; row s = 0 of the output is zero)::

    h0[n, s, c] = k * sum_{e: dst_e = n} Z[e, s-1] * R[e, l(s)-1, c]

    Z (E, S-1)   the m = 0 rows of the edge Wigner blocks, degrees 1..L
    R (E, L, C)  radial features per degree and channel
    dst (E,)     int64, sorted ascending; row_ptr (N+1,) int64, its CSR pointer
    h0 (N, S, C) with S = (L+1)^2, k = scale

Gradients (G = dLoss/dh0, (N, S, C)); gather-only, no atomics, one pass over edges::

    dZ[e, s-1] = k * sum_c G[dst_e, s, c] * R[e, l(s)-1, c]
    dR[e, l-1, c] = k * sum_{s: l(s) = l} G[dst_e, s, c] * Z[e, s-1]

The backward is bilinear in (G, Z, R), so its derivatives are again zonal scatters and
edge gathers: with (gZ, gR) the cotangents of (dZ, dR),

    dG = zonal_scatter(gZ, R) + zonal_scatter(Z, gR)
    dZ', dR' = edge_gather(G, gZ, gR)     (dZ' pairs G with gR, dR' pairs G with gZ)

so two kernels serve the forward, the backward and every higher derivative (a force
training step needs the second). The per-edge message ``(E, S-1, C)`` is never
materialised.

Bytes moved (forward, fp32): reads Z and R once, ``4 E (S-1 + L C)``, plus ``dst``-free
CSR offsets; writes ``4 N S C``. At E = 365k, L = 3, C = 32: about 160 MB read, 8 MB
written.

Status: deterministic (each destination's segment in ascending CSR order; the backward
has no reduction across edges), fp64 (fp64 accumulation), fp32/bf16/fp16 (fp32
accumulation), L = 1..4, any C (padded to a power of two and masked), int64 offsets,
nodes with no edges, E = 0, any strides (the index tensors are made contiguous).
Registered as ``torch.library`` ops (``ecekern::zonal_scatter_fwd``,
``ecekern::zonal_edge_gather``) with fake implementations, ``triton_op`` on the GPU so
that inductor traces the Triton launches inside, custom ops in the interpreter; two
autograd Functions around them (:mod:`ecekern._autograd`'s style: the ops in eager
mode and while compiling, autograd in the Functions), each backward calling the two
Functions again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import options, reference
from ._autograd import library_op, wrap_triton
from ._triton import INTERPRET, split_scale, tl, triton, why_not_triton

__all__ = ["ZonalLaunch", "why_not", "zonal_scatter"]


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _degree_block(
    zr, st, acc, l: tl.constexpr, L: tl.constexpr, D_PAD: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):  # fmt: skip
    """``acc[e, d, c] += Z[e, l^2 - 1 + d] R[e, l - 1, c]`` for the 2l + 1 rows of
    degree l <= L (acc unchanged past L): one coalesced ``[BLOCK_E, C]`` row of R,
    read once. ``zr`` holds the pointers, offsets and masks, ``st`` the strides of Z
    and R; ``acc`` is ``[BLOCK_E, D_PAD, C_PAD]``."""
    if l <= L:
        z_ptr, r_ptr, offs_e, mask_e, offs_c, mask_c = zr
        stride_z_e, stride_z_s, stride_r_e, stride_r_l, stride_r_c = st
        offs_d = tl.arange(0, D_PAD)
        mask_d = offs_d < 2 * l + 1
        z = tl.load(
            z_ptr
            + offs_e[:, None] * stride_z_e
            + (l * l - 1 + offs_d)[None, :] * stride_z_s,
            mask=mask_e[:, None] & mask_d[None, :],
            other=0.0,
        ).to(ACC_DTYPE)
        r = tl.load(
            r_ptr
            + offs_e[:, None] * stride_r_e
            + (l - 1) * stride_r_l
            + offs_c[None, :] * stride_r_c,
            mask=mask_e[:, None] & mask_c[None, :],
            other=0.0,
        ).to(ACC_DTYPE)
        acc = acc + z[:, :, None] * r[:, None, :]
    return acc


@triton.jit
def _degree_store(
    o, acc, scale_hi, scale_lo, l: tl.constexpr, L: tl.constexpr, D_PAD: tl.constexpr
):
    """Sum the edge lanes of degree l <= L and store its 2l + 1 output rows."""
    if l <= L:
        out_ptr, n, offs_c, mask_c, stride_o_n, stride_o_s, stride_o_c = o
        offs_d = tl.arange(0, D_PAD)
        h = tl.sum(acc, axis=0)  # [D_PAD, C_PAD]
        tl.store(
            out_ptr
            + n * stride_o_n
            + (l * l + offs_d)[:, None] * stride_o_s
            + offs_c[None, :] * stride_o_c,
            (h * scale_hi + h * scale_lo).to(out_ptr.dtype.element_ty),
            mask=(offs_d < 2 * l + 1)[:, None] & mask_c[None, :],
        )


@triton.jit
def _zero_row(out_ptr, n, offs_c, mask_c, stride_o_n, stride_o_c):
    """Row s = 0 of node n: the degree-0 slot, which the zonal scatter leaves zero."""
    zero = tl.zeros(offs_c.shape, out_ptr.dtype.element_ty)
    tl.store(out_ptr + n * stride_o_n + offs_c * stride_o_c, zero, mask=mask_c)


@triton.jit
def _zonal_fwd_degrees_kernel(
    # pointers
    z_ptr, r_ptr, row_ptr_ptr, out_ptr,
    # sizes
    E, C, scale_hi, scale_lo,
    # strides
    stride_z_e, stride_z_s, stride_r_e, stride_r_l, stride_r_c,
    stride_o_n, stride_o_s, stride_o_c,
    # meta-parameters
    L: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    D4: tl.constexpr, C_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
    STAGES: tl.constexpr, ACC_DTYPE: tl.constexpr,
):  # fmt: skip
    """One destination node: walk its CSR segment in blocks of edges, degree by
    degree, one partial sum per edge lane, ``[BLOCK_E, D_l, C]``, summed once at the
    end. ``D_l`` is 2l + 1 rounded up to a power of two. With ``STAGES > 1`` the loads
    of the next blocks are in flight (through shared memory) while this one is
    summed."""
    n = tl.program_id(0).to(tl.int64)
    # clamped: a CSR that was not validated (traced graphs) cannot read out of bounds
    start = tl.minimum(tl.maximum(tl.load(row_ptr_ptr + n), 0), E)
    end = tl.minimum(tl.maximum(tl.load(row_ptr_ptr + n + 1), start), E)
    offs_c = tl.arange(0, C_PAD)
    mask_c = offs_c < C
    acc1 = tl.zeros([BLOCK_E, D1, C_PAD], ACC_DTYPE)
    acc2 = tl.zeros([BLOCK_E, D2, C_PAD], ACC_DTYPE)
    acc3 = tl.zeros([BLOCK_E, D3, C_PAD], ACC_DTYPE)
    acc4 = tl.zeros([BLOCK_E, D4, C_PAD], ACC_DTYPE)
    for e0 in tl.range(start, end, BLOCK_E, num_stages=STAGES):
        # 1. one block of edges, each degree's rows of Z and its row of R
        offs_e = e0 + tl.arange(0, BLOCK_E)
        mask_e = offs_e < end
        zr = (z_ptr, r_ptr, offs_e, mask_e, offs_c, mask_c)
        st = (stride_z_e, stride_z_s, stride_r_e, stride_r_l, stride_r_c)
        acc1 = _degree_block(zr, st, acc1, 1, L, D1, ACC_DTYPE)
        acc2 = _degree_block(zr, st, acc2, 2, L, D2, ACC_DTYPE)
        acc3 = _degree_block(zr, st, acc3, 3, L, D3, ACC_DTYPE)
        acc4 = _degree_block(zr, st, acc4, 4, L, D4, ACC_DTYPE)
    # 2. row 0 is zero; rows 1..S-1 degree by degree
    _zero_row(out_ptr, n, offs_c, mask_c, stride_o_n, stride_o_c)
    o = (out_ptr, n, offs_c, mask_c, stride_o_n, stride_o_s, stride_o_c)
    _degree_store(o, acc1, scale_hi, scale_lo, 1, L, D1)
    _degree_store(o, acc2, scale_hi, scale_lo, 2, L, D2)
    _degree_store(o, acc3, scale_hi, scale_lo, 3, L, D3)
    _degree_store(o, acc4, scale_hi, scale_lo, 4, L, D4)


@triton.jit
def _degree_of_row(offs_s, mask_s, other: tl.constexpr):
    """``l(s) - 1`` for the rows ``s = offs_s + 1`` of Z, where ``l = floor(sqrt(s))``;
    ``other`` where masked. Computed, not loaded from a table: the ops then take no
    tensor they did not get as an input (what inductor needs to trace a triton_op).
    The half keeps the floor exact under an approximate square root."""
    l_idx = tl.sqrt((offs_s + 1).to(tl.float32) + 0.5).to(tl.int32) - 1
    return tl.where(mask_s, l_idx, other)


@triton.jit
def _edge_grads(
    g,
    z_ptr,
    r_ptr,
    dz_ptr,
    dr_ptr,
    offs_e,
    mask_e,
    offs_s,
    mask_s,
    offs_c,
    mask_c,
    l_idx,
    SM1,
    C,
    scale,
    stride_z,
    stride_r,
    L: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    """dZ and dR of one block of edges, given G at their destinations ``g``
    (``[BLOCK_E, S_PAD, C_PAD]``); ``scale = (hi, lo)``, ``stride_z = (e, s)``,
    ``stride_r = (e, l, c)``."""
    scale_hi, scale_lo = scale[0], scale[1]
    stride_z_e, stride_z_s = stride_z[0], stride_z[1]
    stride_r_e, stride_r_l, stride_r_c = stride_r[0], stride_r[1], stride_r[2]
    mask3 = mask_e[:, None, None] & mask_s[None, :, None] & mask_c[None, None, :]
    r = tl.load(
        r_ptr
        + offs_e[:, None, None] * stride_r_e
        + tl.maximum(l_idx, 0)[None, :, None] * stride_r_l
        + offs_c[None, None, :] * stride_r_c,
        mask=mask3,
        other=0.0,
    ).to(ACC_DTYPE)
    z = tl.load(
        z_ptr + offs_e[:, None] * stride_z_e + offs_s[None, :] * stride_z_s,
        mask=mask_e[:, None] & mask_s[None, :],
        other=0.0,
    ).to(ACC_DTYPE)
    # dZ: contract channels
    dz = tl.sum(g * r, axis=2)
    dz = dz * scale_hi + dz * scale_lo
    tl.store(
        dz_ptr + offs_e[:, None] * SM1 + offs_s[None, :],
        dz.to(dz_ptr.dtype.element_ty),
        mask=mask_e[:, None] & mask_s[None, :],
    )
    # dR: contract the 2l+1 rows of each degree
    gz = g * z[:, :, None]
    for l in tl.static_range(L):
        drl = tl.sum(tl.where((l_idx == l)[None, :, None], gz, 0.0), axis=1)
        drl = drl * scale_hi + drl * scale_lo
        tl.store(
            dr_ptr + offs_e[:, None] * (L * C) + l * C + offs_c[None, :],
            drl.to(dr_ptr.dtype.element_ty),
            mask=mask_e[:, None] & mask_c[None, :],
        )


@triton.jit
def _zonal_gather_kernel(
    # pointers
    g_ptr,
    z_ptr,
    r_ptr,
    dst_ptr,
    dz_ptr,
    dr_ptr,
    # sizes
    E,
    N,
    SM1,
    C,
    scale_hi,
    scale_lo,
    # strides
    stride_g_n,
    stride_g_s,
    stride_g_c,
    stride_z_e,
    stride_z_s,
    stride_r_e,
    stride_r_l,
    stride_r_c,
    # meta-parameters
    L: tl.constexpr,
    S_PAD: tl.constexpr,
    C_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    """One block of edges: ``dz (E, S-1)`` and ``dr (E, L, C)``, both contiguous."""
    pid = tl.program_id(0).to(tl.int64)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_s = tl.arange(0, S_PAD)
    offs_c = tl.arange(0, C_PAD)
    mask_e = offs_e < E
    mask_s = offs_s < SM1
    mask_c = offs_c < C
    l_idx = _degree_of_row(offs_s, mask_s, -1)
    dst = tl.load(dst_ptr + offs_e, mask=mask_e, other=0)
    dst = tl.minimum(tl.maximum(dst, 0), N - 1)  # never out of bounds, even unchecked
    # 1. gather G at each edge's destination, rows 1..S-1: [BLOCK_E, S_PAD, C_PAD]
    g = tl.load(
        g_ptr
        + dst[:, None, None] * stride_g_n
        + (offs_s[None, :, None] + 1) * stride_g_s
        + offs_c[None, None, :] * stride_g_c,
        mask=mask_e[:, None, None] & mask_s[None, :, None] & mask_c[None, None, :],
        other=0.0,
    ).to(ACC_DTYPE)
    # 2. dZ and dR of the block
    _edge_grads(
        g,
        z_ptr,
        r_ptr,
        dz_ptr,
        dr_ptr,
        offs_e,
        mask_e,
        offs_s,
        mask_s,
        offs_c,
        mask_c,
        l_idx,
        SM1,
        C,
        (scale_hi, scale_lo),
        (stride_z_e, stride_z_s),
        (stride_r_e, stride_r_l, stride_r_c),
        L,
        ACC_DTYPE,
    )


# --------------------------------------------------------------------------------------
# launchers: check, allocate, launch
# --------------------------------------------------------------------------------------
def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


@dataclass(frozen=True)
class ZonalLaunch:
    """The kernels' launch: the register tile of each (in fp32 elements, halved for
    fp64), warps per program, and the software-pipelining stages of the forward's
    CSR walk (the next blocks' loads in flight through shared memory). BLOCK_E is the
    tile divided by the padded rows times the padded channels of one edge, so the
    tile, not BLOCK_E, stays fixed when L or C grows. The defaults are chapter 5's
    fastest at E = 365k, L = 3, C = 32 (BLOCK_E = 8 forward and backward there); one
    fixed choice, so results are the same bits in every process."""

    fwd_tile: int = 5120
    fwd_warps: int = 1
    fwd_stages: int = 4
    bwd_tile: int = 4096
    bwd_warps: int = 1


def edges_per_block(tile: int, rows: int, C_PAD: int) -> int:
    """The largest power of two ``BLOCK_E`` with ``BLOCK_E * rows * C_PAD <= tile``
    (at least 1, at most 64)."""
    n = max(1, tile // (rows * C_PAD))
    return min(64, 1 << (n.bit_length() - 1))


def fwd_rows(L: int) -> int:
    """Padded rows of one edge in the forward's register tile: each degree's 2l + 1
    rounded up to a power of two, summed."""
    return sum(triton.next_power_of_2(2 * l + 1) for l in range(1, L + 1))


def _block_e(tile: int, rows: int, C_PAD: int, dtype: torch.dtype) -> int:
    if INTERPRET:
        return 16
    return edges_per_block(tile // (2 if dtype == torch.float64 else 1), rows, C_PAD)


def zonal_scatter_fwd(
    Z, R, row_ptr, scale: float, launch: ZonalLaunch = ZonalLaunch()
) -> torch.Tensor:
    """Launch the forward kernel: ``(N, S, C)``, one program per destination node;
    ``row_ptr`` contiguous."""
    E, L, C = R.shape
    # L and C pick compile-time tile shapes: plain ints, also while inductor traces
    # with symbolic sizes; E and N stay symbolic
    L, C = int(L), int(C)
    S = (L + 1) ** 2
    N = row_ptr.shape[0] - 1
    out = torch.empty((N, S, C), device=Z.device, dtype=Z.dtype)
    if N == 0 or C == 0:
        return out
    C_PAD = triton.next_power_of_2(C)
    D = [triton.next_power_of_2(2 * l + 1) if l <= L else 1 for l in (1, 2, 3, 4)]
    wrap_triton(_zonal_fwd_degrees_kernel)[(N,)](
        Z, R, row_ptr, out, E, C, *split_scale(scale),
        Z.stride(0), Z.stride(1), R.stride(0), R.stride(1), R.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        L=L, D1=D[0], D2=D[1], D3=D[2], D4=D[3], C_PAD=C_PAD,
        BLOCK_E=_block_e(launch.fwd_tile, fwd_rows(L), C_PAD, Z.dtype),
        STAGES=launch.fwd_stages, ACC_DTYPE=_acc(Z.dtype), num_warps=launch.fwd_warps,
    )  # fmt: skip
    return out


def zonal_edge_gather(
    G, Z, R, dst, row_ptr, scale: float, launch: ZonalLaunch = ZonalLaunch()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the gather: ``dZ (E, S-1)`` and ``dR (E, L, C)`` by blocks of edges;
    ``dst`` contiguous."""
    E, L, C = R.shape
    L, C = int(L), int(C)  # compile-time tile shapes (see zonal_scatter_fwd)
    S = (L + 1) ** 2
    dz = torch.empty((E, S - 1), device=Z.device, dtype=Z.dtype)
    dr = torch.empty((E, L, C), device=Z.device, dtype=Z.dtype)
    if E == 0 or C == 0 or row_ptr.shape[0] < 2:  # no edges, or no node to read
        return dz.zero_(), dr.zero_()
    S_PAD, C_PAD = triton.next_power_of_2(S - 1), triton.next_power_of_2(C)
    BE = _block_e(launch.bwd_tile, S_PAD, C_PAD, Z.dtype)
    wrap_triton(_zonal_gather_kernel)[(triton.cdiv(E, BE),)](
        G, Z, R, dst, dz, dr, E, row_ptr.shape[0] - 1, S - 1, C, *split_scale(scale),
        G.stride(0), G.stride(1), G.stride(2), Z.stride(0), Z.stride(1),
        R.stride(0), R.stride(1), R.stride(2),
        L=L, S_PAD=S_PAD, C_PAD=C_PAD, BLOCK_E=BE, ACC_DTYPE=_acc(Z.dtype),
        num_warps=launch.bwd_warps,
    )  # fmt: skip
    return dz, dr


# --------------------------------------------------------------------------------------
# torch.library ops, and the autograd Functions around them: each derivative is one of
# the two Functions again
# --------------------------------------------------------------------------------------
def _scatter_fake(Z, R, dst, row_ptr, scale):
    E, L, C = R.shape
    return Z.new_empty((row_ptr.shape[0] - 1, (L + 1) ** 2, C))


@library_op("zonal_scatter_fwd", _scatter_fake)
def _scatter_lib(
    Z: torch.Tensor,
    R: torch.Tensor,
    dst: torch.Tensor,
    row_ptr: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return zonal_scatter_fwd(Z, R, row_ptr, scale)


def _gather_fake(G, Z, R, dst, row_ptr, scale):
    return Z.new_empty(Z.shape), R.new_empty(R.shape)


@library_op("zonal_edge_gather", _gather_fake)
def _gather_lib(
    G: torch.Tensor,
    Z: torch.Tensor,
    R: torch.Tensor,
    dst: torch.Tensor,
    row_ptr: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return zonal_edge_gather(G, Z, R, dst, row_ptr, scale)


class _ScatterFn(torch.autograd.Function):
    """``(Z, R) -> h0`` by the scatter op; its backward is the gather."""

    @staticmethod
    def forward(ctx, Z, R, dst, row_ptr, scale):
        ctx.save_for_backward(Z, R, dst, row_ptr)
        ctx.scale = scale
        return _scatter_lib(Z, R, dst, row_ptr, scale)

    @staticmethod
    def backward(ctx, G):
        Z, R, dst, row_ptr = ctx.saved_tensors
        dZ, dR = _GatherFn.apply(G.contiguous(), Z, R, dst, row_ptr, ctx.scale)
        return dZ, dR, None, None, None


class _GatherFn(torch.autograd.Function):
    """``(G, Z, R) -> (dZ, dR)`` by the gather op; bilinear, so its backward is two
    scatters and a gather."""

    @staticmethod
    def forward(ctx, G, Z, R, dst, row_ptr, scale):
        ctx.save_for_backward(G, Z, R, dst, row_ptr)
        ctx.scale = scale
        return _gather_lib(G, Z, R, dst, row_ptr, scale)

    @staticmethod
    def backward(ctx, gZ, gR):
        G, Z, R, dst, row_ptr = ctx.saved_tensors
        k = ctx.scale
        gZ, gR = gZ.contiguous(), gR.contiguous()
        dG = _ScatterFn.apply(gZ, R, dst, row_ptr, k) + _ScatterFn.apply(
            Z, gR, dst, row_ptr, k
        )
        # dZ' = k sum_c G R'  with R' = gR; dR' = k sum_{s in l} G Z' with Z' = gZ
        dZ, dR = _GatherFn.apply(G, gZ, gR, dst, row_ptr, k)
        return dG, dZ, dR, None, None, None


def _scatter_op(Z, R, dst, row_ptr, scale: float) -> torch.Tensor:
    """The fused scatter past :func:`zonal_scatter`'s checks and fallback,
    differentiable (what the captures time); Z, R, dst and row_ptr contiguous."""
    return _ScatterFn.apply(Z, R, dst, row_ptr, scale)


def _gather_op(G, Z, R, dst, row_ptr, scale: float):
    """The fused gather ``(dZ, dR)`` (the scatter's backward) past the checks,
    differentiable; G, Z, R, dst and row_ptr contiguous."""
    return _GatherFn.apply(G, Z, R, dst, row_ptr, scale)


# --------------------------------------------------------------------------------------
# public function
# --------------------------------------------------------------------------------------
def why_not(device_type: str, L: int) -> str | None:
    """Why the fused op cannot serve tensors on ``device_type`` at degree L, or
    None."""
    reason = why_not_triton(device_type)
    if reason is None and not 1 <= L <= 4:
        reason = f"L = {L} is outside 1..4"
    return reason


def zonal_scatter(
    Z, R, dst, row_ptr, scale: float, *, validate: bool = True
) -> torch.Tensor:
    """Computes the same as :func:`ecekern.reference.zonal_scatter`, fused.

    ``h0[n, s, c] = scale * sum_{e: dst_e = n} Z[e, s-1] R[e, l(s)-1, c]`` for s >= 1,
    row 0 zero, without the ``(E, S-1, C)`` message tensor; deterministic;
    differentiable to any order (each derivative is again a zonal scatter or an edge
    gather). Same arguments, checks and errors as the reference.

    ``validate=False`` skips the checks of the CSR's values (several host syncs per
    call) for a graph known to be consistent, such as one from
    ``ecekern.graph.build_graph``; they are skipped while tracing too. Types and
    shapes are always checked, and the kernels clamp every index they read, so an
    inconsistent CSR gives wrong numbers, never an out-of-bounds access.
    """
    values = validate and not torch.compiler.is_compiling()
    reference.check_zonal_scatter(Z, R, dst, row_ptr, values=values)
    reason = why_not(Z.device.type, R.shape[1])
    if reason is not None:
        options.fallback("zonal_scatter", reason)
        return reference.zonal_scatter(Z, R, dst, row_ptr, scale, validate=False)
    # the kernels read the index tensors as contiguous (any strides for Z and R)
    dst, row_ptr = dst.contiguous(), row_ptr.contiguous()
    return _ScatterFn.apply(Z.contiguous(), R.contiguous(), dst, row_ptr, float(scale))


def traffic(E: int, N: int, L: int, C: int, elem_size: int) -> dict:
    """The bytes and flops model of the forward and the backward.

    Forward: Z and R read once, the ``(N, S, C)`` output written once, plus the CSR
    pointer. Backward: G gathered once per edge (its rows are read once per incoming
    edge: ``E (S-1) C`` elements, the cost of gather-only), Z and R read, dZ and dR
    written, plus ``dst``.
    """
    S = (L + 1) ** 2
    z, r = E * (S - 1), E * L * C
    return {
        "bytes_fwd": elem_size * (z + r + N * S * C) + 8 * (N + 1),
        "bytes_bwd": elem_size * (E * (S - 1) * C + 2 * z + 2 * r) + 8 * E,
        "flops_fwd": 2 * E * (S - 1) * C,
        "message_bytes": elem_size * E * (S - 1) * C,
    }
