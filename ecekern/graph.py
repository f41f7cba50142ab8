"""The graph: periodic neighbour list, dst-sorted edges and the CSR row pointer.

An edge ``e`` is ``j -> i`` with ``src_e = j``, ``dst_e = i`` and integer cell shift
``shift_e`` (in cell vectors); its vector is ``r_e = x_j + shift_e @ cell - x_i``
(the ``ijS`` convention of ASE and vesin). Edges are sorted by ``(dst, src, shift)``
so the order is deterministic, and ``row_ptr (N+1,)`` delimits each destination's
segment: the edges into atom ``n`` are ``row_ptr[n]:row_ptr[n+1]``.

The neighbour search is the field's own library, vesin (``vesin_torch``: CPU and
CUDA tensors). It is right for any cell, including cells shorter than twice the
cutoff (several images of one atom), skewed cells and non-periodic directions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Graph", "build_graph", "csr_row_ptr", "edge_vectors", "neighbor_list"]


def _as_tensor(name, x, dtype=None, device=None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x if dtype is None else x.to(dtype)
    if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)):
        return torch.as_tensor(np.asarray(x), dtype=dtype, device=device)
    raise TypeError(
        f"{name} must be a torch.Tensor or array-like, got {type(x).__name__}"
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
    if isinstance(pbc, (bool, np.bool_)):
        pbc = [bool(pbc)] * 3
    pbc = [
        bool(p)
        for p in (pbc.tolist() if isinstance(pbc, torch.Tensor | np.ndarray) else pbc)
    ]
    if len(pbc) != 3:
        raise ValueError(f"pbc must be a bool or three bools, got {pbc!r}")
    cutoff = float(cutoff)
    if not (cutoff > 0 and np.isfinite(cutoff)):
        raise ValueError(f"cutoff must be a positive finite number, got {cutoff!r}")
    if not bool(torch.isfinite(positions).all()):
        raise ValueError("positions contain NaN or infinity")
    for k in range(3):
        if pbc[k] and float(torch.linalg.vector_norm(cell[k])) == 0.0:
            raise ValueError(f"direction {k} is periodic but cell vector {k} is zero")
    if any(pbc) and abs(float(torch.linalg.det(cell.double()))) < 1e-12:
        # vesin needs an invertible box when any direction is periodic
        raise ValueError(
            "cell is singular; give non-zero cell vectors for every direction"
        )
    return positions, cell, pbc, cutoff


def neighbor_list(positions, cell, pbc, cutoff: float):
    """All directed pairs closer than ``cutoff``, sorted by destination.

    Args:
        positions: ``(N, 3)`` float tensor or array (Angstrom).
        cell: ``(3, 3)`` cell vectors as rows (ignored in non-periodic directions).
        pbc: one bool, or three (one per cell vector).
        cutoff: radius in Angstrom.

    Returns:
        ``(src, dst, shifts)``: ``(E,)``, ``(E,)`` int64 and ``(E, 3)`` int64 integer
        cell shifts, on ``positions``' device, sorted by ``(dst, src, shift)``; the edge
        vector is ``positions[src] + shifts @ cell - positions[dst]``. Self pairs appear
        only through a non-zero shift (an atom and its own periodic image).
    """
    from vesin_torch import NeighborList

    positions, cell, pbc, cutoff = _check_system(positions, cell, pbc, cutoff)
    device = positions.device
    n = positions.shape[0]
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty.clone(), torch.zeros(0, 3, dtype=torch.long, device=device)
    box = (
        cell.detach().double()
        if any(pbc)
        else torch.zeros_like(cell, dtype=torch.float64)
    )
    nl = NeighborList(cutoff=cutoff, full_list=True)
    i, j, S = nl.compute(
        positions.detach().double(),
        box,
        torch.tensor(pbc, device=device),
        quantities="ijS",
    )
    dst, src, shifts = i.long(), j.long(), S.long()
    # deterministic order: stable sorts from the least to the most significant key
    order = torch.arange(dst.shape[0], device=device)
    for key in (shifts[:, 2], shifts[:, 1], shifts[:, 0], src, dst):
        order = order[torch.sort(key[order], stable=True).indices]
    return src[order], dst[order], shifts[order]


def csr_row_ptr(dst: torch.Tensor, n_nodes: int) -> torch.Tensor:
    """``row_ptr (N+1,)`` int64 for ``dst`` sorted ascending: edges into n are
    ``row_ptr[n]:row_ptr[n+1]``."""
    counts = torch.bincount(dst, minlength=n_nodes)
    row_ptr = torch.zeros(n_nodes + 1, dtype=torch.long, device=dst.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    return row_ptr


@dataclass(frozen=True)
class Graph:
    """One step's graph: dst-sorted edges, integer shifts, CSR pointer and the cell."""

    src: torch.Tensor  # (E,) int64
    dst: torch.Tensor  # (E,) int64, sorted ascending
    shifts: torch.Tensor  # (E, 3) int64, in cell vectors
    row_ptr: torch.Tensor  # (N+1,) int64
    cell: torch.Tensor  # (3, 3) float

    @property
    def n_edges(self) -> int:
        return int(self.src.shape[0])

    @property
    def n_nodes(self) -> int:
        return int(self.row_ptr.shape[0]) - 1


def build_graph(positions, cell, pbc, cutoff: float) -> Graph:
    """:func:`neighbor_list` plus the CSR pointer, as a :class:`Graph`."""
    positions, cell, pbc, cutoff = _check_system(positions, cell, pbc, cutoff)
    src, dst, shifts = neighbor_list(positions, cell, pbc, cutoff)
    return Graph(src, dst, shifts, csr_row_ptr(dst, positions.shape[0]), cell)


def edge_vectors(positions: torch.Tensor, graph: Graph) -> torch.Tensor:
    """``r_e = x_src + shift @ cell - x_dst``, ``(E, 3)``, differentiable in x."""
    offset = graph.shifts.to(positions.dtype) @ graph.cell.to(positions.dtype)
    return positions[graph.src] + offset - positions[graph.dst]
