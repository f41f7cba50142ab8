"""The step's geometry in one kernel per edge tile: edge vectors, lengths, the
envelope and the packed Wigner tiles of the edge frames; and one for their adjoint.

Formula (the reference composition, :func:`geometry_torch`), per edge e::

    r_e = x[src_e] + shift_e @ cell - x[dst_e]        (a padding edge: (pad, 0, 0))
    d_e = |r_e|,  u_e = r_e / d_e,  env_e = u(d_e / r_c)         (DimeNet, p = 6)
    R_e = F_s (I + K + K^2 / (1 + s u_z)),  s = sign(u_z)   (so3.edge_rotations)
    P[e, s, t, m] = D_l(R_e)[row_t(l(s), m), s]    (edge_frame.pack; :func:`pack`)
    Z[e, s - 1] = P[e, s, 0, 0]                                   (the zonal rows)

``D_l(R)`` is a polynomial in R's entries, written out per (L, M) by
:mod:`ecekern.tools.gen_geometry` into :mod:`ecekern.step.wigner`, with its adjoint.

Shapes: positions ``(N, 3)``, cell ``(3, 3)``, src, dst ``(E,)`` int64, shifts
``(E, 3)`` int64 -> ``P (E, S, 2, n_ang)``, ``Z (E, S - 1)``, ``d (E,)``,
``env (E,)``; ``S = (L + 1)^2``, ``n_ang = M + 1``.

Gradients (the force step's, :func:`geometry_bwd`, recomputing r, u and R in the
tile): ``g_u = dR/du^T (sum_k gP_k dP_k/dR)``; ``g_r = (g_u - u (u . g_u)) / d +
u (g_d + g_env du/dd)`` (zero for padding edges); the positions' gradient
``g_x[n] = sum_{src_e = n} g_r[e] - sum_{dst_e = n} g_r[e]`` by one program per atom
over the two CSR orders (no atomics: deterministic), and the cell's, when asked,
``g_cell[a] = sum_e shift_e[a] g_r[e]``. A second derivative (grad mode on in the
backward: force training) recomputes :func:`geometry_torch` differentiably.

Bytes (per edge, fp32, L = M = 2): the forward reads src, dst, shifts (40 B) and two
position rows (L2) and writes P, Z, d and env (216 + 32 + 8 B); the backward reads
the same inputs and gP, gZ, g_d, g_env and writes g_r (12 B); the reduction reads
g_r twice (by dst and through the src permutation). About 0.55 KB per edge in all:
0.2 GB, 40 us of HBM at 365k edges.

Status: L = 1, 2 (any M <= L), float32 and float64, padded graphs, any E (0 too);
tested against :func:`geometry_torch` in float64 in Triton's interpreter. Another L,
a gauge, or a device without Triton: the reference composition (the step plan says
so, :func:`why_not`).
"""

from __future__ import annotations

import math

import torch

from .. import reference, so3
from .._autograd import library_op, torch_grads, wrap_triton
from .._triton import split_scale, tl, triton, why_not_triton
from ..graph import Graph, csr_order, edge_vectors
from .wigner import (
    adjoint_L1M0,
    adjoint_L1M1,
    adjoint_L2M0,
    packed_L1M0,
    packed_L1M1,
    packed_L2M0,
    rotation,
    rotation_adjoint,
)
from .wigner_l2m1 import adjoint_L2M1, packed_L2M1
from .wigner_l2m2 import adjoint_L2M2, packed_L2M2

__all__ = ["geometry", "geometry_torch", "pack", "src_order", "why_not"]

