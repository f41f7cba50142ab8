"""A labelled carbon dataset: periodic structures of 32-64 atoms, GFN1-xTB labels.

Five families cover the bonding a carbon potential must tell apart:

- ``diamond``  sp3: cubic cells repeated to 32 or 64 atoms, isotropic strain -6..+6 %,
  symmetric shears with engineering strain up to 3 %, Gaussian rattles of 0.02-0.15 A.
- ``graphite`` sp2 stacked: AB graphite of 48-64 atoms, in-plane strains +-4 %,
  interlayer distance -10..+15 %, rattles 0.02-0.12 A (dispersion and layer sliding).
- ``graphene`` sp2 sheet: one layer in a cell with >= 10 A of vacuum, strains +-5 %,
  rattles; some with a vacancy (under-coordinated atoms), some buckled by a ripple.
- ``amorphous`` mixed sp2/sp3: random packings at 1.5-3.5 g/cm^3 with no pair closer
  than ``DMIN``, followed by a short Langevin quench at 300 K; frames along it.
- ``liquid`` high temperature: Langevin MD at 3000-6000 K and 1.8-3.2 g/cm^3 from a
  random packing; frames spaced ``LIQUID["every"]`` steps apart after equilibration.

A *parent* is one strained crystal (its rattled copies) or one trajectory (its frames).
Every structure's ``atoms.info`` holds ``family``, ``split``, ``parent`` (its parent's
id) and ``index`` (its position within the parent). Splits are drawn per family over
parents, 80/10/10, so correlated frames never sit in two splits.

Labels come from ``TBLite(method="GFN1-xTB")`` with tblite's defaults (300 K electronic
temperature, accuracy 1, SAD guess), one fresh calculator per structure so that a
relabel reproduces them: energy (eV), forces (eV/A, shape (n, 3)) and stress (eV/A^3,
ASE's Voigt order xx yy zz yz xz xy, positive under tension). tblite samples the
Brillouin zone at the Gamma point only, so cell shapes are chosen where that is close
to converged: ideal diamond differs by 0.05 eV/atom between 32 and 216 atoms, the
graphene cells by 0.03, the graphite cells by 0.06 (see ``graphite``). A structure
whose SCF fails is dropped and counted in the provenance. All randomness comes from
``numpy.random.default_rng([seed, family, parent])``: a rerun, or a run at another
``--scale`` (which multiplies the number of parents), makes the same parents.

Files: ``carbon_gfn1.extxyz.xz`` (ASE extxyz, lzma) and ``carbon_gfn1.json``
(versions, calculator settings, seed, counts, statistics, wall time, command).
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import platform
import sys
import time
from pathlib import Path

import ase
import ase.io
import numpy as np
from ase import Atoms, units
from ase.build import bulk
from ase.calculators.calculator import CalculationFailed
from ase.calculators.singlepoint import SinglePointCalculator
from ase.data import atomic_masses
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import thermalize_momenta
from ase.neighborlist import neighbor_list

FAMILIES = ("diamond", "graphite", "graphene", "amorphous", "liquid")
PARENTS = {"diamond": 100, "graphite": 100, "graphene": 100, "amorphous": 120}
PARENTS["liquid"] = 20
FRAMES = {"diamond": 4, "graphite": 4, "graphene": 4, "amorphous": 3, "liquid": 16}
DMIN = 1.2  # A: no generated pair is closer (MD frames excepted)
SIZES = (32, 40, 48, 64)  # atoms of a random packing, weighted to the cheap ones
SIZE_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
QUENCH = {"temperature_K": 300.0, "timestep_fs": 1.0, "friction_per_fs": 0.05}
QUENCH["every"] = 4
LIQUID = {"timestep_fs": 1.0, "friction_per_fs": 0.02, "equilibrate": 10, "every": 3}
SPLITS = (("train", 0.8), ("val", 0.1), ("test", 0.1))
STEM = "carbon_gfn1"
DEFAULT_PATH = Path(__file__).with_name(f"{STEM}.extxyz.xz")
AMU_PER_A3_IN_G_PER_CM3 = 1.66053906660
A_DIAMOND, A_GRAPHITE, C_GRAPHITE = 3.567, 2.464, 6.711  # A, experimental


def density(atoms: Atoms) -> float:
    """Mass density in g/cm^3: sum(masses) / volume."""
    return atoms.get_masses().sum() / atoms.get_volume() * AMU_PER_A3_IN_G_PER_CM3


def min_distance(atoms: Atoms, cutoff: float = 4.0) -> float:
    """Shortest interatomic distance under the cell's periodicity (inf if > cutoff)."""
    d = neighbor_list("d", atoms, cutoff)
    return float(d.min()) if len(d) else float("inf")


