"""The edge-frame ops: rotate and select, unrotate with the aggregation (chapter 3).

Formula and shapes. ``D_e`` is block-diagonal over degrees; the selection of the
angular layout picks, for the slot ``(l, m)`` of the cos part (t = 0) and of the sin
part (t = 1), the row ``l^2+l+m`` or ``l^2+l-m`` of ``D_e``. Folded together::

    P[e, s, t, m] = D_e[row_t(l(s), m), s]     (zero where the slot is empty)

    rotate_and_select (one side: A = h[dst_e] for channels 0..C-1, h[src_e] after):
        x_t[e, c, l, m] = rho[e, c, l] * sum_{s: l(s) = l} P[e, s, t, m] A[e, s, c]
    unrotate_and_aggregate:
        Delta[n, s, c'] = k sum_{e: dst_e = n} w_e sum_{t, m} P[e, s, t, m]
                          y_t[e, c', l(s), m]

    h (N, S, C), x_t (E, 2C (L+1), n_ang), y_t (E, C' (L+1), n_ang), Delta (N, S, C'),
    rho (E, 2C (L+1)), w (E,), P (E, S, 2, n_ang), S = (L+1)^2, n_ang = M + 1.

Every kernel is one program per node. The rotation's program for node n handles the
edges that read h[n]: as destination (the dst-sorted CSR) and, in a second launch, as
source (a src-sorted permutation built once per graph). So h[n] is read once per
side, not gathered per edge, and every gradient is a sum owned by one program: no
atomics, deterministic. Two ways to read D (the chapter's comparison):

* ``table``: ``D (E, S, S)`` through the (l, m) row tables, one element per load;
* ``packed``: ``P`` built once per step by :class:`Frames` (a gather of D), read as
  contiguous rows of n_ang values; P is smaller than D (it holds the blocks only).

Gradients (G = dLoss/dDelta, g_t = dLoss/dx_t), each from one merged kernel per side::

    dh[n, s, c]    = sum_{e in side(n)} sum_{t, m} P[e, s, t, m] rho g_t[e, c, l(s), m]
    dP[e, s, t, m] = sum_c rho g_t[e, c, l(s), m] A[e, s, c]       (both sides add)
    drho[e, c, l]  = sum_{t, m} g_t[e, c, l, m] x0_t[e, c, l, m]    (x0: before rho)
    dy_t[e, c', l, m] = k w_e T_t,  T_t = sum_{s in l} P[e, s, t, m] G[dst_e, s, c']
    dP[e, s, t, m] = k w_e sum_c' y_t[e, c', l(s), m] G[dst_e, s, c']
    dw[e]          = k sum_{t, c', l, m} y_t T_t

dP reaches D (and the forces) through the packing gather's backward; the table
variant stores dD directly. Saved for the backward: the inputs; the rotation's
pre-modulation value x0 (for drho) is recomputed. A second derivative (a
force-training step) recomputes the op in differentiable PyTorch (:func:`rotate_torch`,
:func:`unrotate_torch`), with ``index_add_``: no atomics-free guarantee there.

Bytes (fp32, L = M = 2, C = 32, E = 365k): the rotation writes x (1.68 GB) and reads P
twice (0.16 GB) and rho; the unrotation reads y (0.84 GB) and P and writes node rows.

Status: fp64 (fp64 accumulation) and fp32 (fp32 accumulation), L = 1..4,
M <= L, any C, E = 0, nodes without edges, any strides (the rows x, y and their
gradients read and written with their element strides, as for the planes pairs of
``rotate_and_select(..., planes=True)``; the rest made contiguous), int64 offsets;
D must be block-diagonal over degrees (a Wigner matrix): the entries off the
blocks are not read and get no gradient. Half precisions fall back to the reference,
loudly (not validated: the two side launches would round dh and dP to 16 bits between
them).

The four kernels run inside four ``torch.library`` ops, in eager mode and under
``torch.compile`` alike (``triton_op`` on a GPU, so inductor traces the launches;
custom ops in the interpreter), with the autograd in two Functions around them
(:mod:`.autograd`, :mod:`ecekern._autograd`'s style). A :class:`Frames` with another
:class:`EdgeFrameLaunch` passes its fields to the ops as ints.
"""

from __future__ import annotations

import math

import torch

