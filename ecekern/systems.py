"""Standard atomic systems: rattled diamond-carbon boxes (seeded)."""

from __future__ import annotations

import numpy as np

__all__ = ["DIAMOND_A", "diamond"]

#: Lattice constant of diamond carbon in Angstrom.
DIAMOND_A = 3.567


def diamond(repeats: int = 4, rattle: float = 0.05, seed: int = 0):
    """A periodic box of ``repeats**3`` conventional diamond cells (8 atoms each).

    ``repeats=4`` gives 512 atoms (about 46k directed edges at 5 A), ``repeats=8``
    gives 4096 atoms (about 365k edges). Every atom is displaced by Gaussian noise
    of standard deviation ``rattle`` Angstrom from a generator seeded by ``seed``, so
    the same arguments give the same positions on every machine.

    Returns:
        ``ase.Atoms`` with ``pbc=True``.
    """
    from ase.build import bulk

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if isinstance(rattle, bool) or not (
        isinstance(rattle, (int, float, np.floating)) and 0 <= rattle < np.inf
    ):
        raise ValueError(f"rattle must be a finite number >= 0 (A), got {rattle!r}")
    atoms = bulk("C", "diamond", a=DIAMOND_A, cubic=True).repeat(repeats)
    rng = np.random.default_rng(seed)
    atoms.positions = atoms.positions + rng.normal(
        scale=rattle, size=atoms.positions.shape
    )
    return atoms
