"""ecekern.calculator.ECECalculator: ASE energy, forces, stress and NVE dynamics."""

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.fd import calculate_numerical_stress
from ase.md.verlet import VelocityVerlet

import ecekern
from ecekern.calculator import ECECalculator
from ecekern.graph import build_graph
from ecekern.testing import rel_err

try:  # ase >= 3.29; MaxwellBoltzmannDistribution is its deprecated alias
    from ase.md.velocitydistribution import thermalize_momenta
except ImportError:  # pragma: no cover
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    def thermalize_momenta(atoms, temperature_K, rng=None):
        MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=rng)


SMALL = ecekern.ECEConfig(channels=8, radial_hidden=16, readout_hidden=8)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These graphs are small: one torch thread is several times faster than two
    when the cores are shared (``pytest -n 2``)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def model():
    return ecekern.ECEModel(SMALL).double()


def _box():
    """8 rattled carbon atoms in a 3.567 A cube: the 5 A cutoff reaches several
    periodic images of every atom."""
    return ecekern.systems.diamond(repeats=1, rattle=0.1, seed=1)


def _triclinic():
    atoms = _box()
    shear = np.array([[1.0, 0.12, -0.07], [0.05, 0.95, 0.1], [0.0, -0.08, 1.04]])
    atoms.set_cell(atoms.cell.array @ shear, scale_atoms=True)
    return atoms


# 1. ----------------------------------------------------------------------------------
def test_energy_and_forces_match_energy_and_forces(model):
    atoms = _box()
    atoms.calc = ECECalculator(model, device="cpu")
    e_ref, f_ref = ecekern.energy_and_forces(model, atoms)
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    assert isinstance(energy, float)
    assert forces.dtype == np.float64 and forces.shape == (len(atoms), 3)
    assert abs(energy - float(e_ref)) <= 1e-12 * abs(float(e_ref))
    assert rel_err(torch.from_numpy(forces), f_ref) < 1e-12
    assert atoms.get_potential_energy(force_consistent=True) == energy


# 2. ----------------------------------------------------------------------------------
def _fd_stress(atoms, h=1e-5):
    """Central difference of E under ``cell @ (I + eps)``, atoms scaled with it:
    ``dE/d eps / V`` in Voigt order (xx, yy, zz, yz, xz, xy); an off-diagonal
    component strains ``eps_ij = eps_ji = h / 2``."""
    cell0, volume = atoms.cell.array.copy(), atoms.get_volume()
    out = np.zeros(6)
    for k, (i, j) in enumerate([(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]):
        e = []
        for sign in (1.0, -1.0):
            eps = np.zeros((3, 3))
            eps[i, j] += sign * h / (1 if i == j else 2)
            eps[j, i] = eps[i, j]
            strained = atoms.copy()
            strained.calc = atoms.calc
            strained.set_cell(cell0 @ (np.eye(3) + eps), scale_atoms=True)
            e.append(strained.get_potential_energy())
        out[k] = (e[0] - e[1]) / (2 * h * volume)
    return out


@pytest.mark.parametrize("make", [_box, _triclinic], ids=["diamond", "triclinic"])
def test_stress_is_the_strain_derivative(model, make):
    atoms = make()
    atoms.calc = ECECalculator(model)
    stress = atoms.get_stress()
    assert stress.shape == (6,) and stress.dtype == np.float64
    fd = _fd_stress(atoms)
    scale = np.abs(stress).max()
    assert scale > 1e-4  # not a vacuous comparison
    assert np.abs(stress - fd).max() < 1e-6 * scale, (stress, fd)
    if make is _box:  # ASE's own finite difference: the same sign, order and V
        ase_fd = calculate_numerical_stress(atoms, eps=1e-5)
        assert np.abs(stress - ase_fd).max() < 1e-6 * scale, (stress, ase_fd)
    s3 = atoms.get_stress(voigt=False)
    np.testing.assert_array_equal(s3, s3.T)


# 3. ----------------------------------------------------------------------------------
def test_nve_conserves_energy_with_second_order_error():
    """Velocity Verlet over the same 100 fs at dt = 1 fs (100 steps) and 0.5 fs (200
    steps). Same simulated time, because a symplectic integrator's energy error is
    ``dt^2 (g(x(0)) - g(x(t)))`` for a function g of the state: on one time window
    the maximum deviation scales as dt^2 (ratio 4), while 100 steps each would
    compare a 100 fs window with a 50 fs one. The 3 A cutoff keeps the test fast and
    sits on diamond's third shell (2.96 A), so edges enter and leave the list all
    through the run; a jump at the cutoff would add a dt-independent error (without
    the envelope on the messages the deviation was 0.28 eV and the ratio ~1)."""
    cfg = ecekern.ECEConfig(
        lmax=2,
        channels=4,
        n_gated=1,
        radial_hidden=16,
        readout_hidden=8,
        cutoff=3.0,
    )
    model = ecekern.ECEModel(cfg).double()

    def edges(atoms):
        g = build_graph(atoms.positions, atoms.cell.array, atoms.pbc, cfg.cutoff)
        return set(zip(g.src.tolist(), g.dst.tolist(), map(tuple, g.shifts.tolist())))

    def max_deviation(dt_fs):
        atoms = ecekern.systems.diamond(repeats=2, rattle=0.05, seed=0)
        thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(0))
        atoms.calc = ECECalculator(model)
        first = edges(atoms)
        e0 = atoms.get_total_energy()
        dev = []
        dyn = VelocityVerlet(atoms, timestep=dt_fs * units.fs)
        dyn.attach(lambda: dev.append(abs(atoms.get_total_energy() - e0)))
        dyn.run(round(100 / dt_fs))
        assert edges(atoms) != first  # pairs crossed the cutoff during the run
        return max(dev)

    dev_1, dev_half = max_deviation(1.0), max_deviation(0.5)
    n_atoms = 64
    print(f"NVE max |E - E0|: dt=1 fs {dev_1:.3e} eV, dt=0.5 fs {dev_half:.3e} eV")
    assert dev_1 / n_atoms < 1e-6  # eV per atom over 100 fs
    assert 2.5 < dev_1 / dev_half < 6.0, (dev_1, dev_half)


