"""The einsum reference: every stage of the model as plain PyTorch ops.

This module is the executable specification (the book, chapter 1). Every fast path in
the library computes the same as a function here, with the same signature, and is
tested against it in float64. Nothing here is ever "optimised".

Shapes (glossary): N atoms, E edges (``src -> dst``), C channels, L = lmax,
M = mmax, S = (L+1)^2 spherical components, n_ang = M+1 angular slots,
F = 2C(L+1) feature rows of the angular layout.

Stages, in the order one energy evaluation runs them:

* ``radial_basis``: ``d (E,) -> (E, n_rbf)``, Bessel functions times the envelope;
* ``zonal_rows``: ``D (E, S, S) -> Z (E, S-1)``, ``Z[e, s] = D[e, l^2+l, s]``;
* ``zonal_scatter``: ``h0[n, s, c] = k sum_{e: dst_e = n} Z[e, s] R[e, l(s), c]``;
* ``rotate_and_select``: ``h (N, S, C) -> x_cos, x_sin (E, F, n_ang)``;
* ``equivariant_linear``: ``y[e, o, m] = sum_i x[e, i, m] W[m, o, i]``, bias on the
  m = 0 cos slot;
* ``gate``: SiLU on the m = 0 cos slot, m >= 1 slots times sigmoid of it;
* ``mixing_stack``: ``u_k = u_{k-1} + gate(Linear_k(u_{k-1}))``, then ``Linear_out``;
* ``pack_and_unrotate``: ``(E, C'(L+1), n_ang) x 2 -> msg (E, S, C')`` via ``D_e^T``;
* ``aggregate``: ``Delta[n] = k sum_{e: dst_e = n} u(d_e) msg[e]``, u the envelope;
* ``node_update``: ``h + Delta_l @ W_l`` per degree l, shared over m.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf

from .so3 import lm_tables

__all__ = [
    "aggregate",
    "envelope",
    "equivariant_linear",
    "gate",
    "mixing_stack",
    "node_update",
    "pack_and_unrotate",
    "radial_basis",
    "rotate_and_select",
    "zonal_rows",
    "zonal_scatter",
]


# --------------------------------------------------------------------------------------
# input checks shared by the public functions
# --------------------------------------------------------------------------------------
def _float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _same(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}"
            )
        if t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}"
            )


def check_csr(
    dst: torch.Tensor, row_ptr: torch.Tensor, n_edges: int, device, values: bool = True
) -> int:
    """Validate ``dst (E,)`` sorted int64 and ``row_ptr (N+1,)`` consistent with it.

    Returns N. The checks of the values cost host synchronisations; ``values=False``
    checks types, shapes and devices only (what a traced graph can check).
    """
    for name, t in (("dst", dst), ("row_ptr", row_ptr)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
        if t.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the features on {device}")
    if dst.shape[0] != n_edges:
        raise ValueError(f"dst has {dst.shape[0]} entries for {n_edges} edges")
    if row_ptr.shape[0] < 1:
        raise ValueError("row_ptr must have N+1 >= 1 entries")
    n = row_ptr.shape[0] - 1
    if not values:
        return n
    counts = torch.bincount(dst.clamp(0, max(n - 1, 0)), minlength=n)[:n] if n else None
    bad = (
        bool(row_ptr[0] != 0)
        or bool(row_ptr[-1] != n_edges)
        or (n_edges > 0 and (bool(dst.min() < 0) or bool(dst.max() >= n)))
        or (n > 0 and bool((row_ptr[1:] - row_ptr[:-1] != counts).any()))
    )
    if bad:
        raise ValueError(
            "row_ptr is not the CSR pointer of dst: need dst sorted ascending with "
            "values in [0, N), row_ptr[n+1] - row_ptr[n] edges into node n, "
            "row_ptr[0] = 0, "
            f"row_ptr[N] = E = {n_edges}"
        )
    if n_edges > 1 and bool((dst[1:] < dst[:-1]).any()):
        raise ValueError("dst must be sorted ascending")
    return n


# --------------------------------------------------------------------------------------
# 1. geometry: radial basis
# --------------------------------------------------------------------------------------
def envelope(d: torch.Tensor, cutoff: float, p: int = 6) -> torch.Tensor:
    """Smooth polynomial cutoff ``u(x)``, ``x = d / cutoff``: 1 at 0, and zero with its
    first two derivatives at the cutoff (DimeNet's envelope). Zero beyond."""
    x = d / cutoff
    u = (
        1
        - (p + 1) * (p + 2) / 2 * x**p
        + p * (p + 2) * x ** (p + 1)
        - p * (p + 1) / 2 * x ** (p + 2)
    )
    return torch.where(x < 1, u, torch.zeros_like(u))


def radial_basis(d: torch.Tensor, n_rbf: int, cutoff: float) -> torch.Tensor:
    """``(E,) -> (E, n_rbf)``: ``sqrt(2/rc) sin(n pi d/rc) / d`` times the envelope."""
    _float("d", d)
    n = torch.arange(1, n_rbf + 1, dtype=d.dtype, device=d.device)
    b = (
        math.sqrt(2.0 / cutoff)
        * torch.sin(n * math.pi * d[:, None] / cutoff)
        / d[:, None]
    )
    return b * envelope(d, cutoff)[:, None]


# --------------------------------------------------------------------------------------
# 3. geometric initial embedding: the zonal scatter
# --------------------------------------------------------------------------------------
def zonal_rows(D: torch.Tensor) -> torch.Tensor:
    """``Z[e, s-1] = D[e, l^2+l, s]`` for ``s >= 1``: the m = 0 row of each Wigner
    block, ``sqrt(4 pi / (2l+1)) Y_s(u_e)``. ``(E, S, S) -> (E, S-1)``."""
    S = D.shape[-1]
    L = math.isqrt(S) - 1
    t = lm_tables(L).on(D.device)
    rows = t.m0_rows.reshape(1, 1, S).expand(D.shape[0], 1, S)
    return torch.gather(D, 1, rows)[:, 0, 1:]


def check_zonal_scatter(Z, R, dst, row_ptr, values: bool = True) -> int:
    """Shapes, dtypes, devices and CSR consistency of :func:`zonal_scatter`'s
    arguments (the CSR's values only if ``values``); returns N."""
    _float("Z", Z)
    _float("R", R)
    _same("Z", Z, R=R)
    if R.ndim != 3:
        raise ValueError(f"R must have shape (E, L, C), got {tuple(R.shape)}")
    E, L, C = R.shape
    S = (L + 1) ** 2
    if Z.shape != (E, S - 1):
        raise ValueError(
            f"Z must have shape (E, S-1) = ({E}, {S - 1}), got {tuple(Z.shape)}"
        )
    return check_csr(dst, row_ptr, E, Z.device, values)


def zonal_scatter(
    Z: torch.Tensor,
    R: torch.Tensor,
    dst: torch.Tensor,
    row_ptr: torch.Tensor,
    scale: float,
    validate: bool = True,
) -> torch.Tensor:
    """``h0[n, s, c] = scale * sum_{e: dst_e = n} Z[e, s-1] * R[e, l(s)-1, c]``, s >= 1.

    Args:
        Z: ``(E, S-1)`` the m = 0 rows of the edge Wigner blocks (degrees 1..L).
        R: ``(E, L, C)`` radial features for degrees 1..L.
        dst: ``(E,)`` int64, sorted ascending.
        row_ptr: ``(N+1,)`` int64 CSR pointer of ``dst``.
        scale: the normalisation ``k``.
        validate: check the CSR's values (host synchronisations; the model skips
            them for a graph that :func:`~ecekern.graph.build_graph` checked).

    Returns:
        ``(N, S, C)`` with row ``s = 0`` zero.

    The reference broadcasts ``R`` over each degree's ``2l+1`` rows and ``index_add_``s
    the ``(E, S-1, C)`` message tensor: the memory cost chapter 5 removes.
    """
    n = check_zonal_scatter(Z, R, dst, row_ptr, validate)
    E, L, C = R.shape
    S = (L + 1) ** 2
    l_of_s = lm_tables(L).on(Z.device).l_of_s[1:]  # degrees 1..L of rows 1..S-1
    msg = Z[:, :, None] * R[:, l_of_s - 1, :]  # (E, S-1, C): the big tensor
    out = Z.new_zeros(n, S - 1, C).index_add_(0, dst, msg * scale)
    return torch.cat([Z.new_zeros(n, 1, C), out], dim=1)


# --------------------------------------------------------------------------------------
# 4a. rotate into the edge frame and select the angular layout
# --------------------------------------------------------------------------------------
def rotate_and_select(
    h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, D: torch.Tensor, mmax: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_loc[e] = D_e @ [h[dst_e] | h[src_e]]``, split by azimuthal order.

    Args:
        h: ``(N, S, C)`` node features.
        src, dst: ``(E,)`` int64.
        D: ``(E, S, S)`` edge Wigner blocks.
        mmax: M.

    Returns:
        ``x_cos, x_sin``, each ``(E, F, n_ang)`` with ``F = 2C(L+1)``, row
        ``c*(L+1) + l``: ``x_cos[e, row, m] = A_loc[e, c, l^2+l+m]`` for
        ``0 <= m <= min(l, M)``, ``x_sin[e, row, m] = A_loc[e, c, l^2+l-m]`` for
        ``1 <= m <= min(l, M)``, zero elsewhere.
    """
    S = h.shape[1]
    L = math.isqrt(S) - 1
    t = lm_tables(L, mmax).on(h.device)
    A = torch.cat([h[dst], h[src]], dim=-1)  # (E, S, 2C)
    A_loc = torch.matmul(D, A)  # (E, S, 2C)
    A_pad = nnf.pad(A_loc.transpose(1, 2), (0, 1))  # (E, 2C, S+1), zero column at S
    E, C2 = A_pad.shape[:2]
    n_ang = t.n_ang
    # torch.gather, not advanced indexing: its backward is a scatter-add, where
    # advanced indexing's backward is a sort-based index_put: 38 % of the force step
    # on the H200 (book/history/01_reference/index_put)
    idx_cos = t.cos_index.reshape(1, 1, -1).expand(E, C2, -1)
    idx_sin = t.sin_index.reshape(1, 1, -1).expand(E, C2, -1)
    x_cos = torch.gather(A_pad, 2, idx_cos)  # (E, 2C, (L+1) n_ang)
    x_sin = torch.gather(A_pad, 2, idx_sin)
    return x_cos.reshape(E, C2 * (L + 1), n_ang), x_sin.reshape(E, C2 * (L + 1), n_ang)


# --------------------------------------------------------------------------------------
# 4c. the SO(2) value path
# --------------------------------------------------------------------------------------
def _check_equivariant_linear(x_cos, x_sin, weight, bias) -> None:
    """Shapes, dtypes and devices of :func:`equivariant_linear`'s arguments."""
    _float("x_cos", x_cos)
    _same("x_cos", x_cos, x_sin=x_sin, weight=weight)
    if x_cos.shape != x_sin.shape:
        raise ValueError(
            f"x_cos {tuple(x_cos.shape)} and x_sin {tuple(x_sin.shape)} differ"
        )
    if weight.ndim != 3 or x_cos.ndim < 2 or weight.shape[0] != x_cos.shape[-1]:
        raise ValueError(
            f"weight must be (n_ang, out, in) with n_ang = x.shape[-1]; got weight "
            f"{tuple(weight.shape)} for x {tuple(x_cos.shape)}"
        )
    if weight.shape[2] != x_cos.shape[-2]:
        raise ValueError(
            f"weight expects in={weight.shape[2]}, x has {x_cos.shape[-2]}"
        )
    if bias is not None:
        _same("x_cos", x_cos, bias=bias)
        if bias.shape != weight.shape[1:2]:
            raise ValueError(
                f"bias must have shape ({weight.shape[1]},), got {tuple(bias.shape)}"
            )


def equivariant_linear(
    x_cos: torch.Tensor,
    x_sin: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y[..., o, m] = sum_i x[..., i, m] W[m, o, i]`` for cos and sin alike.

    The same ``W[m]`` acts on the cos and the sin part of order m, so the map commutes
    with rotations about the edge axis (which turn each (cos, sin) pair by ``m a``).
    ``bias`` enters only the ``m = 0`` cos slot, the one rotation-invariant slot.

    Args:
        x_cos, x_sin: ``(..., in, n_ang)``.
        weight: ``(n_ang, out, in)``.
        bias: ``(out,)`` or None.

    Returns:
        ``y_cos, y_sin``, each ``(..., out, n_ang)``.
    """
    _check_equivariant_linear(x_cos, x_sin, weight, bias)
    y_cos = torch.einsum("...im,moi->...om", x_cos, weight)
    y_sin = torch.einsum("...im,moi->...om", x_sin, weight)
    if bias is not None:
        y_cos = torch.cat([(y_cos[..., 0] + bias)[..., None], y_cos[..., 1:]], dim=-1)
    return y_cos, y_sin


def gate(z_cos: torch.Tensor, z_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU on each row's ``m = 0`` cos slot; that row's ``m >= 1`` slots (cos and sin)
    times ``sigmoid`` of the row's pre-activation ``m = 0`` cos value."""
    pre = z_cos[..., :1]
    g = torch.sigmoid(pre)
    g_cos = torch.cat([pre * g, z_cos[..., 1:] * g], dim=-1)
    g_sin = torch.cat([z_sin[..., :1], z_sin[..., 1:] * g], dim=-1)
    return g_cos, g_sin


def mixing_stack(
    x_cos: torch.Tensor,
    x_sin: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    weight_out: torch.Tensor,
    bias_out: torch.Tensor | None,
    linear=equivariant_linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``u_0 = x``; ``u_k = u_{k-1} + gate(Linear_k(u_{k-1}))``; then ``Linear_out``.

    ``linear`` is the EquivariantLinear implementation (the reference by default), so
    the fast paths of later chapters slot into the same stack.
    """
    u_cos, u_sin = x_cos, x_sin
    for w, b in zip(weights, biases, strict=True):
        z_cos, z_sin = linear(u_cos, u_sin, w, b)
        g_cos, g_sin = gate(z_cos, z_sin)
        u_cos, u_sin = u_cos + g_cos, u_sin + g_sin
    return linear(u_cos, u_sin, weight_out, bias_out)


# --------------------------------------------------------------------------------------
# 4d-f. back to the global frame, aggregate, update
# --------------------------------------------------------------------------------------
def pack_and_unrotate(
    y_cos: torch.Tensor, y_sin: torch.Tensor, D: torch.Tensor, mmax: int
) -> torch.Tensor:
    """Inverse of :func:`rotate_and_select`: pack, then rotate with ``D_e^T``.

    Args:
        y_cos, y_sin: ``(E, C'(L+1), n_ang)``.
        D: ``(E, S, S)``.
        mmax: M; components with ``|m| > M`` are zero.

    Returns:
        ``msg (E, S, C')`` in the global frame.
    """
    E, S = D.shape[0], D.shape[-1]
    L = math.isqrt(S) - 1
    t = lm_tables(L, mmax).on(D.device)
    Cp = y_cos.shape[1] // (L + 1)
    flat = torch.cat(
        [
            y_cos.reshape(E, Cp, (L + 1) * t.n_ang),
            y_sin.reshape(E, Cp, (L + 1) * t.n_ang),
            y_cos.new_zeros(E, Cp, 1),
        ],
        dim=-1,
    )  # (E, C', 2 (L+1) n_ang + 1)
    idx = t.pack_index.reshape(1, 1, -1).expand(E, Cp, -1)
    loc = torch.gather(flat, 2, idx)  # (E, C', S)
    return torch.matmul(D.transpose(1, 2), loc.transpose(1, 2))  # (E, S, C')


def aggregate(
    msg: torch.Tensor,
    dst: torch.Tensor,
    n_nodes: int,
    scale: float,
    edge_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Delta[n] = scale * sum_{e: dst_e = n} w_e msg[e]``, ``(E, S, C) -> (N, S, C)``.

    ``edge_weight (E,)`` is the envelope ``u(d_e)`` in the model: the
    mixing stack's biases and gates leave a message that does not vanish at the
    cutoff, and this weight makes it vanish with two derivatives, so the energy is
    smooth when an edge enters or leaves the neighbour list. None means 1.
    """
    if edge_weight is not None:
        msg = msg * edge_weight[:, None, None]
    out = msg.new_zeros(n_nodes, *msg.shape[1:])
    return out.index_add_(0, dst, msg * scale)


def node_update(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """``h + Delta_l @ W_l`` for each degree l (one ``(C, C)`` matrix per l, shared
    over m, like e3nn's ``o3.Linear``). ``weight (L+1, C, C)``."""
    S = h.shape[1]
    L = math.isqrt(S) - 1
    w_s = weight[lm_tables(L).on(h.device).l_of_s]  # (S, C, C)
    return h + torch.einsum("nsc,scd->nsd", delta, w_s)
