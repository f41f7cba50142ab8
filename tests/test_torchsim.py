"""ECETorchSimModel: the model as a TorchSim ModelInterface (energy, forces, stress
of a batch of systems), against ECECalculator, and an NVE run through TorchSim."""

import numpy as np
import pytest
import torch

import ecekern
from ecekern.calculator import ECECalculator

ts = pytest.importorskip("torch_sim")
from ecekern.torchsim import ECETorchSimModel  # noqa: E402

CFG = ecekern.ECEConfig(channels=4, radial_hidden=8, readout_hidden=8, n_gated=1,
                        cutoff=3.0)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ecekern.ECEModel(CFG).double()


def _batch():
    a = ecekern.systems.diamond(1, rattle=0.1, seed=1)
    b = ecekern.systems.diamond(1, rattle=0.1, seed=2)
    b.set_cell(b.cell.array * 1.03, scale_atoms=True)
    b.numbers[:2] = 6  # the model's species: carbon only
    return [a, b]


def test_a_batch_matches_the_ase_calculator(model):
    atoms = _batch()
    state = ts.io.atoms_to_state(atoms, torch.device("cpu"), torch.float64)
    out = ECETorchSimModel(model)(state)
    assert out["energy"].shape == (2,) and out["forces"].shape == (16, 3)
    assert out["stress"].shape == (2, 3, 3)
    start = 0
    for i, a in enumerate(atoms):
        a.calc = ECECalculator(model, graph_step=False)
        n = len(a)
        assert abs(float(out["energy"][i]) - a.get_potential_energy()) < 1e-10
        np.testing.assert_allclose(out["forces"][start:start + n].numpy(),
                                   a.get_forces(), atol=1e-10)  # fmt: skip
        voigt = out["stress"][i][[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]].numpy()
        np.testing.assert_allclose(voigt, a.get_stress(), atol=1e-10)
        start += n


def test_the_padded_step_gives_the_same(model):
    """graph_step=True: the padded step (eager on the CPU, replayed on CUDA), the
    same energies and forces."""
    state = ts.io.atoms_to_state(_batch(), torch.device("cpu"), torch.float64)
    plain = ECETorchSimModel(model, graph_step=False)(state)
    padded = ECETorchSimModel(model, graph_step=True)(state)
    for k in ("energy", "forces", "stress"):
        torch.testing.assert_close(padded[k], plain[k], rtol=1e-12, atol=1e-12)


def test_nve_through_torchsim_conserves_energy(model):
    """Velocity Verlet in TorchSim (the state stays in torch): the total energy
    drifts by far less than its kinetic part over 40 steps of 0.5 fs."""
    atoms = ecekern.systems.diamond(1, rattle=0.05, seed=3)
    state = ts.io.atoms_to_state(atoms, torch.device("cpu"), torch.float64)
    sim = ECETorchSimModel(model, compute_stress=False)
    units = ts.units.MetalUnits
    kT = torch.tensor(300 * units.temperature, dtype=torch.float64)
    dt = torch.tensor(0.5e-3 * units.time, dtype=torch.float64)  # 0.5 fs
    init, step = ts.nve(sim, dt=dt, kT=kT, seed=0)
    md = init(state)
    totals = []
    for _ in range(40):
        md = step(md, dt=dt)
        kinetic = float(ts.calc_kinetic_energy(masses=md.masses, momenta=md.momenta))
        totals.append(float(md.energy.sum()) + kinetic)
    assert max(totals) - min(totals) < 0.05 * kinetic + 1e-6


def test_bad_inputs_are_clear_errors(model):
    with pytest.raises(TypeError, match="ECEModel"):
        ECETorchSimModel(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="graph_step"):
        ECETorchSimModel(model, graph_step="yes")
    state = ts.io.atoms_to_state(_batch(), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="float64"):
        ECETorchSimModel(model)(state)