def _rattle(atoms: Atoms, sigma: float, rng: np.random.Generator) -> Atoms:
    """Gaussian displacements of std ``sigma`` per component, redrawn for atoms that
    come closer than ``DMIN`` to another (a truncated Gaussian)."""
    pos0 = atoms.positions.copy()
    disp = rng.normal(0.0, sigma, pos0.shape)
    for _ in range(200):
        atoms.positions = pos0 + disp
        i = neighbor_list("i", atoms, DMIN)
        if len(i) == 0:
            return atoms
        bad = np.unique(i)
        disp[bad] = rng.normal(0.0, sigma, (len(bad), 3))
    raise RuntimeError(f"could not rattle by {sigma} A without pairs below {DMIN} A")


def _strained(atoms: Atoms, strain: np.ndarray) -> Atoms:
    """Deform cell and positions by (1 + strain), strain a symmetric (3, 3) tensor."""
    atoms = atoms.copy()
    atoms.set_cell(atoms.cell[:] @ (np.eye(3) + strain), scale_atoms=True)
    return atoms


def _rattled_series(atoms, rng, family, sigma_range, **info) -> list[Atoms]:
    frames = []
    for _ in range(FRAMES[family]):
        sigma = float(rng.uniform(*sigma_range))
        frame = _rattle(atoms.copy(), sigma, rng)
        frame.info.update(info, rattle=sigma)
        frames.append(frame)
    return frames


def diamond(rng: np.random.Generator) -> list[Atoms]:
    """One strained diamond cell (32 or 64 atoms) and its rattled copies."""
    reps = (2, 2, 1) if rng.random() < 0.5 else (2, 2, 2)
    atoms = bulk("C", "diamond", a=A_DIAMOND, cubic=True).repeat(reps)
    iso = rng.uniform(-0.06, 0.06)
    gamma = rng.uniform(-0.03, 0.03, 3)  # engineering shear strains yz, xz, xy
    strain = iso * np.eye(3)
    for (i, j), g in zip(((1, 2), (0, 2), (0, 1)), gamma):
        strain[i, j] = strain[j, i] = g / 2
    return _rattled_series(_strained(atoms, strain), rng, "diamond", (0.02, 0.15))


def _hexagonal(a: float, c: float, basis: list[tuple[float, float, float]]) -> Atoms:
    cell = [[a, 0, 0], [-a / 2, a * np.sqrt(3) / 2, 0], [0, 0, c]]
    return Atoms(f"C{len(basis)}", scaled_positions=basis, cell=cell, pbc=True)


def graphite(rng: np.random.Generator) -> list[Atoms]:
    """One strained AB-graphite cell (48-64 atoms, one AB pair along c) and its
    rattled copies. In-plane repeats are 3x4, 3x5 or 4x4: at the Gamma point alone
    (tblite's only sampling) a 2x2, 2x4 or 3x3 cell is 0.2-0.75 eV/atom off."""
    basis = [(0, 0, 0.25), (1 / 3, 2 / 3, 0.25), (0, 0, 0.75), (2 / 3, 1 / 3, 0.75)]
    options = ((4, 3, 1), (3, 4, 1), (5, 3, 1), (3, 5, 1), (4, 4, 1))
    reps = options[rng.integers(len(options))]
    atoms = _hexagonal(A_GRAPHITE, C_GRAPHITE, basis).repeat(reps)
    strain = np.diag([*rng.uniform(-0.04, 0.04, 2), rng.uniform(-0.10, 0.15)])
    return _rattled_series(_strained(atoms, strain), rng, "graphite", (0.02, 0.12))