# 4. ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_atoms", [2, 3], ids=["dimer", "trimer"])
def test_continuous_across_the_cutoff(model, n_atoms):
    """A C-C pair pulled through the cutoff in a big non-periodic box; in the trimer
    an O bonded to the first C (1.3 A) and beyond the cutoff from the second feels
    the pair through message passing."""
    rc = model.config.cutoff
    calc = ECECalculator(model)

    def ef(r):
        pos = [[0.0, 0.0, 0.0], [r, 0.0, 0.0], [-0.6, 1.15, 0.0]][:n_atoms]
        numbers = [6, 6, 8][:n_atoms]
        atoms = Atoms(numbers=numbers, positions=np.array(pos) + 10.0)
        atoms.cell, atoms.pbc = [30.0, 30.0, 30.0], False
        atoms.calc = calc
        return atoms.get_potential_energy(), atoms.get_forces()

    e_in, f_in = ef(rc - 1e-4)
    e_out, f_out = ef(rc + 1e-4)
    assert abs(e_in - e_out) < 1e-10
    assert np.abs(f_in - f_out).max() < 1e-8
    if n_atoms == 2:
        assert np.abs(f_out).max() == 0.0  # no edge at all


# 5. ----------------------------------------------------------------------------------
def test_bad_input(model):
    with pytest.raises(TypeError, match="ECEModel"):
        ECECalculator(torch.nn.Linear(3, 1))
    with pytest.raises(TypeError, match="float32 or torch.float64"):
        ECECalculator(model, dtype=torch.float16)
    fresh = ecekern.ECEModel(SMALL)  # float32: a bad argument leaves it as it was
    with pytest.raises(TypeError, match="graph_step"):
        ECECalculator(fresh, dtype=torch.float64, graph_step="yes")
    assert next(fresh.parameters()).dtype == torch.float32
    molecule = Atoms("CO", positions=[[0, 0, 0], [1.13, 0, 0]])
    molecule.calc = ECECalculator(model)
    assert np.isfinite(molecule.get_forces()).all()
    with pytest.raises(PropertyNotImplementedError, match="periodic"):
        molecule.get_stress()
    slab = Atoms("C2", positions=[[0, 0, 0], [0.7, 0.7, 0.9]], cell=[3, 3, 0])
    slab.pbc = (True, True, False)  # a zero vector in the open direction: no volume
    slab.calc = ECECalculator(model)
    assert np.isfinite(slab.get_forces()).all()
    with pytest.raises(PropertyNotImplementedError, match="non-zero volume"):
        slab.get_stress()
    molecule.numbers[0] = 14  # not among the model's species
    with pytest.raises(ValueError, match="species"):
        molecule.get_potential_energy()