from .. import options, reference
from .._triton import why_not_triton
from ..graph import csr_order
from .autograd import _RotateFn, _UnrotateFn, rotate_torch, unrotate_torch
from .launch import (
    LAUNCH,
    EdgeFrameLaunch,
    pack,
    rotate_bwd,
    rotate_fwd,
    tables,
    unrotate_bwd,
    unrotate_fwd,
)

__all__ = [
    "EdgeFrameLaunch",
    "Frames",
    "pack",
    "pack_and_unrotate",
    "rotate_and_select",
    "rotate_bwd",
    "rotate_fwd",
    "rotate_torch",
    "traffic",
    "unrotate_and_aggregate",
    "unrotate_bwd",
    "unrotate_fwd",
    "unrotate_torch",
]

VARIANTS = ("table", "packed")


def why_not(device_type: str, L: int, dtype=torch.float32) -> str | None:
    """Why the kernels cannot serve ``dtype`` tensors on ``device_type`` at degree L,
    or None."""
    reason = why_not_triton(device_type)
    if reason is None and not 1 <= L <= 4:
        reason = f"L = {L} is outside 1..4"
    if reason is None and dtype not in (torch.float32, torch.float64):
        reason = f"{dtype} is not validated (float32 and float64 are)"
    return reason


class Frames:
    """What every edge-frame op of one step shares, built once per step: D (or its
    packed tiles P, with the select folded in), the row tables, and the graph's two
    CSR orders (by destination; by source, a permutation).

    Args:
        D: ``(E, S, S)`` edge Wigner blocks (block-diagonal; differentiable).
        mmax: M.
        src, dst: ``(E,)`` int64.
        n_nodes: N.
        row_ptr: the CSR pointer of ``dst`` when the edges are sorted by destination
            (the model's graph); None builds a permutation (sorted by ``dst``).
        variant: ``"packed"`` or ``"table"``.
        launch: the kernels' :class:`EdgeFrameLaunch` (None: the library's,
            ``launch.LAUNCH``).
        validate: check the index values (host synchronisations): src and dst in
            [0, N), row_ptr the CSR pointer of dst. The model's graph is consistent by
            construction and skips them.

    D must be block-diagonal over degrees (a Wigner matrix): the kernels read its
    blocks only, so a D with entries off the blocks gives another result than the
    reference.
    """

    def __init__(self, D, mmax: int, src, dst, n_nodes: int, row_ptr=None,
                 variant: str = "packed",
                 launch: EdgeFrameLaunch | None = None,
                 validate: bool = True):  # fmt: skip
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        L = _check_graph(D, mmax, src, dst, n_nodes, row_ptr, validate)
        self.L, self.M, self.n_nodes = L, mmax, int(n_nodes)
        self.packed = variant == "packed"
        self.launch = LAUNCH if launch is None else launch
        self.variant = variant
        self.src, self.dst = src.contiguous(), dst.contiguous()
        self.d = pack(D, mmax) if self.packed else D.contiguous()
        self.tab = tables(L, mmax, D.device)
        self._orders(row_ptr, None)

    @classmethod
    def from_packed(cls, P, mmax: int, src, dst, n_nodes: int, row_ptr,
                    src_order=None,
                    launch: EdgeFrameLaunch | None = None) -> Frames:  # fmt: skip
        """Frames of the packed variant from tiles ``P (E, S, 2, mmax + 1)`` made
        elsewhere (chapter 7's fused geometry writes them with D never formed),
        for the model's graph (dst-sorted with its CSR pointer ``row_ptr``; not
        validated). ``src_order``: ``(ptr_src, perm_src)``, the edges in source
        order (a stable sort), when the caller has it."""
        reference._float("P", P)
        S = P.shape[1] if P.ndim == 4 else 0
        L = math.isqrt(S) - 1
        if P.ndim != 4 or S < 4 or (L + 1) ** 2 != S or P.shape[2:] != (2, mmax + 1):
            raise ValueError(
                f"P must have shape (E, (L+1)^2, 2, mmax + 1) with L >= 1, got "
                f"{tuple(P.shape)} (mmax = {mmax})"
            )
        like = P.new_empty((1, 1, 1)).expand(P.shape[0], S, S)  # D's shape, no data
        _check_graph(like, mmax, src, dst, n_nodes, row_ptr, False)
        self = cls.__new__(cls)
        self.L, self.M, self.n_nodes = L, mmax, int(n_nodes)
        self.packed, self.variant = True, "packed"
        self.launch = LAUNCH if launch is None else launch
        self.src, self.dst = src.contiguous(), dst.contiguous()
        self.d = P.contiguous()
        self.tab = tables(L, mmax, P.device)
        self._orders(row_ptr, src_order)
        return self

    def _orders(self, row_ptr, src_order) -> None:
        """The two CSR orders (``self.csr``) and ``self.row_ptr``."""
        if row_ptr is None:
            ptr_dst, perm_dst = csr_order(self.dst, self.n_nodes)
            self.row_ptr = None
        else:
            perm_dst, ptr_dst = None, row_ptr.contiguous()
            self.row_ptr = ptr_dst
        if src_order is None:
            src_order = csr_order(self.src, self.n_nodes)
        self.csr = (ptr_dst, perm_dst, *src_order)

    def rotate_and_select(self, h, rho=None, planes: bool = False):
        """``(x_cos, x_sin)`` as :func:`ecekern.reference.rotate_and_select`, each
        feature row ``c*(L+1) + l`` times ``rho[:, c*(L+1) + l]`` when given: the
        views ``X[0]``, ``X[1]`` of one contiguous ``X (2, E, F, n_ang)``, or with
        ``planes`` the views ``P[:, 0]`` and ``P[:, 1]`` (permuted to ``(E, F,
        n_ang)``) of one ``P (n_ang, 2, E, F)``: the layout chapter 6's layer
        kernels read, so the mixing stack takes them without a copy."""
        _check_h(h, self.n_nodes, self.L)
        reference._same("h", h, D=self.d)
        _check_rho(h, rho, self.d.shape[0], self.L)
        if not isinstance(planes, bool):
            raise TypeError(f"planes must be a bool, got {planes!r}")
        return _RotateFn.apply(
            h.contiguous(), self.d, rho, self.tab, self.src, self.dst, self.csr,
            self.L, self.M, self.packed, self.launch, planes,
        )  # fmt: skip

    def unrotate_and_aggregate(self, y_cos, y_sin, scale: float, edge_weight=None):
        """``Delta[n] = scale sum_{e: dst_e = n} w_e D_e^T pack(y_e)``, ``(N, S, C')``:
        :func:`ecekern.reference.pack_and_unrotate` then ``aggregate``, fused."""
        if self.row_ptr is None:
            raise ValueError("unrotate_and_aggregate needs Frames built with row_ptr")
        _check_y(y_cos, y_sin, self.d, self.L, self.M)
        _check_w(y_cos, edge_weight)
        if edge_weight is not None:
            edge_weight = edge_weight.contiguous()
        return _UnrotateFn.apply(  # any strides: the kernels take them
            y_cos, y_sin, self.d, edge_weight, self.tab,
            self.dst, self.row_ptr, float(scale), self.L, self.M, self.packed,
            self.launch,
        )  # fmt: skip


