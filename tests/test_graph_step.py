"""Chapter 4: a force step with no host syncs, padded to an edge capacity, replayed as
a CUDA graph (the CPU runs the same padded step eagerly, Triton in its interpreter)."""

import copy
import dataclasses
import io
import logging

import numpy as np
import pytest
import torch
from ase import units
from ase.md.verlet import VelocityVerlet

import ecekern
from ecekern import options
from ecekern.calculator import ECECalculator
from ecekern.graph import build_graph, csr_row_ptr, edge_vectors
from ecekern.graph_step import CAPACITY_QUANTUM, GraphStep
from ecekern.host_sync import HostSyncAudit
from ecekern.model import force_step, prepare_inputs
from ecekern.options import FallbackWarning
from ecekern.so3 import lm_tables
from ecekern.testing import assert_close_three_way, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = ecekern.ECEConfig(
    channels=4, radial_hidden=8, readout_hidden=8, n_gated=1, cutoff=2.6
)
FAST = dict(edge_frame="packed", zonal="fused")  # on the CPU: Triton's interpreter
PATHS = {"reference": dict(reference=True), "fast": FAST}
# the fast paths' tests: nearest neighbours only (32 edges), for the interpreter's sake
NEAREST = ecekern.ECEConfig(**{**TINY.to_dict(), "cutoff": 2.0})


@pytest.fixture(scope="module")
def model():
    return ecekern.ECEModel(TINY).double().to(DEV)


@pytest.fixture(scope="module")
def models(model):
    """The model per path: the fast paths on the nearest-neighbour one."""
    return {"reference": model, "fast": ecekern.ECEModel(NEAREST).double().to(DEV)}


def _inputs(seed=1, rattle=0.1, dtype=torch.float64, cutoff=TINY.cutoff):
    atoms = ecekern.systems.diamond(1, rattle=rattle, seed=seed)
    return prepare_inputs(atoms, cutoff, dtype, DEV)


# 1. the audit -------------------------------------------------------------------------
def test_the_audit_finds_every_kind_of_sync():
    """Not vacuous: each pattern the chapter hunts is recorded, with its line."""
    x = torch.arange(6.0)
    with HostSyncAudit() as audit:
        _ = x.sum().item()
        _ = bool((x > 2).any())
        _ = x[x > 2]
        _ = torch.nonzero(x)
        _ = torch.bincount(x.long())
        _ = torch.tensor([1.0, 2.0])
        _ = torch.repeat_interleave(torch.tensor([1, 2]))
        _ = x.tolist(), x.numpy(), x.cpu(), torch.allclose(x, x)
    ops = [e.op for e in audit.events]
    assert ops.count("_local_scalar_dense") == 2
    for op in ("index", "nonzero", "bincount", "lift_fresh", "repeat_interleave",
               "tolist", "numpy", "cpu", "allclose"):  # fmt: skip
        assert op in ops, op
    assert all("test_graph_step.py" in e.where for e in audit.events)
    with pytest.raises(AssertionError, match="host syncs"):
        audit.assert_none()
    with HostSyncAudit() as quiet:
        torch.sort(x)[0].cumsum(0)
    quiet.assert_none()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_force_step_has_no_host_syncs(models, path):
    model = models[path]
    pos, numbers, graph = _inputs(cutoff=model.config.cutoff)
    with options.use(**PATHS[path]):
        force_step(model, pos, numbers, graph)  # the first call checks the species
        with HostSyncAudit() as audit:
            force_step(model, pos, numbers, graph)
    audit.assert_none()


