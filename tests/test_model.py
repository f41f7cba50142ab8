import copy

import numpy as np
import pytest
import torch
from ase import Atoms

import ecekern
from ecekern.graph import build_graph
from ecekern.testing import random_rotation, rel_err, rotated_atoms

SMALL = ecekern.ECEConfig(channels=6, radial_hidden=16, readout_hidden=8)
G = lambda s: torch.Generator().manual_seed(s)


def _model(cfg=SMALL):
    return ecekern.ECEModel(cfg).double()


def _inputs(atoms, cutoff=5.0):
    pos = torch.tensor(atoms.positions)
    graph = build_graph(pos, torch.tensor(atoms.cell.array), atoms.pbc, cutoff)
    return pos, torch.tensor(atoms.numbers), graph


@pytest.fixture(scope="module")
def box():
    return ecekern.systems.diamond(1, rattle=0.1, seed=2)


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        ecekern.ECEConfig(lmax=1, channels=4, radial_hidden=8, readout_hidden=4),
        ecekern.ECEConfig(
            lmax=3, mmax=2, channels=4, radial_hidden=8, readout_hidden=4
        ),
        ecekern.ECEConfig(
            lmax=4, mmax=1, channels=3, n_gated=1, radial_hidden=8, readout_hidden=4
        ),
    ],
    ids=["L2M2", "L1M1", "L3M2", "L4M1"],
)
def test_rotation_invariance_and_force_equivariance(box, cfg):
    model = _model(cfg)
    e, f = ecekern.energy_and_forces(model, box)
    for seed in range(2):
        R = random_rotation(G(seed))
        e_r, f_r = ecekern.energy_and_forces(model, rotated_atoms(box, R))
        assert rel_err(e_r, e) < 1e-10
        assert rel_err(f_r, f @ R.T) < 1e-10


def test_translation_and_permutation_invariance(box):
    model = _model()
    e, f = ecekern.energy_and_forces(model, box)
    moved = box.copy()
    moved.positions = box.positions + np.array([0.7, -2.3, 11.0])
    e_t, f_t = ecekern.energy_and_forces(model, moved)
    assert rel_err(e_t, e) < 1e-10 and rel_err(f_t, f) < 1e-10
    perm = np.random.default_rng(0).permutation(len(box))
    e_p, f_p = ecekern.energy_and_forces(model, box[perm])
    assert rel_err(e_p, e) < 1e-10 and rel_err(f_p, f[perm]) < 1e-10


def test_gauge_invariance(box):
    model = _model()
    pos, numbers, graph = _inputs(box)
    e0 = model(pos, numbers, graph)
    for seed in range(3):
        gauge = (
            2
            * torch.pi
            * torch.rand(graph.n_edges, generator=G(seed), dtype=torch.float64)
        )
        assert rel_err(model(pos, numbers, graph, gauge=gauge), e0) < 1e-10


def test_forces_are_minus_the_energy_gradient(box):
    model = _model()
    e, f = ecekern.energy_and_forces(model, box)
    pos, numbers, graph = _inputs(box)  # graph fixed: no edge crosses the cutoff
    h = 1e-5
    rng = np.random.default_rng(1)
    for atom, axis in zip(rng.integers(0, len(box), 4), rng.integers(0, 3, 4)):
        dx = torch.zeros_like(pos)
        dx[atom, axis] = h
        with torch.no_grad():
            fd = -(
                model(pos + dx, numbers, graph) - model(pos - dx, numbers, graph)
            ) / (2 * h)
        assert abs(float(fd - f[atom, axis])) < 1e-7 * max(1.0, float(f.abs().max()))