def _check_graph(D, mmax, src, dst, n_nodes, row_ptr, validate: bool) -> int:
    """D, mmax, src, dst and row_ptr of :class:`Frames`; returns L."""
    reference._float("D", D)
    if D.ndim != 3 or D.shape[1] != D.shape[2]:
        raise ValueError(f"D must have shape (E, S, S), got {tuple(D.shape)}")
    S = D.shape[-1]
    L = math.isqrt(S) - 1
    if (L + 1) ** 2 != S:
        raise ValueError(f"D's S = {S} is not (L+1)^2")
    if isinstance(mmax, bool) or not (isinstance(mmax, int) and 0 <= mmax <= L):
        raise ValueError(f"mmax must be an int in [0, L={L}], got {mmax!r}")
    if isinstance(n_nodes, bool) or not isinstance(n_nodes, (int, torch.SymInt)):
        raise ValueError(f"n_nodes must be an int >= 0, got {n_nodes!r}")
    if n_nodes < 0:
        raise ValueError(f"n_nodes must be an int >= 0, got {n_nodes!r}")
    E = D.shape[0]
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an int64 tensor, got {got}")
        if t.shape != (E,):
            raise ValueError(f"{name} must have shape ({E},), got {tuple(t.shape)}")
        if t.device != D.device:
            raise ValueError(f"{name} is on {t.device}, D on {D.device}")
    values = validate and not torch.compiler.is_compiling()
    if row_ptr is not None:
        n = reference.check_csr(dst, row_ptr, E, D.device, values=values)
        if n != n_nodes:
            raise ValueError(f"row_ptr has {n} nodes, n_nodes is {n_nodes}")
    for name, t in (("src", src), ("dst", dst)):
        if values and E and (bool(t.min() < 0) or bool(t.max() >= n_nodes)):
            raise ValueError(f"{name} has node indices outside [0, N = {n_nodes})")
    return L


