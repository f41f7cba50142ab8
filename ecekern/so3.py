"""Real spherical harmonics, real Wigner matrices and per-edge frames.

Conventions (the book, chapter 1):

* real spherical harmonics with z as the polar axis, orthonormal on the unit sphere,
  no Condon-Shortley phase, component index ``s = l*l + l + m`` for ``m = -l..l``, so
  degree 1 is ordered ``(y, z, x)``: ``Y_1 = sqrt(3 / 4 pi) * (y, z, x)``;
* the real Wigner matrix ``D(R)`` is defined by ``Y(R r) = D(R) Y(r)``. It is
  block-diagonal over ``l``, orthogonal, and a representation:
  ``D(R1 @ R2) = D(R1) @ D(R2)``;
* an edge frame is a rotation ``R_e`` with ``R_e u_e = z`` for the edge direction
  ``u_e``; ``D_e = D(R_e)`` takes features into the frame where the edge is the
  polar axis. Rotations about z are a free gauge that the model must not see.

Shapes: ``vectors (..., 3) -> Y (..., S)``; ``rotation (..., 3, 3) -> D (..., S, S)``
with ``S = (lmax + 1)**2``.

Everything here is plain PyTorch, works on any device in float32 and float64, and is
differentiable to any order (the Wigner matrix is a polynomial in the entries of R).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

__all__ = [
    "LMTables",
    "edge_frames",
    "edge_rotations",
    "lm_tables",
    "n_components",
    "spherical_harmonics",
    "wigner_D",
]


@contextlib.contextmanager
def table_mode():
    """Where tables cached across calls are made: as ordinary tensors even when the
    first call comes under ``torch.inference_mode`` (an inference tensor cannot be
    saved for a later backward) or with grad enabled."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def n_components(lmax: int) -> int:
    """``S = (lmax + 1)**2``, the number of spherical components up to ``lmax``."""
    return (lmax + 1) ** 2


def _check_lmax(lmax: int) -> None:
    if isinstance(lmax, bool) or not isinstance(lmax, int) or lmax < 0:
        raise ValueError(f"lmax must be a non-negative int, got {lmax!r}")
    if lmax > 12:
        raise ValueError(
            f"lmax={lmax} is beyond what this module is tested for (<= 12)"
        )


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")


@functools.cache
def _sh_norms(lmax: int) -> tuple[tuple[float, ...], ...]:
    """``N_lm * (sqrt 2 if m > 0)`` for ``0 <= m <= l``."""
    out = []
    for l in range(lmax + 1):
        row = []
        for m in range(l + 1):
            n = math.sqrt(
                (2 * l + 1)
                / (4 * math.pi)
                * math.factorial(l - m)
                / math.factorial(l + m)
            )
            row.append(n * (math.sqrt(2.0) if m > 0 else 1.0))
        out.append(tuple(row))
    return tuple(out)