def graphene(rng: np.random.Generator, vacuum: float = 12.0) -> list[Atoms]:
    """One strained graphene sheet (32-64 atoms; some with a vacancy, some rippled)
    in a cell with ``vacuum`` A between periodic images, and its rattled copies."""
    options = ((4, 4), (4, 5), (5, 5), (4, 6), (5, 6), (4, 7), (4, 8))
    n1, n2 = options[rng.integers(len(options))]
    ripple = float(rng.uniform(0.2, 0.8)) if rng.random() < 0.3 else 0.0
    c = vacuum + 2 * ripple
    atoms = _hexagonal(A_GRAPHITE, c, [(0, 0, 0.5), (1 / 3, 2 / 3, 0.5)])
    atoms = atoms.repeat((n1, n2, 1))
    vacancy = len(atoms) > 32 and rng.random() < 0.3
    if vacancy:
        del atoms[int(rng.integers(len(atoms)))]
    if ripple:
        s = atoms.get_scaled_positions()[:, int(rng.integers(2))]
        atoms.positions[:, 2] += ripple * np.sin(2 * np.pi * s)
    strain = np.diag([*rng.uniform(-0.05, 0.05, 2), 0.0])
    info = {"vacancy": bool(vacancy), "ripple": ripple}
    return _rattled_series(
        _strained(atoms, strain), rng, "graphene", (0.02, 0.12), **info
    )


def random_packing(
    n: int, rho: float, rng: np.random.Generator, dmin: float = DMIN
) -> Atoms:
    """``n`` carbon atoms placed one by one, uniformly at random, in a cubic cell of
    density ``rho`` g/cm^3, rejecting a site closer than ``dmin`` to any atom under
    periodic boundaries."""
    if n < 1 or rho <= 0 or dmin < 0:
        raise ValueError(f"need n >= 1, rho > 0, dmin >= 0; got {n}, {rho}, {dmin}")
    mass = atomic_masses[6]
    length = (n * mass * AMU_PER_A3_IN_G_PER_CM3 / rho) ** (1 / 3)
    if length < 2 * dmin:
        raise ValueError(f"cell of {length:.2f} A too small for dmin={dmin} A")
    pos, tries = np.empty((0, 3)), 0
    while len(pos) < n:
        tries += 1
        if tries > 2000 * n:
            raise RuntimeError(f"placed {len(pos)} of {n} atoms at {rho} g/cm^3")
        p = rng.random(3) * length
        d = pos - p
        d -= length * np.round(d / length)
        if len(pos) == 0 or (d * d).sum(1).min() >= dmin**2:
            pos = np.vstack([pos, p])
    atoms = Atoms(f"C{n}", positions=pos, cell=[length] * 3, pbc=True)
    atoms.info["density"] = float(rho)
    return atoms


def make_calculator():
    """The labelling calculator: tblite's GFN1-xTB with its defaults, silent."""
    from tblite.ase import TBLite

    return TBLite(method="GFN1-xTB", verbosity=0)


def _snapshot(atoms: Atoms, **info) -> Atoms:
    """Positions, cell and info only (no momenta, no calculator)."""
    frame = Atoms(atoms.symbols, positions=atoms.positions, cell=atoms.cell, pbc=True)
    frame.info.update(atoms.info, **info)
    return frame


def _md_frames(atoms, rng, temperature, md, n_frames, calc_factory, failures):
    """Langevin MD with the settings ``md`` (``QUENCH`` or ``LIQUID``): ``equilibrate``
    steps, then ``n_frames`` snapshots ``every`` steps apart. An SCF failure ends the
    trajectory, with a line appended to ``failures``."""
    atoms = atoms.copy()
    atoms.calc = calc_factory()
    thermalize_momenta(atoms, temperature, rng=rng)
    dt, friction = md["timestep_fs"] * units.fs, md["friction_per_fs"] / units.fs
    kw = {"temperature_K": temperature, "friction": friction, "fixcm": False}
    dyn = Langevin(atoms, dt, rng=rng, **kw)
    frames = []
    try:
        dyn.run(md.get("equilibrate", 0))
        for k in range(n_frames):
            if k:
                dyn.run(md["every"])
            frames.append(_snapshot(atoms, step=dyn.nsteps))
    except CalculationFailed as err:
        if failures is not None:
            failures.append(f"MD stopped at step {dyn.nsteps}: {err}")
    return frames