def test_species_are_checked_once_per_numbers_tensor(model):
    pos, numbers, graph = _inputs()
    numbers = numbers.clone()
    with HostSyncAudit() as first:
        model.species_index(numbers)
    with HostSyncAudit() as again:
        model.species_index(numbers)
    assert first.syncs == 1 and again.syncs == 0
    numbers[0] = 92  # an in-place change is seen (the version counter moves)
    with pytest.raises(ValueError, match=r"\[92\]"):
        model.species_index(numbers)
    with torch.inference_mode():  # no version counter: checked every time
        frozen = numbers.clone().fill_(6)
    for _ in range(2):
        with HostSyncAudit() as a:
            model.species_index(frozen)
        assert a.syncs == 1
    model.species_index(numbers.fill_(6))
    torch.save(model, io.BytesIO())  # the memo (a weak reference) is not pickled


def test_constant_tables_are_copied_to_a_device_once():
    t = lm_tables(2, 1)
    assert t.on("cpu") is t
    meta = t.on("meta")  # a device without data: the copies themselves
    assert meta is t.on("meta") and meta.pack_index.device.type == "meta"
    assert meta.on("cpu") is t
    if torch.cuda.is_available():
        assert t.on("cuda") is t.on("cuda:0")
        assert t.on("cuda").pack_index.device.type == "cuda"


def test_a_first_call_under_inference_mode_leaves_no_inference_tables():
    """Tables cached at the first call are ordinary tensors even when that call ran
    under inference_mode: the force step after it still works."""
    from ecekern import so3
    from ecekern.edge_frame import launch

    for fn in (so3.lm_tables, so3._fit_points, so3._fit_points_on,
               launch._tables_cpu, launch._pack_index_cpu):  # fmt: skip
        fn.cache_clear()
    launch._TABLES.clear()
    model = ecekern.ECEModel(NEAREST).double().to(DEV)
    pos, numbers, graph = _inputs(cutoff=NEAREST.cutoff)
    with torch.inference_mode():
        e0 = model(pos, numbers, graph)
        step = GraphStep(model, numbers, graphs=False)
        step(pos, graph)  # buffers allocated under inference_mode
    e, f = force_step(model, pos, numbers, graph)
    assert torch.isfinite(f).all() and torch.equal(e, e0)
    assert rel_err(step(pos, graph).forces, f) < 1e-12


def test_a_number_changed_behind_the_check_gives_nan_not_another_element(model):
    pos, numbers, graph = prepare_inputs(
        ecekern.systems.diamond(1, rattle=0.1, seed=1), TINY.cutoff
    )  # on the CPU: numpy shares the tensor's memory
    arr = numbers.numpy()  # writes through it bypass the version counter
    model_cpu = ecekern.ECEModel(TINY).double()
    assert torch.isfinite(model_cpu(pos, numbers, graph))
    arr[0] = 200  # out of every table, after the check
    assert torch.isnan(model_cpu(pos, numbers, graph))


# 2. padding ---------------------------------------------------------------------------
def test_a_padded_graph_needs_the_pad_length():
    pos, _, graph = _inputs()
    import dataclasses

    with pytest.raises(ValueError, match="pad_length"):
        edge_vectors(pos, dataclasses.replace(graph, padded=True))


@pytest.mark.parametrize(
    "path, stress", [("reference", False), ("reference", True), ("fast", True)]
)
def test_padding_changes_nothing(models, path, stress):
    """Padding edges beside 116 (fast: 32) real ones: energy, forces and virial are
    those of the unpadded step. Every padding term is an exact zero added at the end
    of each atom's sums; what differs is the GEMMs over edges, whose kernels
    block by E and so may round the last bit of a row differently (2e-19 eV/A
    measured on the CPU)."""
    model = models[path]
    pos, numbers, graph = _inputs(cutoff=model.config.cutoff)
    with options.use(**PATHS[path]):
        e, f = force_step(model, pos, numbers, graph)
        step = GraphStep(model, numbers, stress=stress, graphs=False)
        out = step(pos, graph)
    E = graph.n_edges
    assert step.capacity >= step.headroom * E and step.capacity % CAPACITY_QUANTUM == 0
    assert rel_err(out.energy, e) < 1e-13 and rel_err(out.forces, f) < 1e-12
    assert (out.virial is not None) == stress