def spherical_harmonics(
    lmax: int, vectors: torch.Tensor, normalize: bool = True
) -> torch.Tensor:
    """Real spherical harmonics ``Y_s(u)`` for ``s < (lmax + 1)**2``.

    Equivariance: ``Y(R u) = wigner_D(lmax, R) @ Y(u)``.

    Args:
        lmax: largest degree.
        vectors: ``(..., 3)`` float tensor. With ``normalize=True`` (the default) the
            vectors are scaled to unit length first (a zero vector is an error of the
            caller: its direction is undefined and the result is NaN).
        normalize: set ``False`` when the inputs are already unit vectors; the result
            is then the homogeneous polynomial (solid harmonic) of ``vectors``.

    Returns:
        ``(..., S)`` in the same dtype and device.

    The evaluation is polynomial in ``(x, y, z)``: associated Legendre functions
    divided by ``sin(theta)**m`` (a polynomial in z) times ``Re/Im (x + i y)**m``,
    so it is smooth at the poles and differentiable to any order.
    """
    _check_lmax(lmax)
    _check_float("vectors", vectors)
    if vectors.shape[-1:] != (3,):
        raise ValueError(
            f"vectors must have shape (..., 3), got {tuple(vectors.shape)}"
        )
    if normalize:
        vectors = vectors / torch.linalg.vector_norm(vectors, dim=-1, keepdim=True)
    x, y, z = vectors.unbind(-1)
    norms = _sh_norms(lmax)
    # cos_m + i sin_m = (x + i y)**m, built by recurrence
    cos_m = [torch.ones_like(x)]
    sin_m = [torch.zeros_like(x)]
    for _ in range(1, lmax + 1):
        c, s = cos_m[-1], sin_m[-1]
        cos_m.append(c * x - s * y)
        sin_m.append(s * x + c * y)
    # q[l][m] = P_l^m(z) / sin(theta)**m, a polynomial in z
    q = [[None] * (lmax + 1) for _ in range(lmax + 1)]
    for m in range(lmax + 1):
        dfact = math.prod(range(1, 2 * m, 2)) if m > 0 else 1  # (2m-1)!!
        q[m][m] = torch.full_like(z, float(dfact))
        if m + 1 <= lmax:
            q[m + 1][m] = (2 * m + 1) * z * q[m][m]
        for l in range(m + 2, lmax + 1):
            q[l][m] = ((2 * l - 1) * z * q[l - 1][m] - (l + m - 1) * q[l - 2][m]) / (
                l - m
            )
    comps = []
    for l in range(lmax + 1):
        for m in range(-l, l + 1):
            a = abs(m)
            ang = cos_m[a] if m >= 0 else sin_m[a]
            comps.append(norms[l][a] * q[l][a] * ang)
    return torch.stack(comps, dim=-1)