def test_force_loss_training_step_double_backward(box):
    model = _model()
    target = torch.zeros(len(box), 3, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    e, f = ecekern.energy_and_forces(model, box, create_graph=True)
    loss = ((f - target) ** 2).mean() + 1e-3 * e**2
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # the interaction weights get gradient only through the forces' graph
    assert model.interactions[0].gated[0].weight.grad.abs().max() > 0
    before = loss.item()
    opt.step()
    model.zero_grad()
    e, f = ecekern.energy_and_forces(model, box, create_graph=True)
    after = (((f - target) ** 2).mean() + 1e-3 * e**2).item()
    assert after < before


def test_gradgradcheck_tiny_system():
    cfg = ecekern.ECEConfig(
        channels=2, radial_hidden=4, readout_hidden=2, n_gated=1, cutoff=3.0
    )
    model = _model(cfg)
    rng = np.random.default_rng(3)
    atoms = Atoms("CHC", positions=rng.random((3, 3)) * 1.5, pbc=False)
    pos, numbers, graph = _inputs(atoms, cutoff=3.0)
    assert graph.n_edges == 6
    f = lambda x: model(x, numbers, graph)
    x = pos.clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_empty_system_and_isolated_atoms():
    model = _model()
    e, f = ecekern.energy_and_forces(model, Atoms(cell=np.eye(3) * 10, pbc=True))
    assert e.item() == 0 and f.shape == (0, 3)
    lonely = Atoms("CO", positions=[[0, 0, 0], [20, 0, 0]], pbc=False)
    e, f = ecekern.energy_and_forces(model, lonely)
    assert torch.isfinite(e) and f.abs().max() == 0
    one = Atoms("C", positions=[[0, 0, 0]], pbc=False)
    e1, _ = ecekern.energy_and_forces(model, one)
    # an isolated atom's energy does not depend on what is far away
    assert (
        rel_err(
            e,
            e1 + ecekern.energy_and_forces(model, Atoms("O", positions=[[0, 0, 0]]))[0],
        )
        < 1e-12
    )


def test_parameters_are_seeded():
    a, b = ecekern.ECEModel(SMALL), ecekern.ECEModel(SMALL)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = ecekern.ECEModel(
        ecekern.ECEConfig(channels=6, radial_hidden=16, readout_hidden=8, seed=1)
    )
    assert not torch.equal(a.readout[0].weight, c.readout[0].weight)


def test_float32_agrees_with_float64(box):
    """energy_and_forces computes in the model's dtype and never converts the model."""
    model = _model()
    e64, f64 = ecekern.energy_and_forces(model, box)
    assert e64.dtype == f64.dtype == torch.float64
    model32 = ecekern.ECEModel(SMALL)  # built in float32: the same parameters
    e32, f32 = ecekern.energy_and_forces(model32, box)
    assert e32.dtype == f32.dtype == torch.float32
    assert rel_err(e32, e64) < 1e-5 and rel_err(f32, f64) < 1e-3
    e, _ = ecekern.energy_and_forces(model, box, dtype=torch.float64, device="cpu")
    assert torch.equal(e, e64)
    with pytest.raises(TypeError, match=r"model\.to\(torch\.float32\)"):
        ecekern.energy_and_forces(model, box, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float64  # left as it was


def test_bad_inputs(box):
    model = _model()
    pos, numbers, graph = _inputs(box)
    with pytest.raises(ValueError, match="species"):
        model(pos, torch.full_like(numbers, 92), graph)
    with pytest.raises(TypeError, match="float32"):
        model(pos.float(), numbers, graph)
    with pytest.raises(ValueError, match="numbers"):
        model(pos, numbers[:-1], graph)
    with pytest.raises(ValueError, match="nodes"):
        model(pos[:-1], numbers[:-1], graph)
    with pytest.raises(TypeError):
        model(pos, numbers.double(), graph)
    with pytest.raises(TypeError):
        ecekern.energy_and_forces(model, box, dtype=torch.int64)
    with pytest.raises(TypeError):
        ecekern.ECEModel({"lmax": 2})
    for bad in (
        dict(lmax=0),
        dict(mmax=3),
        dict(mmax=True),  # a bool is not an order
        dict(channels=0),
        dict(cutoff=-1.0),
        dict(species=(6, 6)),
    ):
        with pytest.raises(ValueError):
            ecekern.ECEConfig(**bad)


@pytest.mark.gpu
def test_cuda_agrees_with_cpu_float64():
    atoms = ecekern.systems.diamond(2, seed=5)
    model = _model(ecekern.ECEConfig())
    e_cpu, f_cpu = ecekern.energy_and_forces(model, atoms)
    with pytest.raises(ValueError, match="model.to"):  # the model is not moved
        ecekern.energy_and_forces(model, atoms, device="cuda")
    gpu = copy.deepcopy(model).cuda()
    e_gpu, f_gpu = ecekern.energy_and_forces(gpu, atoms, device="cuda")
    assert e_gpu.device.type == "cuda"
    assert rel_err(e_gpu, e_cpu) < 1e-12 and rel_err(f_gpu, f_cpu) < 1e-10
    e32, f32 = ecekern.energy_and_forces(
        gpu.float(), atoms, dtype=torch.float32, device="cuda"
    )
    assert rel_err(e32, e_cpu) < 1e-4 and rel_err(f32, f_cpu) < 1e-2


@pytest.mark.gpu
def test_cuda_graph_matches_on_gpu_neighbor_list():
    atoms = ecekern.systems.diamond(3, seed=1)
    pos = torch.tensor(atoms.positions)
    cpu = ecekern.neighbor_list(pos, atoms.cell.array, True, 5.0)
    gpu = ecekern.neighbor_list(
        pos.cuda(), torch.tensor(atoms.cell.array).cuda(), True, 5.0
    )
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))