def _check_h(h, n_nodes: int, L: int):
    reference._float("h", h)
    if h.ndim != 3 or h.shape[0] != n_nodes or h.shape[1] != (L + 1) ** 2:
        raise ValueError(
            f"h must have shape (N, S, C) = ({n_nodes}, {(L + 1) ** 2}, C), "
            f"got {tuple(h.shape)}"
        )
    return h.shape


def _check_rho(h, rho, E: int, L: int) -> None:
    if rho is None:
        return
    reference._float("rho", rho)
    reference._same("h", h, rho=rho)
    F = 2 * h.shape[2] * (L + 1)
    if rho.shape != (E, F):
        raise ValueError(
            f"rho must have shape (E, 2C(L+1)) = ({E}, {F}), got {tuple(rho.shape)}"
        )


def _check_w(y_cos, w) -> None:
    if w is None:
        return
    reference._float("edge_weight", w)
    reference._same("y_cos", y_cos, edge_weight=w)
    if w.shape != (y_cos.shape[0],):
        raise ValueError(
            f"edge_weight must have shape ({y_cos.shape[0]},), got {tuple(w.shape)}"
        )


def _check_y(y_cos, y_sin, d, L: int, M: int) -> None:
    reference._float("y_cos", y_cos)
    reference._same("y_cos", y_cos, y_sin=y_sin, D=d)
    E = d.shape[0]
    if (
        y_cos.shape != y_sin.shape
        or y_cos.ndim != 3
        or y_cos.shape[0] != E
        or y_cos.shape[1] % (L + 1)
        or y_cos.shape[2] != M + 1
    ):
        raise ValueError(
            f"y_cos and y_sin must both have shape (E, C'(L+1), n_ang) = "
            f"({E}, C'*{L + 1}, {M + 1}), got {tuple(y_cos.shape)} and "
            f"{tuple(y_sin.shape)}"
        )


def _path(like: torch.Tensor, L: int, variant: str | None) -> str:
    """``reference``, ``table`` or ``packed`` for tensors like ``like``: ``variant``
    (None: ``packed``), and the reference, loudly, where the kernels cannot
    serve."""
    device_type = like.device.type
    path = "packed" if variant is None else variant
    if path not in ("reference", *VARIANTS):
        raise ValueError(
            f"variant must be None, 'reference' or one of {VARIANTS}, got {path!r}"
        )
    if path == "reference":
        return "reference"
    reason = why_not(device_type, L, like.dtype)
    if reason is not None:
        options.fallback("edge_frame", reason)
        return "reference"
    return path


def frames_for(D, mmax, src, dst, n_nodes, row_ptr, variant=None) -> Frames | None:
    """The model's per-step :class:`Frames` (its graph is consistent by construction:
    not validated) for ``variant`` (None: ``packed``), or None where the reference
    runs (``variant="reference"``, or the kernels cannot serve: a one-time
    warning)."""
    L = math.isqrt(D.shape[-1]) - 1
    path = _path(D, L, variant)
    if path == "reference":
        return None
    return Frames(D, mmax, src, dst, n_nodes, row_ptr, path, validate=False)


def rotate_and_select(h, src, dst, D, mmax: int, rho=None, *, variant=None,
                      validate: bool = True):  # fmt: skip
    """:func:`ecekern.reference.rotate_and_select`, fused, with the radial modulation
    ``rho (E, 2C(L+1))`` folded into the store when given. ``variant``: ``"packed"``
    (None), ``"table"`` or ``"reference"``. D must be
    block-diagonal over degrees (a Wigner matrix; its other entries are not read).
    ``validate=False`` skips the host-synchronising range check of src and dst (an
    index out of range then gives wrong rows, never an out-of-bounds access). The
    same checks and errors on every path."""
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    reference._float("D", D)
    L = _check_graph(D, mmax, src, dst, h.shape[0], None, validate)
    _check_h(h, h.shape[0], L)
    reference._same("h", h, D=D)
    _check_rho(h, rho, D.shape[0], L)
    path = _path(h, L, variant)
    if path == "reference":
        x_cos, x_sin = reference.rotate_and_select(h, src, dst, D, mmax)
        if rho is not None:
            x_cos, x_sin = x_cos * rho[:, :, None], x_sin * rho[:, :, None]
        return x_cos, x_sin
    frames = Frames(D, mmax, src, dst, h.shape[0], None, path, validate=False)
    return frames.rotate_and_select(h, rho)


