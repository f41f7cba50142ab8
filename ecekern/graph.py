"""The graph: periodic neighbour list, dst-sorted edges and the CSR row pointer.

An edge ``e`` is ``j -> i`` with ``src_e = j``, ``dst_e = i`` and integer cell shift
``shift_e`` (in cell vectors); its vector is ``r_e = x_j + shift_e @ cell - x_i``
(the ``ijS`` convention of ASE and vesin). Edges are sorted by ``(dst, src, shift)``
so the order is deterministic, and ``row_ptr (N+1,)`` delimits each destination's
segment: the edges into atom ``n`` are ``row_ptr[n]:row_ptr[n+1]``.

The neighbour search is the field's own library, vesin (``vesin_torch``: CPU and
CUDA tensors). It is right for any cell, including cells shorter than twice the
cutoff (several images of one atom), skewed cells and non-periodic directions.

Checks. vesin is C++ and trusts its input: a NaN cell, a cutoff far longer than the
cell or atoms spread very unevenly make it divide by zero (the interpreter dies with
SIGFPE), loop for hours, run out of memory or overflow an integer and return a wrong
list. :func:`neighbor_list` (and so :func:`build_graph`) therefore refuses, with a
ValueError or TypeError that names the problem and the fix, before vesin runs:

* ``pbc`` that is not one bool or three (numpy and torch bools included);
* non-finite positions or cell, coordinates beyond :data:`MAX_COORDINATE`, a cutoff
  below :data:`MIN_DISTANCE`;
* a singular cell (periodic cell vectors linearly dependent), and positions more
  than :data:`MAX_CELLS_AWAY` cell lengths outside the cell in a periodic direction;
* a search that would create more than ``max_edges`` edges (default
  :data:`MAX_EDGES`; estimated as ``N * (N / V) * 4/3 pi rc^3``, ``V`` the periodic
  cell's volume, or the atoms' extent in non-periodic directions), or check more than
  :data:`MAX_SEARCH_WORK` cells and atom pairs (a cell whose opposite faces are much
  closer than the cutoff: a thin, skewed or tiny cell, or a huge cutoff);
* a system so elongated that vesin's cell grid would have an empty dimension;

and after the search, two atoms (or an atom and a periodic image) closer than
:data:`MIN_DISTANCE`: a duplicated atom would give NaN energies and forces. All of it is
O(N) on the positions plus one reduction over the edges.

Non-periodic directions only need a finite cell vector (zero is fine): vesin replaces
them by unit vectors orthogonal to the periodic ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "MAX_CELLS_AWAY",
    "MAX_COORDINATE",
    "MAX_EDGES",
    "MAX_SEARCH_WORK",
    "MIN_DISTANCE",
    "Graph",
    "build_graph",
    "check_graph",
    "csr_order",
    "csr_row_ptr",
    "edge_vectors",
    "neighbor_list",
    "with_cell",
]

#: Two atoms (or an atom and a periodic image) closer than this, in Angstrom, are an
#: error: a duplicated or collapsed atom (coincident atoms make the energy NaN).
MIN_DISTANCE = 0.1
#: Default limit on the edges one neighbour search may create (``max_edges``): some
#: 10 GB in the search and sort alone, more than a model step on one GPU can hold.
MAX_EDGES = 200_000_000
#: Limit on the cells visited plus atom pairs checked by one search (10 to 20 s of
#: vesin on one CPU core; a well-shaped search checks about 10 pairs per edge).
MAX_SEARCH_WORK = 1e9
#: Largest coordinate magnitude, in Angstrom (1 cm), of positions and periodic cell
#: vectors.
MAX_COORDINATE = 1e8
#: Positions may lie at most this many cell lengths outside the cell in a periodic
#: direction (vesin's integer cell index overflows further out).
MAX_CELLS_AWAY = 1e4

_VESIN_MAX_CELLS = 1e5  # vesin's cap on its cell-list grid (cpu_cell_list.cpp)


def _as_tensor(name, x, dtype=None, device=None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x if dtype is None else x.to(dtype)
    if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)):
        return torch.as_tensor(np.asarray(x), dtype=dtype, device=device)
    raise TypeError(
        f"{name} must be a torch.Tensor or array-like, got {type(x).__name__}"
    )


def _fmt(cell: torch.Tensor) -> str:
    """A 3x3 cell in 4 significant digits, on one line."""
    rows = [", ".join(f"{v:.4g}" for v in r) for r in cell.detach().cpu().tolist()]
    return "[[" + "], [".join(rows) + "]]"


def _is_bool(p) -> bool:
    if isinstance(p, (bool, np.bool_)):
        return True
    return isinstance(p, (torch.Tensor, np.ndarray)) and p.ndim == 0 and _bool_dtype(p)


def _bool_dtype(x) -> bool:
    return x.dtype == (torch.bool if isinstance(x, torch.Tensor) else np.bool_)


def _parse_pbc(pbc) -> list[bool]:
    """``pbc`` as three Python bools; one bool (Python, numpy or a 0-d bool tensor)
    means all three directions."""
    if isinstance(pbc, (torch.Tensor, np.ndarray)) and _bool_dtype(pbc):
        pbc = pbc.tolist()
    if _is_bool(pbc):
        return [bool(pbc)] * 3
    if isinstance(pbc, (list, tuple)) and all(_is_bool(p) for p in pbc):
        if len(pbc) != 3:
            raise ValueError(
                f"pbc must be a bool or three bools (one per cell vector), got "
                f"{len(pbc)} values {[bool(p) for p in pbc]}"
            )
        return [bool(p) for p in pbc]
    raise TypeError(
        f"pbc must be a bool or three bools (one per cell vector), got {pbc!r} "
        f"({type(pbc).__name__}); pass e.g. pbc=False or pbc=(True, True, False)"
    )


def _check_system(positions, cell, pbc, cutoff):
    positions = _as_tensor("positions", positions)
    if not positions.is_floating_point():
        raise TypeError(f"positions must be floating point, got {positions.dtype}")
    if positions.ndim != 2 or positions.shape[1] != 3:
        raise ValueError(
            f"positions must have shape (N, 3), got {tuple(positions.shape)}"
        )
    cell = _as_tensor("cell", cell, dtype=positions.dtype, device=positions.device)
    if cell.shape != (3, 3):
        raise ValueError(f"cell must have shape (3, 3), got {tuple(cell.shape)}")
    if cell.device != positions.device:
        raise ValueError(f"cell is on {cell.device}, positions on {positions.device}")
    pbc = _parse_pbc(pbc)
    if isinstance(cutoff, bool) or not isinstance(
        cutoff, (int, float, np.number, torch.Tensor)
    ):
        raise TypeError(f"cutoff must be a number (Angstrom), got {cutoff!r}")
    cutoff = float(cutoff)
    if not (math.isfinite(cutoff) and cutoff >= MIN_DISTANCE):
        raise ValueError(
            f"cutoff must be a finite number >= MIN_DISTANCE = {MIN_DISTANCE} A, got "
            f"{cutoff!r}"
        )
    # one reduction over the positions and one copy of the cell (each a sync on CUDA)
    big = float(positions.detach().abs().amax()) if positions.shape[0] else 0.0
    if not math.isfinite(big):
        atom = int((~torch.isfinite(positions).all(1)).nonzero()[0])
        raise ValueError(
            f"positions contain NaN or infinity (atom {atom}: "
            f"{positions[atom].tolist()}); give finite positions"
        )
    if big > MAX_COORDINATE:
        raise ValueError(
            f"positions reach {big:.3g} A, beyond MAX_COORDINATE = "
            f"{MAX_COORDINATE:.0e} A; give positions in Angstrom, near the cell"
        )
    c = cell.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(c).all():
        raise ValueError(
            f"cell contains NaN or infinity: {_fmt(cell)}; give a finite cell "
            "(any finite vectors, e.g. zeros, in non-periodic directions)"
        )
    for k in range(3):
        big = float(np.abs(c[k]).max())
        if pbc[k] and big == 0.0:
            raise ValueError(f"direction {k} is periodic but cell vector {k} is zero")
        if pbc[k] and big > MAX_COORDINATE:
            raise ValueError(
                f"cell vector {k} has a {big:.3g} A component, beyond MAX_COORDINATE = "
                f"{MAX_COORDINATE:.0e} A; give the cell in Angstrom, or pbc False in "
                f"direction {k}"
            )
    return positions, cell, pbc, cutoff


def _norm(v: np.ndarray) -> float:
    """Euclidean norm without overflow or underflow of the squares."""
    s = float(np.abs(v).max())
    return 0.0 if s == 0.0 else s * float(np.linalg.norm(v / s))


def _search_box(cell: np.ndarray, pbc: list[bool]) -> np.ndarray:
    """vesin's box: the periodic cell vectors, and unit vectors orthogonal to them
    (and to each other) in the non-periodic directions."""
    periodic = [k for k in range(3) if pbc[k]]
    box = np.eye(3) if not periodic else cell.copy()
    if len(periodic) == 1:
        (k,) = periodic
        a = box[k] / _norm(box[k])
        b = np.array([0.0, 1.0, 0.0])
        if abs(a @ b) > 0.9:
            b = np.array([0.0, 0.0, 1.0])
        c = np.cross(a, b)
        c /= _norm(c)
        b = np.cross(c, a)
        box[(k + 1) % 3], box[(k + 2) % 3] = b / _norm(b), c
    elif len(periodic) == 2:
        i, j = periodic
        c = np.cross(box[i] / _norm(box[i]), box[j] / _norm(box[j]))
        norm = _norm(c)
        box[3 - i - j] = c / norm if norm > 0 else 0.0
    return box


def _vesin_grid(extent: list[float], cutoff: float) -> list[float]:
    """The shape of vesin's cell-list grid (``CellList::CellList`` in vesin 0.6);
    a 0 in it is an integer division by zero (SIGFPE) inside vesin."""
    n = [max(1.0, math.trunc(e / cutoff)) for e in extent]
    if n[0] * n[1] * n[2] > _VESIN_MAX_CELLS:
        r_xy, r_yz = n[0] / n[1], n[1] / n[2]
        raw = math.pow(_VESIN_MAX_CELLS / (r_xy * r_yz * r_yz), 1.0 / 3.0)
        n2 = math.trunc(raw)
        n1 = math.trunc(r_yz * n2)
        n0 = math.trunc(r_xy * n1)
        # a margin of 1e-9 against rounding differences with vesin's std::cbrt
        near_zero = min(raw, r_yz * n2, r_xy * n1) < 1.0 + 1e-9
        n = [0.0 if near_zero else float(m) for m in (n0, n1, n2)]
    return n


def _ceil(x: float) -> float:
    return float(math.ceil(x)) if x < 1e300 else math.inf


def _check_search(positions, cell, pbc, cutoff, max_edges) -> None:
    """Refuse, before vesin runs, a search that would crash it, hang or not fit."""
    n_atoms = positions.shape[0]
    periodic = [k for k in range(3) if pbc[k]]
    box = _search_box(cell.detach().to("cpu", torch.float64).numpy(), pbc)
    # box = diag(length) @ unit, computed on the unit rows (no over- or underflow)
    length = np.array([_norm(row) for row in box])
    unit = box / np.where(length > 0, length, 1.0)[:, None]
    shape = abs(float(np.linalg.det(unit)))  # volume / prod(length), in [0, 1]
    if periodic and not shape > 1e-12:
        raise ValueError(
            f"cell is singular: the periodic cell vectors {periodic} are linearly "
            f"dependent ({_fmt(cell)}); give independent cell vectors"
        )
    volume = shape * float(np.prod(length))
    # distance between the opposite faces of the cell along each cell vector
    face = [
        shape * length[k] / _norm(np.cross(unit[(k + 1) % 3], unit[(k + 2) % 3]))
        for k in range(3)
    ]
    # fractional coordinates along the periodic vectors; lengths (A) along the
    # orthonormal non-periodic ones; and the Cartesian extent vesin's grid uses
    x = positions.detach().double()
    inverse = np.linalg.inv(unit) / length[None, :]
    frac = x @ torch.as_tensor(inverse, device=x.device)
    lo, hi, x_lo, x_hi = torch.stack(
        [frac.amin(0), frac.amax(0), x.amin(0), x.amax(0)]
    ).tolist()

    # vesin's grid and search stencil: the images of the cell within the cutoff
    extent = []
    for k in range(3):
        if pbc[k]:
            extent.append(face[k])
        else:
            span = x_hi[k] - x_lo[k]
            extent.append(max(1.01 if span < 1e-6 else 1.01 * span, 1.0))
    grid = _vesin_grid(extent, cutoff)
    cells = max(grid[0] * grid[1] * grid[2], 1.0)
    stencil = 1.0
    reach = []
    for k in range(3):
        s = max(1.0, _ceil(cutoff * max(grid[k], 1.0) / extent[k]))
        if periodic and not pbc[k]:  # mixed pbc: vesin searches every cell here
            s = max(s, grid[k] - 1)
        reach.append(s)
        stencil *= 2 * s + 1
    work = cells * stencil + n_atoms * (n_atoms / cells) * stencil

    # edges: N * (N / V) * (4/3) pi rc^3, V the periodic cell's volume times the
    # atoms' extent (at least rc) along each non-periodic direction; at most N^2 per
    # image of the cell within reach
    span = [hi[k] - lo[k] for k in range(3)]
    v_eff = volume * math.prod(max(span[k], cutoff) for k in range(3) if not pbc[k])
    images = math.prod(2 * _ceil(cutoff / face[k]) + 1 for k in periodic)
    ball = 4 / 3 * math.pi * cutoff**3
    edges = n_atoms * n_atoms * min(ball / v_eff if v_eff > 0 else math.inf, images)

    if work > MAX_SEARCH_WORK:
        k = max(range(3), key=lambda k: reach[k])
        if pbc[k]:
            why = (
                f"cell vector {k} is only {face[k]:.3g} A from its opposite face, "
                f"against a {cutoff:g} A cutoff. Use a smaller cutoff, a larger cell "
                "(atoms.repeat) or a reduced one (ase.build.niggli_reduce), or pbc "
                f"False in direction {k}"
            )
        else:
            why = (
                f"the atoms span only {extent[k]:.3g} A along axis {k}, against a "
                f"{cutoff:g} A cutoff. Use a smaller cutoff"
            )
        raise ValueError(
            f"the neighbour search would check about {work:.2g} cells and atom pairs "
            f"(limit MAX_SEARCH_WORK = {MAX_SEARCH_WORK:.0e}) and create about "
            f"{edges:.2g} edges: {why}."
        )
    if edges > max_edges:
        raise ValueError(
            f"a {cutoff:g} A cutoff would give these {n_atoms} atoms about "
            f"{edges:.2g} edges ({edges / n_atoms:.3g} neighbours each; limit "
            f"max_edges = {max_edges:.2g}). Use a smaller cutoff"
            + (", a larger cell or pbc False" if periodic else "")
            + ", or pass a larger max_edges if the memory is there."
        )
    for k in periodic:
        away = max(abs(lo[k]), abs(hi[k]))
        if away > MAX_CELLS_AWAY:
            atom = int(frac[:, k].abs().argmax())
            raise ValueError(
                f"atom {atom} lies {away:.3g} cell lengths along periodic cell vector "
                f"{k} from the cell (limit MAX_CELLS_AWAY = {MAX_CELLS_AWAY:.0e}); "
                "wrap the positions into the cell first (ase: atoms.wrap())"
            )
    if min(grid) < 1:
        raise ValueError(
            f"the system spans {extent[0]:.3g} x {extent[1]:.3g} x {extent[2]:.3g} A "
            f"(cell faces or atoms' extent), too elongated for vesin's cell list at a "
            f"{cutoff:g} A cutoff (it would crash); remove far-away atoms or make the "
            "cell less elongated (repeat it along its short directions)"
        )


def _check_max_edges(max_edges) -> int:
    if max_edges is None:
        return MAX_EDGES
    if isinstance(max_edges, bool) or not isinstance(max_edges, (int, np.integer)):
        raise TypeError(f"max_edges must be an int, got {max_edges!r}")
    if max_edges < 0:
        raise ValueError(f"max_edges must be >= 0, got {max_edges}")
    return int(max_edges)


def _neighbor_list(positions, cell, pbc, cutoff, max_edges):
    """:func:`neighbor_list` on checked inputs (see :func:`_check_system`)."""
    from vesin_torch import NeighborList

    device = positions.device
    n = positions.shape[0]
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty.clone(), torch.zeros(0, 3, dtype=torch.long, device=device)
    _check_search(positions, cell, pbc, cutoff, max_edges)
    box = (
        cell.detach().double()
        if any(pbc)
        else torch.zeros_like(cell, dtype=torch.float64)
    )
    nl = NeighborList(cutoff=cutoff, full_list=True)
    i, j, S, d = nl.compute(
        positions.detach().double(),
        box,
        torch.tensor(pbc, device=device),
        quantities="ijSd",
    )
    if i.shape[0] > max_edges:
        raise ValueError(
            f"a {cutoff:g} A cutoff gives these {n} atoms {i.shape[0]} edges, more "
            f"than max_edges = {max_edges}. Use a smaller cutoff, or pass a larger "
            "max_edges if the memory is there."
        )
    if i.shape[0]:
        closest, e = d.min(0)
        closest, e = torch.stack([closest, e.to(closest.dtype)]).tolist()
        if closest < MIN_DISTANCE:
            e = int(e)
            a, b, shift = int(i[e]), int(j[e]), S[e].tolist()
            if not any(shift):
                who = f"atoms {a} and {b}"
            elif a == b:
                who = f"atom {a} and its own periodic image (shift {shift})"
            else:
                who = f"atom {a} and the periodic image of atom {b} (shift {shift})"
            raise ValueError(
                f"{who} are {closest:.3g} A apart, closer than MIN_DISTANCE = "
                f"{MIN_DISTANCE} A: a duplicated or collapsed atom (coincident atoms "
                "make the energy NaN); remove it, or fix the positions or the cell"
            )
    dst, src, shifts = i.long(), j.long(), S.long()
    # deterministic order: stable sorts from the least to the most significant key
    order = torch.arange(dst.shape[0], device=device)
    for key in (shifts[:, 2], shifts[:, 1], shifts[:, 0], src, dst):
        order = order[torch.sort(key[order], stable=True).indices]
    return src[order], dst[order], shifts[order]


def neighbor_list(positions, cell, pbc, cutoff: float, max_edges: int | None = None):
    """All directed pairs closer than ``cutoff``, sorted by destination.

    Args:
        positions: ``(N, 3)`` float tensor or array (Angstrom).
        cell: ``(3, 3)`` cell vectors as rows (ignored in non-periodic directions,
            where any finite vector, zero included, will do).
        pbc: one bool, or three (one per cell vector): Python, numpy or torch bools.
        cutoff: radius in Angstrom, at least :data:`MIN_DISTANCE` (so the search
            finds every pair that is too close).
        max_edges: refuse a search that would create more edges than this (default
            :data:`MAX_EDGES`).

    Returns:
        ``(src, dst, shifts)``: ``(E,)``, ``(E,)`` int64 and ``(E, 3)`` int64 integer
        cell shifts, on ``positions``' device, sorted by ``(dst, src, shift)``; the edge
        vector is ``positions[src] + shifts @ cell - positions[dst]``. Self pairs appear
        only through a non-zero shift (an atom and its own periodic image).

    Raises:
        TypeError, ValueError: for input the search cannot serve; see the module
            docstring. Among them: two atoms closer than :data:`MIN_DISTANCE`.
    """
    positions, cell, pbc, cutoff = _check_system(positions, cell, pbc, cutoff)
    return _neighbor_list(positions, cell, pbc, cutoff, _check_max_edges(max_edges))


def csr_row_ptr(dst: torch.Tensor, n_nodes: int) -> torch.Tensor:
    """``row_ptr (N+1,)`` int64 for ``dst`` sorted ascending: edges into n are
    ``row_ptr[n]:row_ptr[n+1]``."""
    counts = torch.bincount(dst, minlength=n_nodes)
    row_ptr = torch.zeros(n_nodes + 1, dtype=torch.long, device=dst.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    return row_ptr


def csr_order(index: torch.Tensor, n_nodes: int):
    """``(ptr (N+1,), perm (E,))``: the edges grouped by ``index`` (src or dst), as a
    stable sort's permutation and its CSR pointer. Indices are clamped to [0, N), so
    every edge lies in one segment even where they were not validated (a wrong
    result, never an unset row)."""
    order = torch.sort(index.clamp(0, max(n_nodes - 1, 0)), stable=True)
    nodes = torch.arange(n_nodes + 1, device=index.device)
    return torch.searchsorted(order.values, nodes), order.indices


@dataclass(frozen=True)
class Graph:
    """One step's graph: dst-sorted edges, integer shifts, CSR pointer and the cell.

    ``padded=True`` marks a graph stored up to an edge capacity (chapter 4's
    :class:`~ecekern.graph_step.GraphStep`): its *padding edges* run from an atom to
    itself with a zero shift, a vector of length zero that no real edge has (the
    neighbour list refuses atoms closer than :data:`MIN_DISTANCE`). The model moves
    them beyond the cutoff, where the envelope and its derivative are exactly zero,
    so they add exactly zero to the energy, the forces and the stress.

    ``cutoff`` (Angstrom, keyword-only and required) is the radius the neighbour list
    was searched with: :func:`build_graph` sets it, ``with_cell``,
    ``dataclasses.replace`` and :class:`~ecekern.graph_step.GraphStep` carry it, and
    the model refuses a graph whose cutoff is not its ``config.cutoff`` (the
    neighbours it needs would be missing, or extra). A Graph made by hand states it:
    ``Graph(src, dst, shifts, row_ptr, cell, cutoff=5.0)``.
    A batch of B systems (``ecekern.train.batch_graphs``) has ``cell (B, 3, 3)`` and
    ``system (E,)`` int64, each edge's system.
    """

    src: torch.Tensor  # (E,) int64
    dst: torch.Tensor  # (E,) int64, sorted ascending
    shifts: torch.Tensor  # (E, 3) int64, in cell vectors
    row_ptr: torch.Tensor  # (N+1,) int64
    cell: torch.Tensor  # (3, 3) float
    padded: bool = False
    cutoff: float = field(kw_only=True)  # Angstrom, the neighbour search's radius
    system: torch.Tensor | None = field(default=None, kw_only=True)  # (E,), a batch
    #: whether the values were checked (:func:`check_graph`); ``build_graph``'s are,
    #: a Graph made by hand or by ``dataclasses.replace`` is checked at first use
    checked: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self):
        c = self.cutoff
        if isinstance(c, bool) or not isinstance(c, (int, float, np.number)):
            raise TypeError(
                f"Graph.cutoff must be the neighbour search's radius in Angstrom (a "
                f"number), got {c!r}; build_graph sets it"
            )
        if not (math.isfinite(c) and c >= MIN_DISTANCE):
            raise ValueError(
                f"Graph.cutoff must be a finite number >= MIN_DISTANCE = "
                f"{MIN_DISTANCE} A, got {c!r}"
            )
        object.__setattr__(self, "cutoff", float(c))

    def check_cutoff(self, cutoff: float) -> None:
        """A ValueError unless ``self.cutoff`` is ``cutoff`` (a model's
        ``config.cutoff``) to a relative 1e-9: a graph searched at another radius
        lacks neighbours the model sees, or holds ones it does not."""
        if not math.isclose(self.cutoff, cutoff, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(
                f"the graph was built with cutoff {self.cutoff:g} A but the model's "
                f"cutoff is {cutoff:g} A; build it with build_graph(..., "
                "cutoff=model.config.cutoff)"
            )

    @property
    def n_edges(self) -> int:
        return int(self.src.shape[0])

    @property
    def n_nodes(self) -> int:
        return int(self.row_ptr.shape[0]) - 1


def with_cell(graph: Graph, cell: torch.Tensor) -> Graph:
    """The same graph with another cell (a strained one: the integer shifts stay);
    a checked graph stays checked."""
    new = Graph(graph.src, graph.dst, graph.shifts, graph.row_ptr, cell, graph.padded,
                cutoff=graph.cutoff, system=graph.system)  # fmt: skip
    object.__setattr__(new, "checked", graph.checked)
    return new


def check_graph(graph: Graph) -> Graph:
    """Check a graph's values once: ``dst`` sorted with ``row_ptr`` its CSR pointer,
    ``src`` and ``dst`` in ``[0, N)``, ``shifts (E, 3)`` int64. A ValueError names
    what is wrong. The reads are host synchronisations, so they run once per Graph
    object (it is marked ``checked``), and never for :func:`build_graph`'s, which
    are correct by construction. Returns the graph."""
    if graph.checked:
        return graph
    from .reference import check_csr

    E, N = graph.n_edges, graph.n_nodes
    for name in ("src", "shifts"):
        t = getattr(graph, name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            raise TypeError(f"graph.{name} must be an int64 tensor")
    if graph.src.shape != (E,) or graph.shifts.shape != (E, 3):
        raise ValueError(
            f"graph.src must be ({E},) and graph.shifts ({E}, 3), got "
            f"{tuple(graph.src.shape)} and {tuple(graph.shifts.shape)}"
        )
    check_csr(graph.dst, graph.row_ptr, E, graph.dst.device)
    if E and (bool(graph.src.min() < 0) or bool(graph.src.max() >= N)):
        raise ValueError(f"graph.src must hold atom indices in [0, {N})")
    s, cell, B = graph.system, graph.cell, len(graph.cell)
    if not (cell.shape == (3, 3) if s is None else cell.shape == (B, 3, 3)
            and s.dtype == torch.int64 and s.shape == (E,)
            and not (E and bool((s.min() < 0) | (s.max() >= B)))):  # fmt: skip
        raise ValueError("graph.cell must be (3, 3), or (B, 3, 3) with graph.system "
                         "(E,) int64 in [0, B) for a batch")  # fmt: skip
    object.__setattr__(graph, "checked", True)
    return graph


def build_graph(
    positions, cell, pbc, cutoff: float, max_edges: int | None = None
) -> Graph:
    """:func:`neighbor_list` plus the CSR pointer, as a :class:`Graph`.

    The checks of :func:`neighbor_list` run here, once per graph, not in the model's
    forward: among them, two atoms closer than :data:`MIN_DISTANCE` (or an atom and
    another's periodic image) are a ValueError naming both atoms. The graph records
    ``cutoff`` (``Graph.cutoff``), which a model checks against its own.
    """
    positions, cell, pbc, cutoff = _check_system(positions, cell, pbc, cutoff)
    max_edges = _check_max_edges(max_edges)
    src, dst, shifts = _neighbor_list(positions, cell, pbc, cutoff, max_edges)
    row_ptr = csr_row_ptr(dst, positions.shape[0])
    graph = Graph(src, dst, shifts, row_ptr, cell, cutoff=cutoff)
    object.__setattr__(graph, "checked", True)  # correct by construction
    return graph


def edge_vectors(
    positions: torch.Tensor, graph: Graph, pad_length: float | None = None
) -> torch.Tensor:
    """``r_e = x_src + shift @ cell - x_dst``, ``(E, 3)``, differentiable in x.

    For a ``padded`` graph, give ``pad_length`` (beyond the cutoff): padding edges
    (``src == dst``, zero shift) get the constant vector ``(pad_length, 0, 0)``, whose
    gradient is zero. The test is elementwise on the device, with no host sync.
    """
    # shift @ cell as elementwise products: a matmul could be rounded to TF32 when a
    # user allows it for float32 (an error of 1e-3 A at a 3.6 A cell vector)
    shifts = graph.shifts.to(positions.dtype)
    cell = graph.cell.to(positions.dtype)
    cell = cell if graph.system is None else cell[graph.system]  # (E, 3, 3): a batch
    offset = (shifts[:, :, None] * cell).sum(1)
    r = positions[graph.src] + offset - positions[graph.dst]
    if not graph.padded:
        return r
    if pad_length is None:
        raise ValueError("a padded graph needs pad_length (beyond the cutoff)")
    pad = (graph.src == graph.dst) & (graph.shifts == 0).all(-1)
    far = torch.nn.functional.pad(r.new_full((1,), pad_length), (0, 2))  # no copy
    return torch.where(pad[:, None], far, r)