@functools.cache
def _fit_points(lmax: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Fixed sample directions P and, per degree, ``pinv(Y_l(P))`` in float64.

    ``Y_l(R P) = Y_l(P) D_l^T`` for every rotation R, so
    ``D_l = (pinv(Y_l(P)) Y_l(R P))^T``, exactly, once ``Y_l(P)`` has full rank.
    """
    with table_mode():
        return _fit_points_cpu(lmax)


def _fit_points_cpu(lmax: int):
    n = 2 * (2 * lmax + 1) + 2
    g = torch.Generator().manual_seed(1234)
    pts = torch.randn(n, 3, generator=g, dtype=torch.float64)
    pts = pts / pts.norm(dim=-1, keepdim=True)
    y = spherical_harmonics(lmax, pts, normalize=False)
    pinvs = []
    for l in range(lmax + 1):
        yl = y[:, l * l : (l + 1) ** 2]
        assert torch.linalg.matrix_rank(yl) == 2 * l + 1
        pinvs.append(torch.linalg.pinv(yl))  # (2l+1, n)
    return pts, tuple(pinvs)


@functools.cache
def _fit_points_on(lmax: int, device: torch.device, dtype: torch.dtype):
    """:func:`_fit_points` on ``device`` in ``dtype``, copied there once: a
    host-to-device copy per call would cost a host synchronisation every step."""
    pts, pinvs = _fit_points(lmax)
    with table_mode():
        return pts.to(device, dtype), tuple(p.to(device, dtype) for p in pinvs)


def wigner_D(lmax: int, rotation: torch.Tensor) -> torch.Tensor:
    """Real Wigner matrix ``D(R)``, block-diagonal over degrees, ``(..., S, S)``.

    Defined by ``Y(R r) = D(R) Y(r)`` for every direction r; orthogonal and a
    representation (``D(R1 R2) = D(R1) D(R2)``) when ``rotation`` is a proper rotation.

    Computed from that definition: the spherical harmonics of a fixed set of rotated
    sample directions, times a precomputed pseudo-inverse per degree. This is exact
    in exact arithmetic, costs one small GEMM per degree, and is a polynomial in the
    entries of ``rotation``, hence differentiable to any order.

    Args:
        lmax: largest degree.
        rotation: ``(..., 3, 3)`` float tensor, a rotation matrix (not checked: an
            improper or non-orthogonal matrix gives a matrix that is not a
            representation).
    """
    _check_lmax(lmax)
    _check_float("rotation", rotation)
    if rotation.shape[-2:] != (3, 3):
        raise ValueError(
            f"rotation must have shape (..., 3, 3), got {tuple(rotation.shape)}"
        )
    pts, pinvs = _fit_points_on(lmax, rotation.device, rotation.dtype)
    rp = torch.einsum("...ij,nj->...ni", rotation, pts)  # (..., n, 3)
    y = spherical_harmonics(lmax, rp, normalize=False)  # (..., n, S)
    batch = rotation.shape[:-2]
    S = n_components(lmax)
    D = rotation.new_zeros(*batch, S, S)
    for l, pinv in enumerate(pinvs):
        sl = slice(l * l, (l + 1) ** 2)
        # D_l = (pinv @ Y_l(RP))^T = Y_l(RP)^T @ pinv^T
        D[..., sl, sl] = torch.einsum("...ni,jn->...ij", y[..., sl], pinv)
    return D


def _skew(v: torch.Tensor) -> torch.Tensor:
    x, y, z = v.unbind(-1)
    o = torch.zeros_like(x)
    return torch.stack(
        [
            torch.stack([o, -z, y], -1),
            torch.stack([z, o, -x], -1),
            torch.stack([-y, x, o], -1),
        ],
        -2,
    )


def edge_rotations(
    vectors: torch.Tensor, gauge: torch.Tensor | None = None
) -> torch.Tensor:
    """A rotation ``R_e`` with ``R_e u_e = z`` per edge, ``(E, 3) -> (E, 3, 3)``.

    The gauge (the free rotation about z after alignment) is the minimal rotation that
    takes ``u`` to ``+z`` when ``u_z >= 0``; otherwise the minimal rotation that takes
    ``u`` to ``-z`` followed by a half turn about x. Both branches divide by
    ``1 + |u_z| >= 1``, so the frame is well conditioned for every direction, in
    float32 too. The gauge jumps where ``u_z`` changes sign; the model does not see
    the gauge, so its energy and forces stay smooth.

    Args:
        vectors: ``(E, 3)`` edge vectors (any non-zero length).
        gauge: optional ``(E,)`` angles; the frame is then followed by a rotation
            about z by that angle (used to test that the model is gauge invariant).
    """
    _check_float("vectors", vectors)
    if vectors.ndim != 2 or vectors.shape[-1] != 3:
        raise ValueError(f"vectors must have shape (E, 3), got {tuple(vectors.shape)}")
    u = vectors / torch.linalg.vector_norm(vectors, dim=-1, keepdim=True)
    sign = torch.where(u[:, 2] >= 0, 1.0, -1.0).to(u.dtype)
    target = torch.zeros_like(u)
    target[:, 2] = sign
    v = torch.linalg.cross(u, target)  # rotation axis times sin
    c = (u * target).sum(-1)  # cos >= 0
    K = _skew(v)
    eye = torch.eye(3, dtype=u.dtype, device=u.device)
    R = eye + K + (K @ K) / (1.0 + c)[:, None, None]
    # half turn about x for the u_z < 0 branch: diag(1, -1, -1)
    flip = torch.stack([torch.ones_like(sign), sign, sign], -1)
    R = flip[:, :, None] * R
    if gauge is not None:
        if gauge.shape != vectors.shape[:1]:
            raise ValueError(f"gauge must have shape (E,), got {tuple(gauge.shape)}")
        cg, sg = torch.cos(gauge), torch.sin(gauge)
        o, one = torch.zeros_like(cg), torch.ones_like(cg)
        Rz = torch.stack(
            [
                torch.stack([cg, -sg, o], -1),
                torch.stack([sg, cg, o], -1),
                torch.stack([o, o, one], -1),
            ],
            -2,
        )
        R = Rz @ R
    return R


def edge_frames(
    lmax: int, vectors: torch.Tensor, gauge: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-edge Wigner blocks ``D_e = D(R_e)``, ``(E, 3) -> (E, S, S)``.

    ``D_e @ Y(u_e)`` is ``Y(z)``: the edge becomes the polar axis. Differentiable in
    ``vectors`` (forces flow through it). See :func:`edge_rotations` for the gauge.
    """
    return wigner_D(lmax, edge_rotations(vectors, gauge))


class LMTables:
    """Index tables between the spherical index s and (l, m) and the angular layout.

    A layout description, no data of the model: built once per ``(lmax, mmax)``. All
    tables are ``torch.long`` tensors on the CPU:

    * ``l_of_s``, ``m_of_s`` ``(S,)``: degree and order of each component;
    * ``m0_rows`` ``(S,)``: ``l^2 + l`` of each component's degree, the row of its
      m = 0 component, so ``Z[e, s] = D_e[m0_rows[s], s]`` is the zonal row;
    * ``cos_index`` ``(L+1, n_ang)``: the component ``l^2+l+m`` of the cos slot
      ``(l, m)``, or ``S`` (a zero column) where ``m > min(l, M)``;
    * ``sin_index`` ``(L+1, n_ang)``: the component ``l^2+l-m`` of the sin slot, or
      ``S`` where ``m == 0`` or ``m > min(l, M)``;
    * ``pack_index`` ``(S,)``: for each s, its position in the flattened slot vector
      ``[cos (L+1)*n_ang | sin (L+1)*n_ang | zero]``; components with ``|m| > M``
      point at the zero.
    """

    def __init__(self, lmax: int, mmax: int | None = None):
        with table_mode():
            self._build(lmax, mmax)
        self._on: dict[torch.device, LMTables] = {}
        self._base = self

    def _build(self, lmax: int, mmax: int | None) -> None:
        _check_lmax(lmax)
        mmax = lmax if mmax is None else mmax
        if not (isinstance(mmax, int) and 0 <= mmax <= lmax):
            raise ValueError(f"mmax must be an int in [0, lmax={lmax}], got {mmax!r}")
        self.lmax, self.mmax = lmax, mmax
        L, M = lmax, mmax
        S = n_components(L)
        self.S, self.n_ang = S, M + 1
        ls = [l for l in range(L + 1) for _ in range(2 * l + 1)]
        ms = [m for l in range(L + 1) for m in range(-l, l + 1)]
        self.l_of_s = torch.tensor(ls, dtype=torch.long)
        self.m_of_s = torch.tensor(ms, dtype=torch.long)
        self.m0_rows = self.l_of_s**2 + self.l_of_s
        cos_index = torch.full((L + 1, M + 1), S, dtype=torch.long)
        sin_index = torch.full((L + 1, M + 1), S, dtype=torch.long)
        for l in range(L + 1):
            for m in range(min(l, M) + 1):
                cos_index[l, m] = l * l + l + m
                if m >= 1:
                    sin_index[l, m] = l * l + l - m
        self.cos_index, self.sin_index = cos_index, sin_index
        n_slots = (L + 1) * (M + 1)
        pack = torch.full((S,), 2 * n_slots, dtype=torch.long)
        for s, (l, m) in enumerate(zip(ls, ms)):
            if abs(m) <= M:
                flat = l * (M + 1) + abs(m)
                pack[s] = flat if m >= 0 else n_slots + flat
        self.pack_index = pack

    def on(self, device) -> LMTables:
        """These tables with every tensor on ``device``, copied there once and
        cached (the model asks for them every step; a copy per call would be a
        host-to-device copy, and a host synchronisation, per call)."""
        device = torch.device(device)
        base = self._base
        if device.type == "cpu":
            return base
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        tab = base._on.get(device)
        if tab is None:
            tab = LMTables.__new__(LMTables)
            tab.__dict__.update(base.__dict__)
            with table_mode():
                for name in _TABLE_NAMES:
                    setattr(tab, name, getattr(base, name).to(device))
            tab._on = {}
            base._on[device] = tab
        return tab

    def __repr__(self) -> str:
        return f"LMTables(lmax={self.lmax}, mmax={self.mmax})"


_TABLE_NAMES = (
    "l_of_s", "m_of_s", "m0_rows", "cos_index", "sin_index", "pack_index"
)  # fmt: skip


@functools.cache
def lm_tables(lmax: int, mmax: int | None = None) -> LMTables:
    """Cached :class:`LMTables` for ``(lmax, mmax)``."""
    return LMTables(lmax, mmax)