def test_the_padding_is_spread_over_the_atoms(model):
    """The buffers hold a valid dst-sorted CSR graph: the real edges in their order,
    each atom's padding at the end of its segment, at most one more on any atom."""
    pos, numbers, graph = _inputs()
    step = GraphStep(model, numbers, capacity=graph.n_edges + 21, graphs=False)
    step(pos, graph)
    with HostSyncAudit() as audit:  # the per-step load is sync-free as well
        step._load(pos, graph)
    audit.assert_none()
    src, dst, shifts, row_ptr = step._src, step._dst, step._shifts, step._row_ptr
    ecekern.reference.check_csr(dst, row_ptr, step.capacity, dst.device)
    pad = (src == dst) & (shifts == 0).all(-1)
    assert int(pad.sum()) == step.capacity - graph.n_edges
    per_atom = torch.bincount(dst[pad], minlength=8)
    assert int(per_atom.max() - per_atom.min()) <= 1
    assert torch.equal(src[~pad], graph.src) and torch.equal(dst[~pad], graph.dst)
    assert torch.equal(shifts[~pad], graph.shifts)
    for n in range(8):  # padding last in each segment
        seg = pad[row_ptr[n] : row_ptr[n + 1]]
        assert torch.equal(seg, torch.sort(seg.int()).values.bool())


def test_the_virial_matches_the_calculator_stress(model):
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=3)
    atoms.calc = ECECalculator(model, device=DEV, graph_step=False)
    want = atoms.get_stress()
    pos, numbers, graph = prepare_inputs(atoms, TINY.cutoff, torch.float64, DEV)
    virial = GraphStep(model, numbers, stress=True, graphs=False)(pos, graph).virial
    sigma = 0.5 * (virial + virial.T).cpu().numpy() / atoms.cell.volume
    got = np.array([sigma[i, j] for i, j in ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2),
                                             (0, 1))])  # fmt: skip
    assert np.abs(got - want).max() < 1e-12 * max(1.0, np.abs(want).max())


def test_capacity_grows_past_an_overflow(model):
    pos, numbers, graph = _inputs()
    step = GraphStep(model, numbers, capacity=8, graphs=False)
    assert step.capacity == CAPACITY_QUANTUM  # rounded up
    out = step(pos, graph)
    big = ecekern.ECEConfig(**{**TINY.to_dict(), "cutoff": 4.0})
    model4 = ecekern.ECEModel(big).double().to(DEV)
    step4 = GraphStep(model4, numbers, capacity=8, headroom=1.5, graphs=False)
    _, _, g4 = prepare_inputs(ecekern.systems.diamond(1, rattle=0.1, seed=1), 4.0,
                              torch.float64, DEV)  # fmt: skip
    assert g4.n_edges > CAPACITY_QUANTUM
    out4 = step4(pos, g4)
    assert step4.capacity >= 1.5 * g4.n_edges and step4.capacity % CAPACITY_QUANTUM == 0
    e4, f4 = force_step(model4, pos, numbers, g4)
    assert rel_err(out4.forces, f4) < 1e-12 and rel_err(out4.energy, e4) < 1e-13
    e, f = force_step(model, pos, numbers, graph)
    assert rel_err(out.forces, f) < 1e-12


@pytest.mark.filterwarnings("ignore::ecekern.options.FallbackWarning")
def test_the_calculator_with_the_graph_step_gives_the_same_stress(model):
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=4)
    atoms.calc = ECECalculator(model, device=DEV, graph_step=False)
    want = atoms.get_stress(), atoms.get_forces(), atoms.get_potential_energy()
    again = atoms.copy()
    again.calc = ECECalculator(model, device=DEV, graph_step=True)
    got = again.get_stress(), again.get_forces(), again.get_potential_energy()
    for a, b in zip(got, want):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-12


