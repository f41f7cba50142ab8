"""Physics checks of a potential, for any ASE calculator (the trained model's
:class:`~ecekern.calculator.ECECalculator` and the GFN1-xTB it learnt from alike).

* :func:`equation_of_state`: energies of a crystal scaled isotropically, fitted by
  ASE's Birch-Murnaghan form: the equilibrium volume, lattice constant and bulk
  modulus;
* :func:`gamma_frequencies`: the harmonic frequencies at the supercell's Gamma point
  (for a supercell of the primitive cell: the crystal's phonons at every q-point the
  supercell folds onto Gamma) from central differences of the forces, each atom
  moved along x, y and z;
* :func:`rdf`: the radial distribution function g(r) of periodic frames;
* :func:`nve_energy_error`: velocity Verlet at several time steps from the same
  start: the total energy's RMS deviation and drift, which for a smooth potential
  scale as dt^2.

``python -m ecekern.train.checks OUT.json [--quick]`` writes GFN1-xTB's side of the
training appendix's checks (tblite, on the CPU, minutes; shipped as
``ecekern/data/carbon_gfn1_checks.json``): diamond's equation of state (the 64-atom
cubic cell) and its Gamma-point frequencies at xTB's lattice constant (that 2 x 2 x 2
supercell: the crystal's phonons at Gamma, X and L), with provenance. The trained
model's side, with the NVE check, is the capture
``python -m ecekern.captures A_train --parts checks=CHECKPOINT``.

Status: CPU and CUDA (the calculator's device); numpy results.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "diamond_checks",
    "equation_of_state",
    "gamma_frequencies",
    "nve_energy_error",
    "rdf",
    "verlet_energies",
]

#: sqrt(eV / (A^2 amu)) in THz: the unit of a frequency from a Hessian in eV/A^2
#: and masses in amu, divided by 2 pi.
_THZ = 15.633302


#: The default linear strains of :func:`equation_of_state`.
STRAINS = tuple(np.linspace(-0.03, 0.03, 7))


def equation_of_state(calc, atoms, strains=STRAINS) -> dict:
    """Energies of ``atoms`` with the cell and positions scaled by ``1 + s`` for
    each linear strain ``s``; the Birch-Murnaghan fit's ``v0`` (A^3 per atom),
    ``e0`` (eV per atom), ``B`` (GPa) and the lattice scale ``a0 / a`` of the
    input cell, with the points (``volumes``, ``energies``, per atom). Where the
    energies have no minimum the fit can find (an untrained model), those four
    are None and ``error`` says why."""
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
    out = {"volumes": list(map(float, vols)), "energies": list(map(float, ens))}
    try:
        v0, e0, B = EquationOfState(vols, ens, eos="birchmurnaghan").fit()
    except (RuntimeError, ValueError) as err:  # no minimum near the input cell
        return {"v0": None, "e0": None, "B_GPa": None, "scale": None,
                "error": f"no Birch-Murnaghan fit: {err}", **out}  # fmt: skip
    scale = float((v0 * n / atoms.get_volume()) ** (1 / 3))
    return {"v0": float(v0), "e0": float(e0), "B_GPa": float(B / GPa),
            "scale": scale, **out}  # fmt: skip


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


def verlet_energies(atoms, dt_fs: float, steps: int) -> tuple:
    """``steps`` of velocity Verlet at ``dt_fs`` from ``atoms`` (its calculator and
    momenta set): the times (ps) and the total energy per atom minus the start's
    (eV), after each step."""
    from ase import units
    from ase.md.verlet import VelocityVerlet

    e0, t, es = atoms.get_total_energy(), [], []
    dyn = VelocityVerlet(atoms, timestep=dt_fs * units.fs)

    def log():
        t.append(dyn.get_number_of_steps() * dt_fs * 1e-3)
        es.append(atoms.get_total_energy())

    dyn.attach(log)
    dyn.run(steps)
    return np.asarray(t), (np.asarray(es) - e0) / len(atoms)


def nve_energy_error(calc, atoms, dts_fs=(0.25, 0.5, 1.0), length_fs: float = 100.0,
                     temperature_K: float = 300.0, seed: int = 0) -> list:  # fmt: skip
    """Velocity Verlet for ``length_fs`` at each time step of ``dts_fs`` (fs), from
    ``atoms`` with Maxwell-Boltzmann velocities at ``temperature_K`` (fixed
    ``seed``, zero total momentum): per time step, the total energy's RMS
    deviation from its start (``rms_meV_atom``), its largest (``max_meV_atom``)
    and its drift (a linear fit, ``drift_meV_atom_ps``), per atom. Verlet's
    shadow energy makes the deviation scale as dt^2 for a smooth potential; a kink
    (a force discontinuity at the cutoff) shows as a slower, noisy scaling. A run
    in which atoms meet (a potential without repulsion) is a row with ``error``."""
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    start = atoms.copy()
    MaxwellBoltzmannDistribution(start, temperature_K=temperature_K,
                                 rng=np.random.default_rng(seed))  # fmt: skip
    Stationary(start)
    out = []
    for dt in dts_fs:
        a = start.copy()
        a.set_velocities(start.get_velocities())
        a.calc = calc
        row = {"dt_fs": float(dt), "steps": round(length_fs / dt)}
        try:
            t, de = verlet_energies(a, dt, row["steps"])
        except ValueError as err:  # atoms met (the neighbour list refuses them)
            out.append({**row, "error": str(err)})
            continue
        out.append({**row, "rms_meV_atom": 1e3 * float(np.sqrt(np.mean(de**2))),
                    "max_meV_atom": 1e3 * float(np.abs(de).max()),
                    "drift_meV_atom_ps": 1e3 * float(
                        np.polyfit(t, de, 1)[0])})  # fmt: skip
    return out


def diamond_checks(calc, repeats: int = 2, a: float = 3.567, nve: bool = False) -> dict:
    """Diamond's equation of state (the cubic cell repeated ``repeats`` times) and
    its Gamma-point frequencies (THz) at the fitted lattice constant ``a0`` (at
    ``a`` where the fit failed); with ``nve``, :func:`nve_energy_error` there."""
    from ase.build import bulk

    eos = equation_of_state(calc, bulk("C", "diamond", a=a, cubic=True).repeat(repeats))
    a0 = a * eos["scale"] if eos["scale"] else a
    cell = bulk("C", "diamond", a=a0, cubic=True).repeat(repeats)
    out = {"eos": eos, "a0": a0, "n_atoms": len(cell),
           "gamma_THz": [float(f) for f in gamma_frequencies(calc, cell)]}  # fmt: skip
    if nve:
        out["nve"] = nve_energy_error(calc, cell)
    return out


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
    print(f"a0 {out['a0']:.4f} A, B {out['eos']['B_GPa']} GPa")