def test_dtype_is_explicit():
    """An explicit dtype converts the model once; a model converted afterwards is an
    error naming the fix, never converted silently."""
    model = ecekern.ECEModel(SMALL)  # float32
    calc = ECECalculator(model)
    assert calc.dtype == torch.float32
    atoms = _box()
    atoms.calc = ECECalculator(model, dtype=torch.float64)
    assert next(model.parameters()).dtype == torch.float64
    e64 = atoms.get_potential_energy()
    e_ref = float(ecekern.energy_and_forces(model, atoms)[0])
    assert abs(e64 - e_ref) <= 1e-12 * abs(e_ref)  # the calculator may run on a GPU
    model.float()
    atoms.positions[0, 0] += 0.01
    with pytest.raises(ValueError, match=r"model\.to\(torch\.float64\)"):
        atoms.get_potential_energy()


# 6. ----------------------------------------------------------------------------------
def test_ase_workflow_and_cache(model, monkeypatch):
    atoms = _box()
    atoms.calc = calc = ECECalculator(model)
    calls = []
    calculate = calc.calculate
    monkeypatch.setattr(
        calc, "calculate", lambda *a, **k: (calls.append(1), calculate(*a, **k))
    )
    e1, f1, s1 = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    assert len(calls) == 1  # one forward + backward gave all three
    assert np.isfinite(f1).all() and np.isfinite(s1).all()
    atoms.get_forces()
    assert len(calls) == 1  # unchanged atoms: ASE's cache

    atoms.positions[3] += [0.05, -0.02, 0.03]  # check_state sees the move
    f2 = atoms.get_forces()
    assert len(calls) == 2
    e_ref, f_ref = ecekern.energy_and_forces(model, atoms)
    assert atoms.get_potential_energy() == pytest.approx(float(e_ref), rel=1e-12)
    assert rel_err(torch.from_numpy(f2), f_ref) < 1e-12
    assert atoms.get_potential_energy() != e1 and not np.allclose(f2, f1)

    atoms.set_cell(atoms.cell.array * 1.01, scale_atoms=True)  # a new cell too
    assert not np.allclose(atoms.get_stress(), s1)
    assert len(calls) == 3


def test_isolated_atom_has_zero_force(model):
    atom = Atoms("N", positions=[[0.0, 0.0, 0.0]])
    atom.calc = ECECalculator(model)
    assert np.isfinite(atom.get_potential_energy())
    np.testing.assert_array_equal(atom.get_forces(), np.zeros((1, 3)))


# 7. ----------------------------------------------------------------------------------
class _Wrapped(torch.nn.Module):
    """What ``torch.compile(model)`` returns, as far as the calculator looks: a
    module whose ``_orig_mod`` is the ECEModel and whose call computes."""

    def __init__(self, model):
        super().__init__()
        self._orig_mod = model
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        return self._orig_mod(*args)


def test_a_compiled_model_is_accepted():
    """The wrapper computes, the ECEModel inside gives config, dtype and device (and
    is the one converted); ``torch.compile`` wraps so too (``test_model``)."""
    model = ecekern.ECEModel(ecekern.ECEConfig(channels=4, n_gated=1, cutoff=3.0))
    wrapped = _Wrapped(model)
    atoms = _box()
    atoms.calc = ECECalculator(wrapped, device="cpu", dtype=torch.float64)
    assert next(model.parameters()).dtype == torch.float64
    e = atoms.get_potential_energy()
    assert wrapped.calls == 1
    assert e == pytest.approx(float(ecekern.energy_and_forces(model, atoms)[0]))
    assert np.isfinite(atoms.get_stress()).all()
    assert ECECalculator(torch.compile(model), device="cpu").model._orig_mod is model
    with pytest.raises(TypeError, match="ECEModel or torch.compile"):
        ECECalculator(_Wrapped(torch.nn.Linear(3, 1)))


def test_a_device_without_data_is_refused():
    model = ecekern.ECEModel(ecekern.ECEConfig(channels=4, n_gated=1, cutoff=3.0))
    with pytest.raises(ValueError, match="device='meta' holds no data"):
        ECECalculator(model, device="meta")
    assert next(model.parameters()).device.type == "cpu"  # left where it was
    with pytest.raises(ValueError, match="meta device .* ECEModel.load"):
        ECECalculator(model.to("meta"), device="cpu")


def test_help_shows_the_calculator_arguments():
    """ASE's Calculator must not hide the constructor: the signature and pydoc's
    page name the arguments."""
    import inspect
    import pydoc

    params = inspect.signature(ECECalculator).parameters
    assert list(params)[:4] == ["model", "device", "dtype", "graph_step"]
    page = pydoc.render_doc(ECECalculator, renderer=pydoc.plaintext)
    for name in ("model:", "device:", "dtype:", "graph_step:", "torch.compile"):
        assert name in page
    assert "ECECalculator(model, device=None, dtype=None, graph_step=None" in page