def test_a_hand_made_graph_is_checked_once(model):
    """A Graph not from build_graph is checked at first use (host syncs, once): an
    unsorted one is a ValueError, never a wrong energy."""
    from ecekern.graph import Graph

    pos, numbers, graph = _inputs()
    perm = torch.randperm(graph.n_edges, generator=torch.Generator().manual_seed(0))
    shuffled = Graph(graph.src[perm.to(DEV)], graph.dst[perm.to(DEV)],
                     graph.shifts[perm.to(DEV)], graph.row_ptr, graph.cell,
                     cutoff=graph.cutoff)  # fmt: skip
    step = GraphStep(model, numbers, graphs=False)
    with pytest.raises(ValueError, match="sorted|CSR"):
        step(pos, shuffled)
    with pytest.raises(ValueError, match="sorted|CSR"):
        model(pos, numbers, shuffled)
    same = Graph(
        graph.src, graph.dst, graph.shifts, graph.row_ptr, graph.cell, cutoff=2.6
    )
    with HostSyncAudit() as first:
        model(pos, numbers, same)
    with HostSyncAudit() as again:
        model(pos, numbers, same)
    assert first.syncs > 0 and again.syncs == 0 and same.checked


@pytest.mark.filterwarnings("ignore::ecekern.options.FallbackWarning")
def test_the_calculator_follows_a_replaced_model(model):
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=4)
    atoms.calc = ECECalculator(model, device=DEV, graph_step=True)
    e1 = atoms.get_potential_energy()
    other = ecekern.ECEModel(ecekern.ECEConfig(**{**TINY.to_dict(), "seed": 7}))
    atoms.calc.model = other.double().to(DEV)
    atoms.calc.reset()
    e2 = atoms.get_potential_energy()
    want, _ = ecekern.energy_and_forces(atoms.calc.model, atoms)
    assert e2 != e1 and abs(e2 - float(want)) < 1e-12


def test_atoms_without_edges(model):
    """Two atoms 10 A apart in a large box: no real edge, only padding."""
    from ase import Atoms

    atoms = Atoms("CO", positions=[[0, 0, 0], [10, 0, 0]], cell=[30] * 3, pbc=True)
    pos, numbers, graph = prepare_inputs(atoms, TINY.cutoff, torch.float64, DEV)
    assert graph.n_edges == 0
    out = GraphStep(model, numbers, graphs=False)(pos, graph)
    e, f = force_step(model, pos, numbers, graph)
    assert torch.equal(out.energy, e) and torch.equal(out.forces, f)
    assert torch.all(out.forces == 0)


@pytest.mark.parametrize(
    "change, err, match",
    [
        ("positions", ValueError, r"\(8, 3\)"),
        ("dtype", TypeError, "float32"),
        ("graph", TypeError, "ecekern.Graph"),
        ("padded", ValueError, "padded"),
        ("nodes", ValueError, "nodes"),
        ("cutoff", ValueError, r"built with cutoff 3 A but the model's cutoff is 2\.6"),
    ],
)
def test_bad_step_inputs(model, change, err, match):
    import dataclasses

    pos, numbers, graph = _inputs()
    step = GraphStep(model, numbers, graphs=False)
    if change == "positions":
        pos = pos[:5]
    elif change == "dtype":
        pos = pos.float()
    elif change == "graph":
        graph = (graph.src, graph.dst)
    elif change == "padded":
        graph = dataclasses.replace(graph, padded=True)
    elif change == "nodes":
        graph = dataclasses.replace(graph, row_ptr=graph.row_ptr[:-1])
    elif change == "cutoff":  # the same edges, said to be searched at 3 A
        graph = dataclasses.replace(graph, cutoff=3.0)
    with pytest.raises(err, match=match):
        step(pos, graph)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call")
