"""Physics checks of a potential, for any ASE calculator (the trained model's
:class:`~ecekern.calculator.ECECalculator` and the GFN1-xTB it learnt from alike).

* :func:`equation_of_state`: energies of a crystal scaled isotropically, fitted by
  ASE's Birch-Murnaghan form: the equilibrium volume, lattice constant and bulk
  modulus;
* :func:`gamma_frequencies`: the harmonic frequencies at the supercell's Gamma point
  (for a supercell of the primitive cell: the crystal's phonons at every q-point the
  supercell folds onto Gamma) from central differences of the forces, each atom
  moved along x, y and z;
* :func:`rdf`: the radial distribution function g(r) of periodic frames.

``python -m ecekern.train.checks OUT.json [--quick]`` writes GFN1-xTB's side of the
training appendix's checks (tblite, on the CPU, minutes; shipped as
``ecekern/data/carbon_gfn1_checks.json``): diamond's equation of state (the 64-atom
cubic cell) and its Gamma-point frequencies at xTB's lattice constant (that 2 x 2 x 2
supercell: the crystal's phonons at Gamma, X and L), with provenance.

Status: CPU and CUDA (the calculator's device); numpy results.
"""

from __future__ import annotations

import numpy as np

__all__ = ["diamond_checks", "equation_of_state", "gamma_frequencies", "rdf"]

#: sqrt(eV / (A^2 amu)) in THz: the unit of a frequency from a Hessian in eV/A^2
#: and masses in amu, divided by 2 pi.
_THZ = 15.633302


#: The default linear strains of :func:`equation_of_state`.
STRAINS = tuple(np.linspace(-0.03, 0.03, 7))


def equation_of_state(calc, atoms, strains=STRAINS) -> dict:
    """Energies of ``atoms`` with the cell and positions scaled by ``1 + s`` for
    each linear strain ``s``; the Birch-Murnaghan fit's ``v0`` (A^3 per atom),
    ``e0`` (eV per atom), ``B`` (GPa) and the lattice scale ``a0 / a`` of the
    input cell, with the points (``volumes``, ``energies``, per atom)."""
    from ase.eos import EquationOfState
    from ase.units import GPa

    n = len(atoms)
    vols, ens = [], []
    for s in strains:
        a = atoms.copy()
        a.set_cell(atoms.cell * (1 + s), scale_atoms=True)
        a.calc = calc
        vols.append(a.get_volume() / n)
        ens.append(a.get_potential_energy() / n)
    v0, e0, B = EquationOfState(vols, ens, eos="birchmurnaghan").fit()
    return {"v0": float(v0), "e0": float(e0), "B_GPa": float(B / GPa),
            "scale": float((v0 * n / atoms.get_volume()) ** (1 / 3)),
            "volumes": list(map(float, vols)),
            "energies": list(map(float, ens))}  # fmt: skip


def gamma_frequencies(calc, atoms, delta: float = 0.01) -> np.ndarray:
    """The 3N harmonic frequencies (THz, ascending; imaginary ones negative) of
    ``atoms`` at its own positions, from the Hessian ``-dF/dx`` by central
    differences of step ``delta`` A, symmetrised and mass-weighted."""
    a = atoms.copy()
    a.calc = calc
    x0 = a.get_positions()
    n = len(a)
    H = np.zeros((3 * n, 3 * n))
    for i in range(n):
        for k in range(3):
            f = []
            for sign in (1, -1):
                x = x0.copy()
                x[i, k] += sign * delta
                a.set_positions(x)
                f.append(a.get_forces().reshape(-1))
            H[3 * i + k] = -(f[0] - f[1]) / (2 * delta)
    a.set_positions(x0)
    H = 0.5 * (H + H.T)
    m = np.repeat(a.get_masses(), 3)
    w2 = np.linalg.eigvalsh(H / np.sqrt(m[:, None] * m[None, :]))
    return np.sign(w2) * np.sqrt(np.abs(w2)) * _THZ


def rdf(frames, r_max: float = 5.0, n_bins: int = 100) -> tuple:
    """``(r, g)``: the radial distribution function of the periodic ``frames``
    (ase.Atoms, one element), averaged over them; ``r`` the bins' centres (A)."""
    from ase.neighborlist import neighbor_list

    edges = np.linspace(0.0, r_max, n_bins + 1)
    hist = np.zeros(n_bins)
    norm = 0.0
    for a in frames:
        d = neighbor_list("d", a, r_max)
        hist += np.histogram(d, edges)[0]
        norm += len(a) * len(a) / a.get_volume()
    shell = 4.0 / 3.0 * np.pi * (edges[1:] ** 3 - edges[:-1] ** 3)
    return 0.5 * (edges[1:] + edges[:-1]), hist / (shell * norm)


def diamond_checks(calc, repeats: int = 2, a: float = 3.567) -> dict:
    """Diamond's equation of state (the cubic cell repeated ``repeats`` times) and
    its Gamma-point frequencies (THz) at the fitted lattice constant ``a0``."""
    from ase.build import bulk

    eos = equation_of_state(calc, bulk("C", "diamond", a=a, cubic=True).repeat(repeats))
    a0 = a * eos["scale"]
    cell = bulk("C", "diamond", a=a0, cubic=True).repeat(repeats)
    freqs = gamma_frequencies(calc, cell)
    return {"eos": eos, "a0": a0, "n_atoms": len(cell),
            "gamma_THz": [float(f) for f in freqs]}  # fmt: skip


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m ecekern.train.checks OUT.json [--quick]")
    from tblite.ase import TBLite

    from ..bench import provenance

    out = diamond_checks(TBLite(method="GFN1-xTB", verbosity=0),
                         1 if "--quick" in sys.argv else 2)  # fmt: skip
    out["calculator"] = "tblite.ase.TBLite(method='GFN1-xTB')"
    out["provenance"] = {k: str(v) for k, v in provenance().items()}
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"a0 {out['a0']:.4f} A, B {out['eos']['B_GPa']:.0f} GPa")