def amorphous(rng, n_frames=None, calc_factory=make_calculator, failures=None):
    """A random packing (``SIZES`` atoms, 1.5-3.5 g/cm^3) and a short quench at
    ``QUENCH``: ``n_frames`` (default ``FRAMES["amorphous"]``) frames ``every`` steps
    apart, the first being the packing; ``n_frames=1`` runs no MD (no calculator)."""
    n = int(rng.choice(SIZES, p=SIZE_WEIGHTS))
    atoms = random_packing(n, float(rng.uniform(1.5, 3.5)), rng)
    n_frames = FRAMES["amorphous"] if n_frames is None else n_frames
    if n_frames == 1:
        return [_snapshot(atoms, step=0)]
    temperature = QUENCH["temperature_K"]
    return _md_frames(atoms, rng, temperature, QUENCH, n_frames, calc_factory, failures)


def liquid(rng, n_frames=None, calc_factory=make_calculator, failures=None):
    """A Langevin trajectory (``LIQUID``) at 3000-6000 K and 1.8-3.2 g/cm^3 from a
    random packing: ``n_frames`` (default ``FRAMES["liquid"]``) frames after
    equilibration."""
    n = int(rng.choice(SIZES, p=SIZE_WEIGHTS))
    atoms = random_packing(n, float(rng.uniform(1.8, 3.2)), rng)
    temperature = float(rng.uniform(3000.0, 6000.0))
    atoms.info["temperature_K"] = temperature
    n_frames = FRAMES["liquid"] if n_frames is None else n_frames
    return _md_frames(atoms, rng, temperature, LIQUID, n_frames, calc_factory, failures)


GENERATORS = {"diamond": diamond, "graphite": graphite, "graphene": graphene}
GENERATORS.update(amorphous=amorphous, liquid=liquid)


def label(atoms: Atoms, calc_factory=make_calculator) -> Atoms | None:
    """A copy of ``atoms`` carrying GFN1-xTB energy, forces and stress in a
    ``SinglePointCalculator``, from a fresh calculator; None if the SCF fails or
    gives non-finite values."""
    work = atoms.copy()
    work.calc = calc_factory()
    try:
        energy = work.get_potential_energy()
        forces = work.get_forces()
        stress = work.get_stress()
    except CalculationFailed:
        return None
    if not (np.isfinite(energy) and np.isfinite(forces).all()):
        return None
    if not np.isfinite(stress).all():
        return None
    out = _snapshot(atoms)
    out.calc = SinglePointCalculator(out, energy=energy, forces=forces, stress=stress)
    return out


def assign_splits(n_parents: int, seed: int, family: str) -> list[str]:
    """Split name of each parent: a seeded permutation, the last ``round(0.1 n)``
    parents to test, the ``round(0.1 n)`` before them to val, the rest to train."""
    perm = np.random.default_rng([seed, 1000 + FAMILIES.index(family)]).permutation(
        n_parents
    )
    n_small = int(np.floor(0.1 * n_parents + 0.5))
    names = np.array(["train"] * n_parents, dtype=object)
    names[perm[n_parents - 2 * n_small : n_parents - n_small]] = "val"
    names[perm[n_parents - n_small :]] = "test"
    return [str(s) for s in names]


STAT_KEYS = ("mean", "std", "min", "max")


def _stats(frames: list[Atoms]) -> dict:
    """Energy per atom (eV) and force component (eV/A) statistics of ``frames``."""
    e = np.array([a.get_potential_energy() / len(a) for a in frames])
    f = np.concatenate([a.get_forces().ravel() for a in frames])
    stats = {f"energy_per_atom_{k}": float(getattr(e, k)()) for k in STAT_KEYS}
    stats.update(force_rms=float(np.sqrt((f**2).mean())))
    return dict(stats, force_max_abs=float(np.abs(f).max()))