#: The (L, M) the generated tiles cover (``packed_L{L}M{M}`` in the wigner files).
VARIANTS = {(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)}
BLOCK = 128  # edges per program
WARPS = 4


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _edge(pos_ptr, src_ptr, dst_ptr, shift_ptr, cell_ptr, e, E, pad_hi, pad_lo,
          PADDED: tl.constexpr):  # fmt: skip
    """r = x[src] + shift @ cell - x[dst] for the tile's edges, the padding edges
    moved to (pad_hi + pad_lo, 0, 0); and which edges pad."""
    mask = e < E
    i = tl.load(src_ptr + e, mask=mask, other=0)
    j = tl.load(dst_ptr + e, mask=mask, other=0)
    a = tl.load(shift_ptr + 3 * e, mask=mask, other=0)
    b = tl.load(shift_ptr + 3 * e + 1, mask=mask, other=0)
    c = tl.load(shift_ptr + 3 * e + 2, mask=mask, other=0)
    dt = pos_ptr.dtype.element_ty
    fa, fb, fc = a.to(dt), b.to(dt), c.to(dt)
    rx = (
        tl.load(pos_ptr + 3 * i, mask=mask, other=0.0)
        + (
            fa * tl.load(cell_ptr)
            + fb * tl.load(cell_ptr + 3)
            + fc * tl.load(cell_ptr + 6)
        )
        - tl.load(pos_ptr + 3 * j, mask=mask, other=0.0)
    )
    ry = tl.load(pos_ptr + 3 * i + 1, mask=mask, other=0.0) + (
        fa * tl.load(cell_ptr + 1) + fb * tl.load(cell_ptr + 4)
        + fc * tl.load(cell_ptr + 7)
    ) - tl.load(pos_ptr + 3 * j + 1, mask=mask, other=0.0)  # fmt: skip
    rz = tl.load(pos_ptr + 3 * i + 2, mask=mask, other=0.0) + (
        fa * tl.load(cell_ptr + 2) + fb * tl.load(cell_ptr + 5)
        + fc * tl.load(cell_ptr + 8)
    ) - tl.load(pos_ptr + 3 * j + 2, mask=mask, other=0.0)  # fmt: skip
    far = e < 0  # lanes past E: a vector of length pad_length too (never stored)
    far = far | (e >= E)
    if PADDED:
        pad = (i == j) & (a == 0) & (b == 0) & (c == 0)
    else:
        pad = e < 0
    pad = pad | far
    rx = tl.where(pad, tl.zeros_like(rx) + pad_hi + pad_lo, rx)
    ry = tl.where(pad, 0.0, ry)
    rz = tl.where(pad, 0.0, rz)
    return rx, ry, rz, pad


@triton.jit
def _frame(rx, ry, rz):
    """d, u, s = sign(u_z) (+1 at 0) and w = 1 / (1 + s u_z)."""
    d = tl.sqrt(rx * rx + ry * ry + rz * rz)
    ux, uy, uz = rx / d, ry / d, rz / d
    s = tl.where(uz >= 0.0, 1.0, -1.0)
    w = 1.0 / (1.0 + s * uz)
    return d, ux, uy, uz, s, w


@triton.jit
def _envelope(d, ic_hi, ic_lo):
    """u(x) = 1 - 28 x^6 + 48 x^7 - 21 x^8 for x = d / r_c < 1, else 0; and
    du/dd = -168 x^5 (1 - x)^2 / r_c; ``1 / r_c = ic_hi + ic_lo``."""
    x = d * ic_hi + d * ic_lo
    x2 = x * x
    x5 = x2 * x2 * x
    x6 = x5 * x
    env = 1.0 - 28.0 * x6 + 48.0 * x6 * x - 21.0 * x6 * x2
    t = -168.0 * x5 * (1.0 - x) * (1.0 - x)
    denv = t * ic_hi + t * ic_lo
    inside = x < 1.0
    return tl.where(inside, env, 0.0), tl.where(inside, denv, 0.0)