def test_a_compiled_model_steps(model):
    """``torch.compile(model)`` is accepted: the ECEModel inside gives the species
    check, dtype, device and cutoff, the compiled module computes (Dynamo's eager
    backend here: the CPU test stays fast)."""
    pos, numbers, graph = _inputs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    step = GraphStep(compiled, numbers, graphs=False)
    assert step.model is compiled and step.cutoff == TINY.cutoff
    out = step(pos, graph)
    e, f = force_step(model, pos, numbers, graph)
    assert rel_err(out.energy, e) < 1e-12 and rel_err(out.forces, f) < 1e-12
    with pytest.raises(ValueError, match="built with cutoff 3 A"):
        step(pos, dataclasses.replace(graph, cutoff=3.0))


def test_bad_step_construction(model):
    _, numbers, _ = _inputs()
    with pytest.raises(ValueError, match="among the model's species"):
        GraphStep(model, torch.full_like(numbers, 92))
    with pytest.raises(ValueError, match="at least one atom"):
        GraphStep(model, numbers[:0])
    with pytest.raises(ValueError, match="headroom"):
        GraphStep(model, numbers, headroom=0.5)
    with pytest.raises(ValueError, match="capacity"):
        GraphStep(model, numbers, capacity=-1)
    with pytest.raises(TypeError, match="ECEModel"):
        GraphStep(torch.nn.Linear(3, 1), numbers)


@pytest.mark.skipif(DEV == "cuda", reason="the fallback is the CPU's")
def test_graphs_on_the_cpu_fall_back_loudly(model):
    _, numbers, _ = _inputs()
    options.reset_fallback_warnings()
    with pytest.warns(FallbackWarning, match="CUDA graphs need a CUDA device"):
        step = GraphStep(model, numbers, graphs=True)
    assert not step.graphs


# 3. molecular dynamics ----------------------------------------------------------------
def _nve(model, graph_step, steps=12):
    """Energies along an NVE run, and the edge count at each step."""
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=5)
    atoms.set_momenta(np.random.default_rng(0).normal(0, 0.3, (len(atoms), 3)))
    atoms.calc = ECECalculator(model, device=DEV, graph_step=graph_step)
    energies, n_edges = [], []

    def record():
        energies.append(atoms.get_total_energy())
        cell = torch.as_tensor(atoms.cell.array)
        pos = torch.as_tensor(atoms.positions)
        n_edges.append(build_graph(pos, cell, True, model.config.cutoff).n_edges)

    dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)
    dyn.attach(record, interval=1)
    dyn.run(steps)
    return np.array(energies), atoms, n_edges


@pytest.mark.filterwarnings("ignore::ecekern.options.FallbackWarning")
def test_nve_with_the_graph_step_equals_nve_without(model):
    """The neighbour list changes as the atoms move (98 to 102 edges); the padded
    step follows it with the same energies."""
    e_eager, _, _ = _nve(model, False)
    e_graph, atoms, n_edges = _nve(model, True)
    assert len(set(n_edges)) > 1
    assert np.abs(e_graph - e_eager).max() < 1e-10
    assert atoms.calc._step.capacity >= 1.05 * max(n_edges[:1])


# 4. on the GPU ------------------------------------------------------------------------
def _gpu_system(repeats=2, dtype=torch.float32):
    cfg = ecekern.ECEConfig()
    model = ecekern.ECEModel(cfg).to("cuda", dtype)
    atoms = ecekern.systems.diamond(repeats, rattle=0.1, seed=2)
    return model, *prepare_inputs(atoms, cfg.cutoff, dtype, "cuda")


@pytest.mark.gpu
def test_gpu_force_step_under_sync_debug_mode_error():
    """The device's own check: any synchronising CUDA call in the step raises."""
    model, pos, numbers, graph = _gpu_system()
    force_step(model, pos, numbers, graph)  # compile, check the species, fill caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        e, f = force_step(model, pos, numbers, graph)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with HostSyncAudit() as audit:  # and no host-to-device copy either
        force_step(model, pos, numbers, graph)
    audit.assert_none()
    assert torch.isfinite(f).all()