def _versions() -> dict:
    from importlib.metadata import version

    return {
        "tblite": version("tblite"),
        "ase": ase.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def write(frames: list[Atoms], out: Path, provenance: dict) -> Path:
    """Write ``out/carbon_gfn1.extxyz.xz`` and ``out/carbon_gfn1.json``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{STEM}.extxyz.xz"
    with lzma.open(path, "wt") as fh:
        ase.io.write(fh, frames, format="extxyz")
    provenance = dict(provenance, file=path.name, bytes=path.stat().st_size)
    (out / f"{STEM}.json").write_text(json.dumps(provenance, indent=1) + "\n")
    return path


def build(out, scale=1.0, seed=0, families=FAMILIES, command="", log=print):
    """Generate, label, split and write the dataset (rewritten after each family)."""
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown families {sorted(unknown)}; known: {FAMILIES}")
    start = time.perf_counter()
    calc = make_calculator()
    prov = {
        "generator": "ecekern.data.carbon",
        "command": command,
        "seed": seed,
        "scale": scale,
        "versions": _versions(),
        "calculator": {"class": "tblite.ase.TBLite", **dict(calc.parameters)},
        "settings": {
            "dmin": DMIN,
            "sizes": SIZES,
            "size_weights": SIZE_WEIGHTS,
            "frames_per_parent": FRAMES,
            "quench": QUENCH,
            "liquid": LIQUID,
            "splits": dict(SPLITS),
        },
        "families": {},
        "complete": False,
    }
    frames: list[Atoms] = []
    for family in families:
        t0 = time.perf_counter()
        n_parents = max(1, round(PARENTS[family] * scale))
        splits = assign_splits(n_parents, seed, family)
        kept, scf_failed, md_failures = [], 0, []
        for p in range(n_parents):
            rng = np.random.default_rng([seed, FAMILIES.index(family), p])
            kwargs = (
                {"failures": md_failures} if family in ("amorphous", "liquid") else {}
            )
            for k, atoms in enumerate(GENERATORS[family](rng, **kwargs)):
                labelled = label(atoms)
                if labelled is None:
                    scf_failed += 1
                    log(f"  SCF failed: {family} parent {p} frame {k}, dropped")
                    continue
                labelled.info.update(
                    family=family, split=splits[p], parent=f"{family}-{p:04d}", index=k
                )
                kept.append(labelled)
            log(
                f"[{time.perf_counter() - start:7.1f} s] {family} {p + 1}/{n_parents}"
                f" parents, {len(kept)} frames"
            )
        frames += kept
        counts = {s: sum(a.info["split"] == s for a in kept) for s, _ in SPLITS}
        prov["families"][family] = {
            "parents": n_parents,
            "frames": len(kept),
            **counts,
            "scf_failures_dropped": scf_failed,
            "md_failures": md_failures,
            "wall_s": round(time.perf_counter() - t0, 1),
            **(_stats(kept) if kept else {}),
        }
        prov["n_structures"] = len(frames)
        prov["wall_s"] = round(time.perf_counter() - start, 1)
        write(frames, Path(out), prov)
    prov["complete"] = True
    path = write(frames, Path(out), prov)
    log(f"wrote {len(frames)} structures to {path} in {prov['wall_s']} s")
    return frames


def load(path: str | Path | None = None) -> list[Atoms]:
    """The structures of the dataset file (default: the one shipped with ecekern), each
    with energy, forces and stress in a SinglePointCalculator and ``info``."""
    path = Path(path) if path is not None else DEFAULT_PATH
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; generate it with "
            f"`python -m ecekern.data.carbon --out {path.parent}` (needs tblite)"
        )
    with lzma.open(path, "rt") as fh:  # decompressed whole: seeking in lzma is slow
        text = io.StringIO(fh.read())
    return ase.io.read(text, index=":", format="extxyz")


def reproduce(path: str | Path | None = None, n: int = 3, seed: int = 0) -> list[dict]:
    """Relabel ``n`` structures drawn with ``seed`` from the file and return, for each,
    max |dE|/atom (eV), max |dF| (eV/A) and max |d stress| (eV/A^3) against the file."""
    frames = load(path)
    rows = []
    for i in np.random.default_rng(seed).choice(len(frames), n, replace=False):
        stored = frames[int(i)]
        fresh = label(stored)
        if fresh is None:
            raise RuntimeError(f"SCF failed relabelling structure {i}")
        row = {"index": int(i), "n_atoms": len(stored)}
        row.update((k, stored.info[k]) for k in ("family", "parent"))
        d_energy = fresh.get_potential_energy() - stored.get_potential_energy()
        row["energy_per_atom"] = float(abs(d_energy)) / len(stored)
        for key, get in (("forces", Atoms.get_forces), ("stress", Atoms.get_stress)):
            row[key] = float(np.abs(get(fresh) - get(stored)).max())
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ecekern.data.carbon", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiplies the parents per family"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help="comma-separated subset of " + ",".join(FAMILIES),
    )
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m ecekern.data.carbon", *map(str, argv)])
    families = tuple(f for f in args.families.split(",") if f)
    log = lambda msg: print(msg, flush=True)
    build(args.out, args.scale, args.seed, families, command, log=log)


if __name__ == "__main__":
    main()