@triton.jit
def _geometry_fwd_kernel(pos_ptr, src_ptr, dst_ptr, shift_ptr, cell_ptr, p_ptr, z_ptr,
                         d_ptr, env_ptr, E, pad_hi, pad_lo, ic_hi, ic_lo,
                         L: tl.constexpr, M: tl.constexpr, PADDED: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < E
    rx, ry, rz, pad = _edge(pos_ptr, src_ptr, dst_ptr, shift_ptr, cell_ptr, e, E,
                            pad_hi, pad_lo, PADDED)  # fmt: skip
    d, ux, uy, uz, s, w = _frame(rx, ry, rz)
    r0, r1, r2, r3, r4, r5, r6, r7, r8 = rotation(ux, uy, uz, s, w)
    SLOTS: tl.constexpr = (L + 1) * (L + 1) * 2 * (M + 1)
    p_row, z_row = p_ptr + e * SLOTS, z_ptr + e * ((L + 1) * (L + 1) - 1)
    if L == 1:
        if M == 0:
            packed_L1M0(p_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7, r8)
        else:
            packed_L1M1(p_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7, r8)
    else:
        if M == 0:
            packed_L2M0(p_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7, r8)
        elif M == 1:
            packed_L2M1(p_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7, r8)
        else:
            packed_L2M2(p_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7, r8)
    env, _ = _envelope(d, ic_hi, ic_lo)
    tl.store(d_ptr + e, d, mask=mask)
    tl.store(env_ptr + e, env, mask=mask)


@triton.jit
def _geometry_bwd_kernel(pos_ptr, src_ptr, dst_ptr, shift_ptr, cell_ptr, gp_ptr,
                         gz_ptr, gd_ptr, genv_ptr, gr_ptr, E, pad_hi, pad_lo, ic_hi,
                         ic_lo, L: tl.constexpr, M: tl.constexpr, PADDED: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < E
    rx, ry, rz, pad = _edge(pos_ptr, src_ptr, dst_ptr, shift_ptr, cell_ptr, e, E,
                            pad_hi, pad_lo, PADDED)  # fmt: skip
    d, ux, uy, uz, s, w = _frame(rx, ry, rz)
    r0, r1, r2, r3, r4, r5, r6, r7, r8 = rotation(ux, uy, uz, s, w)
    SLOTS: tl.constexpr = (L + 1) * (L + 1) * 2 * (M + 1)
    g_row, z_row = gp_ptr + e * SLOTS, gz_ptr + e * ((L + 1) * (L + 1) - 1)
    if L == 1:
        if M == 0:
            q = adjoint_L1M0(g_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7,
                                    r8)  # fmt: skip
        else:
            q = adjoint_L1M1(g_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7,
                                    r8)  # fmt: skip
    else:
        if M == 0:
            q = adjoint_L2M0(g_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7,
                                    r8)  # fmt: skip
        elif M == 1:
            q = adjoint_L2M1(g_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7,
                                    r8)  # fmt: skip
        else:
            q = adjoint_L2M2(g_row, z_row, mask, r0, r1, r2, r3, r4, r5, r6, r7,
                                    r8)  # fmt: skip
    gx, gy, gz = rotation_adjoint(ux, uy, uz, s, w, q[0], q[1], q[2], q[3],
                                         q[4], q[5], q[6], q[7], q[8])  # fmt: skip
    _, denv = _envelope(d, ic_hi, ic_lo)
    g_len = tl.load(gd_ptr + e, mask=mask, other=0.0) + denv * tl.load(
        genv_ptr + e, mask=mask, other=0.0
    )
    radial = ux * gx + uy * gy + uz * gz
    inv = 1.0 / d
    gx = tl.where(pad, 0.0, (gx - ux * radial) * inv + ux * g_len)
    gy = tl.where(pad, 0.0, (gy - uy * radial) * inv + uy * g_len)
    gz = tl.where(pad, 0.0, (gz - uz * radial) * inv + uz * g_len)
    tl.store(gr_ptr + 3 * e, gx, mask=mask)
    tl.store(gr_ptr + 3 * e + 1, gy, mask=mask)
    tl.store(gr_ptr + 3 * e + 2, gz, mask=mask)


@triton.jit
def _atoms_kernel(gr_ptr, row_ptr, ptr_src, perm_src, out_ptr, BLOCK: tl.constexpr):
    """g_x[n] = sum of g_r over n's src segment (through the permutation) minus the
    sum over its dst segment: one program per atom, a fixed order."""
    n = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    c = tl.arange(0, 4)
    acc = tl.zeros((BLOCK, 4), dtype=gr_ptr.dtype.element_ty)
    lo, hi = tl.load(ptr_src + n), tl.load(ptr_src + n + 1)
    for a in range(lo, hi, BLOCK):
        m = a + k < hi
        e = tl.load(perm_src + a + k, mask=m, other=0)
        acc += tl.load(gr_ptr + 3 * e[:, None] + c[None, :],
                       mask=m[:, None] & (c[None, :] < 3), other=0.0)  # fmt: skip
    lo, hi = tl.load(row_ptr + n), tl.load(row_ptr + n + 1)
    for a in range(lo, hi, BLOCK):
        e = a + k
        m = e < hi
        acc -= tl.load(gr_ptr + 3 * e[:, None] + c[None, :],
                       mask=m[:, None] & (c[None, :] < 3), other=0.0)  # fmt: skip
    tl.store(out_ptr + 3 * n + c, tl.sum(acc, axis=0), mask=c < 3)


# --------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------
def geometry_fwd(positions, cell, src, dst, shifts, pad_length: float, cutoff: float,
                 L: int, M: int, padded: bool):  # fmt: skip
    """Launch the forward: ``(P, Z, d, env)``; every input contiguous."""
    E, S = src.shape[0], (L + 1) ** 2
    like = positions
    P = like.new_empty((E, S, 2, M + 1))
    Z = like.new_empty((E, S - 1))
    d, env = like.new_empty((E,)), like.new_empty((E,))
    if E:
        wrap_triton(_geometry_fwd_kernel)[(triton.cdiv(E, BLOCK),)](
            positions, src, dst, shifts, cell, P, Z, d, env, E,
            *split_scale(float(pad_length)), *split_scale(1.0 / float(cutoff)),
            L=int(L), M=int(M), PADDED=bool(padded), BLOCK=BLOCK, num_warps=WARPS,
        )  # fmt: skip
    return P, Z, d, env


def geometry_bwd(gP, gZ, gd, genv, positions, cell, src, dst, shifts,
                 pad_length: float, cutoff: float, L: int, M: int,
                 padded: bool):  # fmt: skip
    """Launch the adjoint: ``g_r (E, 3)``; every input contiguous."""
    E = src.shape[0]
    gr = positions.new_empty((E, 3))
    if E:
        wrap_triton(_geometry_bwd_kernel)[(triton.cdiv(E, BLOCK),)](
            positions, src, dst, shifts, cell, gP, gZ, gd, genv, gr, E,
            *split_scale(float(pad_length)), *split_scale(1.0 / float(cutoff)),
            L=int(L), M=int(M), PADDED=bool(padded), BLOCK=BLOCK, num_warps=WARPS,
        )  # fmt: skip
    return gr


def edges_to_atoms(gr, row_ptr, ptr_src, perm_src):
    """Launch the reduction: ``g_x (N, 3)`` from ``g_r (E, 3)``."""
    N = row_ptr.shape[0] - 1
    out = gr.new_empty((N, 3))
    if N:
        wrap_triton(_atoms_kernel)[(N,)](gr, row_ptr, ptr_src, perm_src, out,
                                          BLOCK=32, num_warps=1)  # fmt: skip
    return out


# --------------------------------------------------------------------------------------
# torch.library ops and the autograd Function
# --------------------------------------------------------------------------------------
def _fwd_fake(positions, cell, src, dst, shifts, pad_length, cutoff, L, M, padded):
    E, S, like = src.shape[0], (L + 1) ** 2, positions
    return (like.new_empty((E, S, 2, M + 1)), like.new_empty((E, S - 1)),
            like.new_empty((E,)), like.new_empty((E,)))  # fmt: skip


@library_op("geometry_fwd", _fwd_fake)
def _fwd_lib(positions: torch.Tensor, cell: torch.Tensor, src: torch.Tensor,
             dst: torch.Tensor, shifts: torch.Tensor, pad_length: float,
             cutoff: float, L: int, M: int,
             padded: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor]:  # fmt: skip
    return geometry_fwd(positions, cell, src, dst, shifts, pad_length, cutoff, L, M,
                        padded)  # fmt: skip


def _bwd_fake(gP, gZ, gd, genv, positions, *rest):
    return positions.new_empty((gd.shape[0], 3))


@library_op("geometry_bwd", _bwd_fake)
def _bwd_lib(gP: torch.Tensor, gZ: torch.Tensor, gd: torch.Tensor, genv: torch.Tensor,
             positions: torch.Tensor, cell: torch.Tensor, src: torch.Tensor,
             dst: torch.Tensor, shifts: torch.Tensor, pad_length: float,
             cutoff: float, L: int, M: int, padded: bool) -> torch.Tensor:  # fmt: skip
    return geometry_bwd(gP, gZ, gd, genv, positions, cell, src, dst, shifts,
                        pad_length, cutoff, L, M, padded)  # fmt: skip


def _atoms_fake(gr, row_ptr, ptr_src, perm_src):
    return gr.new_empty((row_ptr.shape[0] - 1, 3))


@library_op("geometry_atoms", _atoms_fake)
def _atoms_lib(gr: torch.Tensor, row_ptr: torch.Tensor, ptr_src: torch.Tensor,
               perm_src: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return edges_to_atoms(gr, row_ptr, ptr_src, perm_src)


class _GeometryFn(torch.autograd.Function):
    """``(positions, cell) -> (P, Z, d, env)`` by the forward op; the backward by the
    adjoint and the reduction ops, or differentiably (a second derivative)."""

    @staticmethod
    def forward(ctx, positions, cell, src, dst, shifts, row_ptr, ptr_src, perm_src,
                pad_length, cutoff, L, M, padded):  # fmt: skip
        args = (src, dst, shifts, pad_length, cutoff, L, M, padded)
        ctx.save_for_backward(positions, cell, src, dst, shifts, row_ptr, ptr_src,
                              perm_src)  # fmt: skip
        ctx.meta = (pad_length, cutoff, L, M, padded)
        return _fwd_lib(positions, cell, *args)

    @staticmethod
    def backward(ctx, gP, gZ, gd, genv):
        positions, cell, src, dst, shifts, row_ptr, ptr_src, perm_src = (
            ctx.saved_tensors
        )
        pad_length, cutoff, L, M, padded = ctx.meta
        args = (src, dst, shifts, pad_length, cutoff, L, M, padded)
        needs = ctx.needs_input_grad[:2]
        grads = [torch.zeros_like(t) if gt is None else gt
                 for gt, t in zip((gP, gZ, gd, genv),
                                  _fwd_fake(positions, cell, *args))]  # fmt: skip
        rest = (None,) * 11
        if torch.is_grad_enabled():  # a second derivative: differentiable PyTorch

            def fn(x, c):
                g = Graph(src, dst, shifts, row_ptr, c, padded, cutoff=cutoff)
                return geometry_torch(x, g, L, M, pad_length)

            return (*torch_grads(fn, (positions, cell), needs, grads), *rest)
        gr = _bwd_lib(*(t.contiguous() for t in grads), positions, cell, *args)
        g_pos = _atoms_lib(gr, row_ptr, ptr_src, perm_src) if needs[0] else None
        g_cell = None
        if needs[1]:  # the stress: sum_e shift_e[a] g_r[e]
            g_cell = (shifts.to(gr.dtype)[:, :, None] * gr[:, None, :]).sum(0)
        return (g_pos, g_cell, *rest)


# --------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------
def pack(D: torch.Tensor, M: int) -> torch.Tensor:
    """``P[e, s, t, m] = D[e, row_t(l(s), m), s]``, ``(E, S, S) -> (E, S, 2, M + 1)``:
    the packed layout the edge-frame kernels read (chapter 3), zero where a slot
    has no row (``so3.LMTables.cos_index``, ``sin_index``). One differentiable
    gather."""
    E, S = D.shape[0], D.shape[-1]
    t = so3.lm_tables(math.isqrt(S) - 1, M)
    rows = torch.stack([t.cos_index[t.l_of_s], t.sin_index[t.l_of_s]], 1)
    cols = torch.arange(S)[:, None, None]
    flat = (cols * (S + 1) + rows).reshape(-1).to(D.device)  # into D^T, a zero row
    Dt = torch.nn.functional.pad(D.transpose(1, 2), (0, 1))  # (E, S, S + 1)
    return Dt.reshape(E, S * (S + 1))[:, flat].reshape(E, S, 2, M + 1)


def geometry_torch(positions, graph: Graph, L: int, M: int, pad_length: float):
    """The reference composition, differentiable PyTorch: ``(P, Z, d, env)``."""
    r = edge_vectors(positions, graph, pad_length=pad_length)
    d = torch.linalg.vector_norm(r, dim=-1)
    D = so3.edge_frames(L, r)
    env = reference.envelope(d, graph.cutoff)
    return pack(D, M), reference.zonal_rows(D), d, env


def why_not(device_type: str, L: int, M: int, dtype) -> str | None:
    """Why the fused geometry cannot serve a step on ``device_type`` at (L, M) in
    ``dtype``, or None."""
    why = why_not_triton(device_type)
    if why:
        return why
    if (L, M) not in VARIANTS:
        return f"(L, M) = ({L}, {M}): the generated tiles cover {sorted(VARIANTS)}"
    if dtype not in (torch.float32, torch.float64):
        return f"dtype {dtype} (float32 and float64 only)"
    return None


def src_order(graph: Graph):
    """``(ptr_src, perm_src)``: the graph's edges in source order, as a CSR pointer
    ``(N + 1,)`` and a permutation ``(E,)`` (a stable sort of src)."""
    return csr_order(graph.src, graph.row_ptr.shape[0] - 1)


def geometry(positions, graph: Graph, L: int, M: int, pad_length: float,
             order=None):  # fmt: skip
    """``(P, Z, d, env)`` as :func:`geometry_torch`, by the fused kernels;
    differentiable in positions and ``graph.cell`` (first derivatives by the
    kernels, second ones by :func:`geometry_torch`). ``order``: :func:`src_order`
    of the graph, if the caller has it. A ValueError where the kernels cannot serve
    (:func:`why_not`)."""
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be an ecekern.Graph, got {type(graph).__name__}")
    if not isinstance(positions, torch.Tensor) or positions.shape[-1:] != (3,):
        raise ValueError("positions must be an (N, 3) tensor")
    why = why_not(positions.device.type, L, M, positions.dtype)
    if why:
        raise ValueError(f"the fused geometry cannot serve this call: {why}")
    if graph.system is not None:
        raise ValueError("the fused geometry takes one system (one cell), not a batch")
    ptr_src, perm_src = src_order(graph) if order is None else order
    g = graph
    cell = g.cell.to(positions.dtype)
    return _GeometryFn.apply(positions.contiguous(), cell.contiguous(), g.src, g.dst,
                             g.shifts, g.row_ptr, ptr_src, perm_src,
                             float(pad_length), float(g.cutoff), int(L), int(M),
                             bool(g.padded))  # fmt: skip