def _close(a, b, model, pos, numbers, graph, which):
    """float64: within 1e-12. float32: the three-way rule against a float64 copy of
    the model on the same inputs (these forces are small differences of large terms,
    so two float32 sums in another order differ by 1e-5 of them)."""
    if a.dtype == torch.float64:
        assert rel_err(a, b) < 1e-12, which
        return
    g64 = dataclasses.replace(graph, cell=graph.cell.double())
    e, f = force_step(copy.deepcopy(model).double(), pos.double(), numbers, g64)
    truth = {"energy": e, "forces": f}[which]
    assert_close_three_way(a, b, truth, which)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpu_replay_equals_eager(dtype):
    model, pos, numbers, graph = _gpu_system(dtype=dtype)
    eager = GraphStep(model, numbers, stress=True, graphs=False)(pos, graph)
    step = GraphStep(model, numbers, stress=True)
    first = step(pos, graph)
    pos2 = pos + 0.01 * torch.randn_like(pos)
    second = step(pos2, graph)  # new positions, same buffers
    # the same padded step, replayed or eager: the same kernels on the same shapes
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip((first.energy, first.forces, first.virial),
                    (eager.energy, eager.forces, eager.virial)):  # fmt: skip
        assert rel_err(a, b) < tol
    # against the unpadded eager step
    e2, f2 = force_step(model, pos2, numbers, graph)
    _close(second.forces, f2, model, pos2, numbers, graph, "forces")
    _close(second.energy, e2, model, pos2, numbers, graph, "energy")
    again = step(pos2, graph)  # a replay launches the same kernels again
    assert rel_err(again.forces, second.forces) < tol
    assert step.captures == 1
    with torch.no_grad():  # an in-place update of a parameter reaches the replay
        model.species_energy.add_(0.25)
    e3, _ = force_step(model, pos2, numbers, graph)
    _close(step(pos2, graph).energy, e3, model, pos2, numbers, graph, "energy")
    assert step.captures == 1
    with options.use(reference=True):  # other kernels: captured again
        ref = step(pos2, graph)
        e_ref, f_ref = force_step(model, pos2, numbers, graph)
        assert step.captures == 2
        _close(ref.forces, f_ref, model, pos2, numbers, graph, "forces")


@pytest.mark.gpu
def test_gpu_capacity_overflow_recaptures(caplog):
    model, pos, numbers, graph = _gpu_system(dtype=torch.float64)
    step = GraphStep(model, numbers, capacity=graph.n_edges // 2)
    with caplog.at_level(logging.INFO, logger="ecekern.graph_step"):
        out = step(pos, graph)
    assert step.captures == 1 and "capturing" in caplog.text
    small = GraphStep(model, numbers, headroom=1.0)
    keep = edge_vectors(pos, graph).norm(dim=-1) < 3.0  # fewer edges first
    sub = ecekern.Graph(graph.src[keep], graph.dst[keep], graph.shifts[keep],
                        csr_row_ptr(graph.dst[keep], graph.n_nodes), graph.cell,
                        cutoff=graph.cutoff)  # fmt: skip
    small(pos, sub)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ecekern.graph_step"):
        again = small(pos, graph)
    assert small.captures == 2 and "exceed the capacity" in caplog.text
    e, f = force_step(model, pos, numbers, graph)
    assert rel_err(out.forces, f) < 1e-12 and rel_err(again.forces, f) < 1e-12


@pytest.mark.gpu
def test_gpu_nve_with_graphs_equals_eager():
    model = ecekern.ECEModel(TINY).double().to("cuda")
    e_eager, _, _ = _nve(model, False, steps=20)
    e_graph, atoms, _ = _nve(model, True, steps=20)
    assert atoms.calc._step.captures >= 1
    assert np.abs(e_graph - e_eager).max() < 1e-10