def unrotate_and_aggregate(y_cos, y_sin, D, mmax: int, dst, row_ptr, scale: float,
                           edge_weight=None, *, variant=None,
                           validate: bool = True):  # fmt: skip
    """``reference.aggregate(reference.pack_and_unrotate(y_cos, y_sin, D, mmax), dst,
    N, scale, edge_weight)``, fused: the ``(E, S, C')`` message is never stored.
    ``dst`` sorted with its CSR pointer ``row_ptr``; D block-diagonal over degrees.
    ``validate=False`` skips the CSR's host-synchronising value checks (the kernels
    clamp every index). The same checks and errors on every path."""
    reference._float("D", D)
    values = validate and not torch.compiler.is_compiling()
    n = reference.check_csr(dst, row_ptr, D.shape[0], D.device, values=values)
    L = _check_graph(D, mmax, dst, dst, n, row_ptr, False)
    _check_y(y_cos, y_sin, D, L, mmax)
    _check_w(y_cos, edge_weight)
    path = _path(D, L, variant)
    if path == "reference":
        msg = reference.pack_and_unrotate(y_cos, y_sin, D, mmax)
        return reference.aggregate(msg, dst, n, scale, edge_weight)
    frames = Frames(D, mmax, dst, dst, n, row_ptr, path, validate=False)
    return frames.unrotate_and_aggregate(y_cos, y_sin, scale, edge_weight)


def pack_and_unrotate(y_cos, y_sin, D, mmax: int, *, variant=None):
    """:func:`ecekern.reference.pack_and_unrotate` by the same kernels: each edge its
    own destination (the per-edge message ``(E, S, C')`` is the output here)."""
    reference._float("D", D)
    E = D.shape[0]
    idx = torch.arange(E, device=D.device)
    row_ptr = torch.arange(E + 1, device=D.device)
    return unrotate_and_aggregate(y_cos, y_sin, D, mmax, idx, row_ptr, 1.0,
                                  variant=variant, validate=False)  # fmt: skip


def traffic(E: int, N: int, L: int, M: int, C: int, elem_size: int,
            packed: bool = True) -> dict:  # fmt: skip
    """The bytes model of the four kernels (C channels of h, C' = C of the message):

    rotation forward: x written ``2 E 2C(L+1) n_ang``, P (or D) read once per side,
    rho read; unrotation forward: y read ``2 E C(L+1) n_ang``, P read, w read, node
    rows written; the backwards: the same tensors once more, plus dP written (the
    rotation's second side reads and writes it again). ``floor_*`` counts each
    tensor once: what a kernel must move."""
    S, NA = (L + 1) ** 2, M + 1
    x = 2 * E * 2 * C * (L + 1) * NA
    y = 2 * E * C * (L + 1) * NA
    p = E * S * 2 * NA if packed else E * S * S
    rho, node = E * 2 * C * (L + 1), N * S * C
    b = elem_size
    return {
        "rotate_fwd": b * (x + 2 * p + rho + 2 * node) + 8 * 2 * (N + 1 + E),
        "floor_rotate_fwd": b * (x + p + rho + node),
        "rotate_bwd": b * (x + 5 * p + 2 * rho + 4 * node) + 8 * 2 * (N + 1 + E),
        "floor_rotate_bwd": b * (x + 2 * p + 2 * rho + 2 * node),
        "unrotate_fwd": b * (y + p + E + node) + 8 * (N + 1),
        "floor_unrotate_fwd": b * (y + p + E + node),
        "unrotate_bwd": b * (2 * y + 2 * p + 2 * E + node) + 8 * (N + 1),
        "floor_unrotate_bwd": b * (2 * y + 2 * p + 2 * E + node),
        "message_bytes": b * E * S * C,
    }
