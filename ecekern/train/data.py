"""Labelled structures and batches for training: :class:`Sample`, :func:`read`,
:func:`batch_graphs`, :class:`Batch` and the per-species reference energies.

A sample is one labelled structure (positions, numbers, cell, pbc; energy, forces and,
where the data has it, stress). Its neighbour list is built once, on the CPU, and kept.
A batch of B samples is one graph of B disjoint systems: the atoms concatenated,
each edge's indices offset by its system's first atom, ``cell (B, 3, 3)`` and
``system (E,)`` naming each edge's cell (:class:`~ecekern.graph.Graph`). The model's
energies per atom are summed per system; forces and the strain derivative per system
come from one backward.

Reference energies. The total energies of a DFT or xTB code are dominated by the free
atoms' energies (GFN1-xTB: about -58 eV per carbon atom). :func:`fit_reference_energies`
solves ``E_s ~ sum_Z n_sZ e_Z`` by least squares over the training set; the model's
``species_energy`` starts there, and the network learns the rest (a few eV per atom).

Status: CPU and CUDA; a batch is assembled on the host and moved once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..graph import Graph, build_graph, csr_row_ptr

__all__ = [
    "Batch",
    "Sample",
    "batch_graphs",
    "collate",
    "fit_reference_energies",
    "from_atoms",
    "read",
]

#: ASE's Voigt order of a stress vector: xx, yy, zz, yz, xz, xy.
_VOIGT = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))


@dataclass
class Sample:
    """One labelled structure (float64 on the CPU).

    ``positions (N, 3)`` A, ``numbers (N,)``, ``cell (3, 3)`` rows, ``pbc`` three
    bools, ``energy`` eV, ``forces (N, 3)`` eV/A, ``stress (3, 3)`` eV/A^3 (ASE's
    sign: ``dE/d eps / V``) or None, ``family`` and ``split`` from ``atoms.info``
    (``""`` where absent).
    """

    positions: torch.Tensor
    numbers: torch.Tensor
    cell: torch.Tensor
    pbc: tuple
    energy: float
    forces: torch.Tensor
    stress: torch.Tensor | None = None
    family: str = ""
    split: str = ""
    graph: Graph | None = field(default=None, repr=False)

    @property
    def n_atoms(self) -> int:
        return int(self.numbers.shape[0])

    def graph_at(self, cutoff: float) -> Graph:
        """The neighbour list at ``cutoff`` (built on first use, then kept)."""
        if self.graph is None or self.graph.cutoff != cutoff:
            self.graph = build_graph(self.positions, self.cell, list(self.pbc), cutoff)
        return self.graph


def from_atoms(atoms) -> Sample:
    """A :class:`Sample` of an ``ase.Atoms`` with a calculator's (or a file's)
    energy and forces; stress where it has one and the cell is periodic in all
    three directions. A ValueError names what is missing."""
    calc = atoms.calc
    results = getattr(calc, "results", {}) if calc is not None else {}
    for key in ("energy", "forces"):
        if key not in results:
            raise ValueError(
                f"structure {atoms.get_chemical_formula()} has no {key!r} label: a "
                "training structure needs energy and forces (extxyz with "
                "energy= and forces, or any ASE-readable file with results)"
            )
    stress = None
    if "stress" in results and all(atoms.pbc):
        s = np.asarray(results["stress"], dtype=np.float64)
        if s.shape == (6,):
            full = np.zeros((3, 3))
            for v, (i, j) in zip(s, _VOIGT):
                full[i, j] = full[j, i] = v
            s = full
        stress = torch.as_tensor(s.reshape(3, 3), dtype=torch.float64)
    energy = float(results["energy"])
    forces = torch.as_tensor(np.asarray(results["forces"]), dtype=torch.float64)
    if not math.isfinite(energy) or not torch.isfinite(forces).all():
        raise ValueError(f"structure {atoms.get_chemical_formula()}: non-finite label")
    return Sample(
        positions=torch.as_tensor(atoms.get_positions(), dtype=torch.float64),
        numbers=torch.as_tensor(atoms.get_atomic_numbers(), dtype=torch.long),
        cell=torch.as_tensor(atoms.cell.array, dtype=torch.float64),
        pbc=tuple(bool(p) for p in atoms.pbc),
        energy=energy,
        forces=forces,
        stress=stress,
        family=str(atoms.info.get("family", "")),
        split=str(atoms.info.get("split", "")),
    )


def _read_atoms(path, index) -> list:
    """ASE's read of ``path``; a ``.xz``, ``.gz`` or ``.bz2`` file is decompressed
    whole first (ASE's extxyz reader seeks, and every seek in a compressed stream
    decompresses it again from the start: minutes for the shipped carbon set)."""
    import bz2
    import gzip
    import io
    import lzma
    from pathlib import Path

    from ase.io import read as ase_read
    from ase.io.formats import filetype

    p = Path(path)
    opener = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}.get(p.suffix)
    if opener is None:
        return ase_read(str(p), index=index)
    with opener(p, "rt") as fh:
        text = io.StringIO(fh.read())
    return ase_read(text, index=index, format=filetype(str(p.with_suffix("")), False))


def read(paths, index=":") -> list[Sample]:
    """Every structure of the ASE-readable file(s) ``paths`` (extxyz, compressed
    ones included: ``.xz``, ``.gz`` and ``.bz2``, decompressed in memory), as
    samples."""
    if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__"):
        paths = [paths]
    samples = []
    for path in paths:
        samples += [from_atoms(a) for a in _read_atoms(path, index)]
    if not samples:
        raise ValueError(f"no structures in {[str(p) for p in paths]}")
    return samples


def fit_reference_energies(samples: list[Sample], species) -> torch.Tensor:
    """``e (len(species),)``, eV per atom of each species: the least-squares fit of
    ``E_s = sum_Z n_sZ e_Z`` over ``samples`` (minimum-norm where a species is
    absent or the counts are collinear, e.g. one element only: then ``e`` is the
    mean energy per atom)."""
    col = {int(z): i for i, z in enumerate(species)}
    A = np.zeros((len(samples), len(species)))
    for r, s in enumerate(samples):
        for z, n in zip(*np.unique(s.numbers.numpy(), return_counts=True)):
            if int(z) not in col:
                raise ValueError(f"element {int(z)} is not among the model's {species}")
            A[r, col[int(z)]] = n
    y = np.array([s.energy for s in samples])
    e, *_ = np.linalg.lstsq(A, y, rcond=None)
    return torch.as_tensor(e)


def batch_graphs(graphs: list[Graph], n_atoms: list[int]) -> Graph:
    """One graph of the disjoint systems ``graphs`` (``n_atoms`` each): indices
    offset, the dst order kept (each system's block after the previous one),
    ``cell (B, 3, 3)`` and ``system (E,)``. All at one cutoff, none padded."""
    if not graphs or len(graphs) != len(n_atoms):
        raise ValueError("batch_graphs needs one atom count per graph, and a graph")
    cutoff = graphs[0].cutoff
    if any(g.padded or g.system is not None or g.cutoff != cutoff for g in graphs):
        raise ValueError("batch_graphs takes unpadded single-system graphs of one "
                         "cutoff")  # fmt: skip
    dev = graphs[0].src.device
    start = torch.tensor([0, *np.cumsum(n_atoms)[:-1].tolist()], dtype=torch.long)
    E = torch.tensor([g.n_edges for g in graphs])
    shift = torch.repeat_interleave(start.to(dev), E.to(dev))
    src = torch.cat([g.src for g in graphs]) + shift
    dst = torch.cat([g.dst for g in graphs]) + shift
    system = torch.repeat_interleave(torch.arange(len(graphs), device=dev), E.to(dev))
    graph = Graph(src, dst, torch.cat([g.shifts for g in graphs]),
                  csr_row_ptr(dst, int(sum(n_atoms))),
                  torch.stack([g.cell for g in graphs]), cutoff=cutoff,
                  system=system)  # fmt: skip
    object.__setattr__(graph, "checked", all(g.checked for g in graphs))
    return graph


@dataclass
class Batch:
    """B samples as one system of disjoint parts, on one device and dtype.

    ``positions (N, 3)``, ``numbers (N,)``, ``graph`` (:func:`batch_graphs`),
    ``atom_system (N,)``, ``n_atoms (B,)``; targets ``energy (B,)``, ``forces (N, 3)``,
    ``stress (B, 3, 3)`` with ``has_stress (B,)`` (zeros where a sample has none),
    ``volume (B,)``; ``families``: each sample's family.
    """

    positions: torch.Tensor
    numbers: torch.Tensor
    graph: Graph
    atom_system: torch.Tensor
    n_atoms: torch.Tensor
    energy: torch.Tensor
    forces: torch.Tensor
    stress: torch.Tensor
    has_stress: torch.Tensor
    volume: torch.Tensor
    families: list

    @property
    def n_systems(self) -> int:
        return int(self.n_atoms.shape[0])


def collate(samples: list[Sample], cutoff: float, dtype=torch.float32,
            device="cpu") -> Batch:  # fmt: skip
    """The :class:`Batch` of ``samples`` (their graphs at ``cutoff``, kept on the
    samples), moved to ``device`` in ``dtype``."""
    counts = [s.n_atoms for s in samples]
    graph = batch_graphs([s.graph_at(cutoff) for s in samples], counts)
    n = torch.tensor(counts)
    zero = torch.zeros(3, 3, dtype=torch.float64)

    def to(t, float_=True):
        return t.to(device=device, dtype=dtype if float_ else t.dtype)

    fields = {k: getattr(graph, k) for k in ("src", "dst", "shifts", "row_ptr")}
    g = Graph(**{k: to(v, False) for k, v in fields.items()}, cell=to(graph.cell),
              cutoff=cutoff, system=to(graph.system, False))  # fmt: skip
    object.__setattr__(g, "checked", graph.checked)
    cells = torch.stack([s.cell for s in samples])
    return Batch(
        positions=to(torch.cat([s.positions for s in samples])),
        numbers=to(torch.cat([s.numbers for s in samples]), False),
        graph=g,
        atom_system=to(torch.repeat_interleave(torch.arange(len(samples)), n), False),
        n_atoms=to(n, False),
        energy=to(torch.tensor([s.energy for s in samples], dtype=torch.float64)),
        forces=to(torch.cat([s.forces for s in samples])),
        stress=to(
            torch.stack([zero if s.stress is None else s.stress for s in samples])
        ),  # fmt: skip
        has_stress=to(torch.tensor([s.stress is not None for s in samples]), False),
        volume=to(torch.linalg.det(cells).abs()),
        families=[s.family for s in samples],
    )
