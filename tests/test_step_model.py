"""Chapter 7's stages in the model: the fused geometry and the fused radial stage
give the reference's energy, forces and stress (float64, in the interpreter on CPU
machines), in the eager step, the padded step, and a force-training step."""

import pytest
import torch

import ecekern
from ecekern import options
from ecekern._triton import INTERPRET
from ecekern.graph_step import GraphStep
from ecekern.model import force_step, prepare_inputs
from ecekern.testing import rel_err

DEV = "cpu" if INTERPRET else "cuda"
CFG = ecekern.ECEConfig(
    channels=4, radial_hidden=8, readout_hidden=8, n_gated=1, cutoff=2.6
)
STAGES = {
    "geometry": dict(geometry="fused", edge_frame="packed"),
    "radial": dict(radial="fused"),
    "both": dict(geometry="fused", radial="fused", edge_frame="packed"),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ecekern.ECEModel(CFG).double().to(DEV)


def _inputs(seed=0):
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=seed)
    return prepare_inputs(atoms, CFG.cutoff, torch.float64, DEV)


def _stress_step(model, pos, numbers, graph):
    """Energy and the strain derivative (the virial) at zero strain."""
    eps = torch.zeros(3, 3, dtype=pos.dtype, device=pos.device, requires_grad=True)
    x = pos + pos @ eps
    g = ecekern.graph.Graph(graph.src, graph.dst, graph.shifts, graph.row_ptr,
                            graph.cell + graph.cell @ eps,
                            cutoff=graph.cutoff)  # fmt: skip
    e = model(x, numbers, g)
    return torch.autograd.grad(e, eps)[0]


@pytest.mark.parametrize(
    "stages",
    [pytest.param("geometry", marks=pytest.mark.slow),
     pytest.param("radial", marks=pytest.mark.slow), "both"],
)  # fmt: skip
def test_energy_forces_and_stress_match_the_reference(model, stages):
    pos, numbers, graph = _inputs()
    with options.use(reference=True):
        e0, f0 = force_step(model, pos, numbers, graph)
        v0 = _stress_step(model, pos, numbers, graph)
    with options.use(**STAGES[stages]):
        plan = model.plan()
        e, f = force_step(model, pos, numbers, graph)
        v = _stress_step(model, pos, numbers, graph)
    for stage in ("geometry", "radial"):  # the others are auto: fused on CUDA
        if stage in STAGES[stages]:
            assert getattr(plan, stage) == "fused"
    assert rel_err(e, e0) < 1e-13
    assert rel_err(f, f0) < 1e-12 and rel_err(v, v0) < 1e-12


@pytest.mark.slow
def test_the_padded_step_matches_the_unpadded_one(model):
    pos, numbers, graph = _inputs(seed=1)
    with options.use(**STAGES["both"]):
        e, f = force_step(model, pos, numbers, graph)
        step = GraphStep(model, numbers, stress=True, graphs=False)
        out = step(pos, graph)
    assert rel_err(out.energy, e) < 1e-13 and rel_err(out.forces, f) < 1e-12


def test_a_force_training_step_matches_the_reference(model):
    """The force loss's parameter gradients (a second derivative through both
    stages: their backwards run differentiable PyTorch under create_graph)."""
    pos, numbers, graph = _inputs(seed=2)

    def grads():
        model.zero_grad()
        e, f = force_step(model, pos, numbers, graph, create_graph=True)
        loss = e**2 + (f**2).sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    with options.use(reference=True):
        want = grads()
    with options.use(**STAGES["both"]):
        got = grads()
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.slow
def test_a_gauge_runs_the_reference_geometry_loudly(model):
    pos, numbers, graph = _inputs()
    gauge = torch.linspace(0.1, 2.0, graph.n_edges, dtype=pos.dtype, device=DEV)
    with options.use(reference=True):
        e0 = model(pos, numbers, graph, gauge)
    options.reset_fallback_warnings()
    with options.use(**STAGES["both"]):
        with pytest.warns(options.FallbackWarning, match="gauge"):
            e = model(pos, numbers, graph, gauge)
    assert rel_err(e, e0) < 1e-13


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "3xtf32", "tf32"])
def test_gpu_the_book_model_in_float32(precision):
    """The book's model at 512 atoms: the fused stages against the reference by the
    three-way rule (float64 truth), in each of the stack's precisions."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ecekern.testing import assert_close_three_way

    atoms = ecekern.systems.diamond(4)
    torch.manual_seed(0)
    model = ecekern.ECEModel().to("cuda", torch.float64)
    truth = force_step(model, *prepare_inputs(atoms, 5.0, torch.float64, "cuda"))
    model = model.float()
    inputs = prepare_inputs(atoms, 5.0, torch.float32, "cuda")
    with options.use(reference=True):
        ref = force_step(model, *inputs)
    with options.use(precision=precision, stack="layers", geometry="fused",
                     radial="fused"):  # fmt: skip
        plan = model.plan()
        got = force_step(model, *inputs)
    assert (plan.geometry, plan.radial) == ("fused", "fused")
    tol = {"fp32": 1.0, "3xtf32": 1.0, "tf32": 300.0}[precision]
    for name, a, b, t in zip(("energy", "forces"), got, ref, truth, strict=True):
        if precision == "tf32":  # TF32 products: a stated tolerance, not three-way
            assert rel_err(a, t) < tol * 1e-5, (name, rel_err(a, t))
        else:
            assert_close_three_way(a, b, t, f"{precision} {name}")


@pytest.mark.slow
def test_nve_with_the_fused_stages_follows_the_reference(model):
    """An NVE run (ASE velocity Verlet, 0.5 fs) with both fused stages on gives the
    reference's trajectory: total energies equal to 1e-10 eV, step by step, and
    conserved to a small fraction of the kinetic energy."""
    import numpy as np
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from ecekern.calculator import ECECalculator

    def run(**opts):
        atoms = ecekern.systems.diamond(1, rattle=0.1, seed=6)
        atoms.set_momenta(np.random.default_rng(1).normal(0, 0.3, (len(atoms), 3)))
        atoms.calc = ECECalculator(model, device=DEV, graph_step=False)
        totals = []
        with options.use(**opts):
            dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
            dyn.attach(lambda: totals.append(atoms.get_total_energy()), interval=1)
            dyn.run(10)
        return np.array(totals), atoms.get_kinetic_energy()

    ref, kinetic = run(reference=True)
    got, _ = run(**STAGES["both"])
    assert np.abs(got - ref).max() < 1e-10
    assert np.ptp(got) < 0.05 * kinetic