def test_e3nn_peer_is_invariant(box):
    pytest.importorskip("e3nn")
    from ecekern.model import force_step, prepare_inputs
    from ecekern.peers import E3nnConvModel

    peer = E3nnConvModel(SMALL).double()
    pos, numbers, graph = prepare_inputs(box, SMALL.cutoff)
    e, f = force_step(peer, pos, numbers, graph)
    R = random_rotation(G(9))
    pos_r, numbers_r, graph_r = prepare_inputs(rotated_atoms(box, R), SMALL.cutoff)
    e_r, f_r = force_step(peer, pos_r, numbers_r, graph_r)
    assert rel_err(e_r, e) < 1e-10 and rel_err(f_r, f @ R.T) < 1e-10
    assert f.abs().max() > 0


@pytest.mark.gpu
def test_device_mismatch_is_a_clear_error(box):
    model = _model().cuda()
    pos, numbers, graph = _inputs(box)
    with pytest.raises(ValueError, match="cuda|cpu"):
        model(pos, numbers, graph)
    with pytest.raises(ValueError, match="cell"):
        ecekern.neighbor_list(pos.cuda(), torch.eye(3, dtype=pos.dtype), True, 2.0)


def test_the_library_works_without_triton():
    """Where Triton has no wheels (macOS, Windows) the reference serves every call and
    the fast paths say so."""
    import subprocess
    import sys

    code = """
import sys, warnings
sys.modules["triton"] = None
import torch, ecekern
from ecekern import linear, options
atoms = ecekern.systems.diamond(1)
cfg = ecekern.ECEConfig(channels=2, radial_hidden=4, readout_hidden=2)
model = ecekern.ECEModel(cfg)
e, f = ecekern.energy_and_forces(model, atoms)
x = torch.randn(3, 4, 2, dtype=torch.float64)
w = torch.randn(2, 5, 4, dtype=torch.float64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    linear.equivariant_linear(x, x, w, None, path="triton")
    with options.use(zonal="fused"):
        ecekern.energy_and_forces(model, atoms)
msgs = [str(c.message) for c in caught]
assert sum("Triton is not installed" in m for m in msgs) == 2, msgs
print("ok", bool(torch.isfinite(e)))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok True"


@pytest.mark.parametrize("cohorts", [False, True], ids=["plain", "cohorts"])
@pytest.mark.parametrize("n_gated", [0, 2])
def test_energy_and_forces_are_continuous_across_the_cutoff(n_gated, cohorts):
    """A C-C dimer pulled through the cutoff: the energy and the force change by
    nothing measurable between just inside and just outside (the envelope on each
    edge's message, DESIGN 4e), with the stack plain or in cohorts of one edge
    (chapter 6). Without the envelope the mixing stack's biases left a jump of
    about 2 meV."""
    cfg = ecekern.ECEConfig(n_gated=n_gated)
    model = ecekern.ECEModel(cfg).double()
    rc = cfg.cutoff

    def ef(r):
        pos = torch.tensor([[0.0, 0.0, 0.0], [r, 0.0, 0.0]], dtype=torch.float64)
        graph = build_graph(pos, torch.eye(3, dtype=torch.float64) * 20, False, rc)
        e, f = ecekern.model.force_step(model, pos, torch.tensor([6, 6]), graph)
        return e.item(), f, graph.n_edges

    one_edge = {"cohort_edges": 1} if cohorts else {}  # (else unused: a warning)
    with ecekern.options.use(memory="keep" if cohorts else "plain", **one_edge):
        e_in, f_in, n_in = ef(rc - 1e-4)
        e_out, f_out, n_out = ef(rc + 1e-4)
    assert (n_in, n_out) == (2, 0)
    assert abs(e_in - e_out) < 1e-12
    assert float(f_in.abs().max()) < 1e-9 and float(f_out.abs().max()) == 0.0


def test_forces_under_no_grad_and_inference_mode(box):
    """A user's ``torch.no_grad()`` or ``inference_mode()`` around a force call does
    not stop the forces: they are autograd's, computed inside."""
    model = _model()
    e, f = ecekern.energy_and_forces(model, box)
    with torch.no_grad():
        e1, f1 = ecekern.energy_and_forces(model, box)
    with torch.inference_mode():
        e2, f2 = ecekern.energy_and_forces(model, box)
    assert torch.equal(f1, f) and torch.equal(f2, f) and torch.equal(e2, e)


def test_a_bad_seed_is_an_error():
    with pytest.raises(ValueError, match="seed"):
        ecekern.ECEConfig(seed=1.5)


def test_a_graph_of_another_cutoff_is_refused():
    """A graph searched at another radius misses neighbours the model sees (or holds
    ones it does not): the forward refuses it, naming both cutoffs."""
    cfg = ecekern.ECEConfig(channels=4, n_gated=1, cutoff=3.0)
    model = ecekern.ECEModel(cfg).double()
    atoms = ecekern.systems.diamond(repeats=1)
    pos, numbers, graph = _inputs(atoms, cutoff=3.0)
    e = model(pos, numbers, graph)
    assert torch.equal(model(pos, numbers, _inputs(atoms, 3.0 + 1e-12)[2]), e)
    for rc in (2.0, 4.0):
        with pytest.raises(ValueError, match=f"cutoff {rc:g} A but the model's cutoff"):
            model(pos, numbers, _inputs(atoms, cutoff=rc)[2])


@pytest.mark.parametrize(
    "x, model_dtype, advice",
    [
        (torch.float16, torch.float32, r"positions are torch\.float16 .* float32 or "
         r"float64: convert the positions \(positions\.to\(torch\.float32\)\)$"),
        (torch.int64, torch.float64, r"positions\.to\(torch\.float64\)\)$"),
        (torch.float64, torch.float32, r"positions\.to\(torch\.float32\)\) or the "
         r"model \(model\.double\(\)\)$"),
        (torch.float32, torch.float64, r"or the model \(model\.float\(\)\)$"),
        (torch.float16, torch.float16, r"the model is torch\.float16; .* convert it "
         r"\(model\.float\(\) or model\.double\(\)\)"),
    ],
)  # fmt: skip
def test_dtype_errors_name_a_conversion_that_works(x, model_dtype, advice):
    model = ecekern.ECEModel(ecekern.ECEConfig(channels=4, n_gated=1, cutoff=3.0))
    model.to(model_dtype)
    pos, numbers, graph = _inputs(ecekern.systems.diamond(repeats=1), cutoff=3.0)
    with pytest.raises(TypeError, match=advice):
        model(pos.to(x), numbers, graph)
    floats = (torch.float32, torch.float64)
    if model_dtype in floats:  # the positions' fix works
        assert torch.isfinite(model(pos.to(model_dtype), numbers, graph))
    if x in floats:  # and the model's
        assert torch.isfinite(model.to(x)(pos.to(x), numbers, graph))


@pytest.mark.filterwarnings("ignore:Dynamo detected a call")
def test_energy_and_forces_takes_a_compiled_model():
    """``torch.compile(model)`` (an ``OptimizedModule`` wrapping it) is accepted:
    the ECEModel inside gives the config and the checks, the compiled module
    computes. Dynamo's ``eager`` backend keeps the CPU test fast (inductor's C++
    compile would take minutes on the interpreter's paths); the wrapping is the
    same for every backend."""
    from ecekern.model import unwrap

    cfg = ecekern.ECEConfig(channels=4, n_gated=1, cutoff=3.0, radial_hidden=8,
                            readout_hidden=4)  # fmt: skip
    model = ecekern.ECEModel(cfg).double()
    atoms = ecekern.systems.diamond(repeats=1, rattle=0.1, seed=1)
    e, f = ecekern.energy_and_forces(model, atoms)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    assert unwrap(compiled) is model and unwrap(model) is model
    e2, f2 = ecekern.energy_and_forces(compiled, atoms)
    assert rel_err(e2, e) < 1e-12 and rel_err(f2, f) < 1e-12
    with pytest.raises(TypeError, match="ECEModel or torch.compile"):
        ecekern.energy_and_forces(torch.compile(torch.nn.Linear(3, 1)), atoms)
    with pytest.raises(TypeError, match="ECEModel or torch.compile"):
        ecekern.energy_and_forces(torch.nn.Linear(3, 1), atoms)
