"""Bad input never crashes or lies: each public entry point (``neighbor_list``,
``build_graph``, ``energy_and_forces``, ``ECEConfig``, ``ECEModel``) refuses it with a
ValueError or TypeError that names the problem and the fix.

The inputs that used to kill the interpreter inside vesin (SIGFPE, exit code 136, no
traceback), hang it or exhaust its memory run in one subprocess, so a regression fails
these tests instead of killing pytest."""

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from ase import Atoms

import ecekern
from ecekern.graph import MIN_DISTANCE, build_graph, neighbor_list

SMALL = ecekern.ECEConfig(channels=4, radial_hidden=8, readout_hidden=4)

# ----------------------------------------------------------------------------------
# Crash, hang and out-of-memory cases, in a subprocess
# ----------------------------------------------------------------------------------
_SETUP = """
import json, sys, time
import numpy as np, torch, ecekern
from ase import Atoms
from ecekern.graph import build_graph, neighbor_list

atoms = ecekern.systems.diamond(1)
pos, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
model = ecekern.ECEModel(
    ecekern.ECEConfig(channels=4, radial_hidden=8, readout_hidden=4)
)

def with_cell(c):
    a = atoms.copy()
    a.cell = c
    return a

nan_cell = cell.clone()
nan_cell[0, 0] = float("nan")
inf_cell = cell.clone()
inf_cell[1, 1] = float("inf")
rng = np.random.default_rng(0)
u = rng.random((8, 3))
molecule = torch.tensor(u * 3)
far = torch.tensor([[0.0, 0, 0], [6e5, 0, 0]])
"""

# name: (statement, error type, regex the message must match); every one of them
# crashed, hung, exhausted memory or returned a wrong neighbour list before the checks
CRASHES = {
    # SIGFPE in vesin (exit 136)
    "NaN cell, neighbor_list": (
        "neighbor_list(pos, nan_cell, True, 5.0)",
        ValueError,
        "cell contains NaN",
    ),
    "inf cell, build_graph": (
        "build_graph(pos, inf_cell, True, 5.0)",
        ValueError,
        "cell contains NaN or infinity",
    ),
    "NaN cell, energy_and_forces": (
        "ecekern.energy_and_forces(model, with_cell(nan_cell.numpy()))",
        ValueError,
        "cell contains NaN",
    ),
    "cell vector 1e200 A": (
        "neighbor_list(pos, cell * 1e200, True, 5.0)",
        ValueError,
        "MAX_COORDINATE",
    ),
    "molecule with a coordinate 1.7e308": (
        "neighbor_list(torch.tensor([[0.0, 0, 0], [1.7e308, 0, 0]], dtype=cell.dtype),"
        " cell, False, 5)",
        ValueError,
        "MAX_COORDINATE",
    ),
    "molecule spanning 2e20 A": (
        "neighbor_list(torch.tensor([[-1e20, 0, 0], [1e20, 0, 0.0]]), cell, False, 5)",
        ValueError,
        "MAX_COORDINATE",
    ),
    "molecule with an atom 6e5 A away": (
        "neighbor_list(far, torch.zeros(3, 3), False, 5.0)",
        ValueError,
        "too elongated.*remove far-away atoms",
    ),
    "wire with an atom 1e6 A off its axis": (
        "neighbor_list(molecule + torch.tensor([0, 1e6, 0]) * (torch.arange(8) == 0)"
        "[:, None], torch.eye(3, dtype=torch.float64) * 3, [True, False, False], 2)",
        ValueError,
        "too elongated",
    ),
    "periodic 3000 x 3000 x 5 A cell": (
        "neighbor_list(molecule, torch.diag(torch.tensor([3e3, 3e3, 5.0])), True, 5)",
        ValueError,
        "too elongated.*repeat it along its short directions",
    ),
    # vesin out of memory, or hung for minutes
    "diamond, cutoff 1e3 A": (
        "neighbor_list(pos, cell, True, 1e3)",
        ValueError,
        r"5\.9e\+09 edges.*smaller cutoff",
    ),
    "diamond, cutoff 1e4 A": (
        "neighbor_list(pos, cell, True, 1e4)",
        ValueError,
        "edges.*smaller cutoff",
    ),
    "diamond, cutoff 1e8 A": (
        "build_graph(pos, cell, True, 1e8)",
        ValueError,
        "edges.*smaller cutoff",
    ),
    "molecule, cutoff 1e4 A": (
        "neighbor_list(molecule, torch.zeros(3, 3), False, 1e4)",
        ValueError,
        "atoms span only .* A along axis .* smaller cutoff",
    ),
    "cell of 1e-5 A": (
        "neighbor_list(pos * 1e-5, cell * 1e-5, True, 2.0)",
        ValueError,
        "3.57e-05 A from its opposite face",
    ),
    "unreduced cell, one face 1e-6 A from the other": (
        "c = np.array([[1.0, 0, 0], [0, 1, 0], [1e6, 0, 1]]);"
        "neighbor_list(torch.tensor(u @ c), c, True, 2.0)",
        ValueError,
        "niggli_reduce",
    ),
    # silently wrong: vesin's int32 search range overflowed and 1,720 edges came back
    "diamond, cutoff 1e10 A": (
        "neighbor_list(pos, cell, True, 1e10)",
        ValueError,
        "edges.*smaller cutoff",
    ),
}


@pytest.fixture(scope="module")
def crash_results():
    """Run every case of CRASHES in one fresh interpreter (importing torch costs
    seconds); ``{name: (error type, message, seconds)}``, plus how it ended."""
    lines = [_SETUP, "cases = ["]
    for name, (stmt, _, _) in CRASHES.items():
        lines.append(f"    ({name!r}, {stmt!r}),")
    lines.append("]")
    lines.append(
        textwrap.dedent(
            """
            for name, stmt in cases:
                print(json.dumps({"start": name}), flush=True)
                t = time.perf_counter()
                try:
                    exec(stmt)
                    kind, msg = "no error", ""
                except Exception as e:
                    kind, msg = type(e).__name__, str(e)
                out = {"name": name, "kind": kind, "msg": msg,
                       "seconds": time.perf_counter() - t}
                print(json.dumps(out), flush=True)
            """
        )
    )
    try:
        run = subprocess.run(
            [sys.executable, "-c", "\n".join(lines)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        stdout = run.stdout
        ended = f"exit code {run.returncode}; stderr: {run.stderr[-1500:]}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        stdout = out.decode() if isinstance(out, bytes) else out
        ended = "timeout after 300 s"
    results, last = {}, None
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if "start" in rec:
            last = rec["start"]
        else:
            results[rec["name"]] = (rec["kind"], rec["msg"], rec["seconds"])
    return results, last, ended


@pytest.mark.parametrize("name", list(CRASHES))
def test_crash_cases_raise_a_clear_error_fast(crash_results, name):
    results, last, ended = crash_results
    if name not in results:
        where = "in this case" if name == last else f"before it, in {last!r}"
        pytest.fail(f"the interpreter died {where} (-8 or 136 is SIGFPE): {ended}")
    kind, msg, seconds = results[name]
    _, err, pattern = CRASHES[name]
    assert kind == err.__name__, f"{kind}: {msg}"
    assert re.search(pattern, msg), msg
    assert seconds < 2.0, f"took {seconds:.1f} s"


# ----------------------------------------------------------------------------------
# Degenerate cells and searches too large (in process: these never crashed)
# ----------------------------------------------------------------------------------
def test_flat_cell_is_refused_with_the_fix():
    """5 x 5 x 1e-11 A: passed the old |det| > 1e-12 test and returned 22 edges."""
    c = np.diag([5.0, 5.0, 1e-11])
    x = np.random.default_rng(1).random((8, 3)) @ c
    with pytest.raises(ValueError, match="1e-11 A from its opposite face") as info:
        neighbor_list(x, c, True, 5.0)
    msg = str(info.value)
    assert "edges" in msg and "pbc False in direction 2" in msg
    atoms = Atoms("C8", positions=x, cell=c, pbc=True)
    with pytest.raises(ValueError, match="opposite face"):
        ecekern.energy_and_forces(ecekern.ECEModel(SMALL), atoms)
    # the same thin direction, not periodic, is fine: vesin ignores that vector
    src, _, _ = neighbor_list(x, c, [True, True, False], 5.0)
    assert len(src) > 0


def test_max_edges_is_a_stated_limit():
    atoms = ecekern.systems.diamond(2)
    x, c = atoms.positions, atoms.cell.array
    n = len(neighbor_list(x, c, True, 5.0)[0])  # 5,800 or so
    with pytest.raises(ValueError, match=r"about 5\.\de\+03 edges.*max_edges = 1e\+03"):
        neighbor_list(x, c, True, 5.0, max_edges=1000)
    assert build_graph(x, c, True, 5.0, max_edges=6000).n_edges == n
    # a cluster in a large box: the estimate (from the mean density) passes, the
    # count is above the limit: refused after the search
    cluster = atoms.positions[:8] / 2
    with pytest.raises(ValueError, match="56 edges, more than max_edges = 10"):
        build_graph(cluster, np.eye(3) * 20, True, 5.0, max_edges=10)
    with pytest.raises(TypeError):
        neighbor_list(x, c, True, 5.0, max_edges=1e9)
    with pytest.raises(ValueError):
        neighbor_list(x, c, True, 5.0, max_edges=-1)


def test_config_cutoff_has_bounds():
    for bad in (1e10, 101.0, 0.05, 0.0, -1.0, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="ECEConfig.cutoff"):
            ecekern.ECEConfig(cutoff=bad)
    assert ecekern.ECEConfig(cutoff=6).cutoff == 6.0
    with pytest.raises(ValueError, match="cutoff must be a finite number >= "):
        neighbor_list(torch.zeros(1, 3), torch.eye(3), True, 1e-10)
    with pytest.raises(TypeError, match="cutoff must be a number"):
        neighbor_list(torch.zeros(1, 3), torch.eye(3), True, "5")


def test_positions_far_outside_a_periodic_cell():
    atoms = ecekern.systems.diamond(1)
    x = atoms.positions.copy()
    x[3] += 1e5 * atoms.cell.array[0]
    with pytest.raises(ValueError, match=r"atom 3 lies 1e\+05 cell lengths.*wrap"):
        neighbor_list(x, atoms.cell.array, True, 3.0)
    # a few hundred cells away is fine and gives the wrapped atom's edges
    x[3] = atoms.positions[3] + 300 * atoms.cell.array[0]
    a = build_graph(x, atoms.cell.array, True, 3.0)
    b = build_graph(atoms.positions, atoms.cell.array, True, 3.0)
    assert torch.allclose(
        edge_lengths(x, a), edge_lengths(atoms.positions, b), atol=1e-9
    )
    # a molecule far from the origin is fine as well
    far = atoms.positions + 1e7
    a = build_graph(far, np.zeros((3, 3)), False, 3.0)
    b = build_graph(atoms.positions, np.zeros((3, 3)), False, 3.0)
    assert torch.equal(a.src, b.src) and torch.equal(a.dst, b.dst)


def edge_lengths(x, graph):
    from ecekern.graph import edge_vectors

    return edge_vectors(torch.as_tensor(x), graph).norm(dim=-1)


# ----------------------------------------------------------------------------------
# pbc
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pbc",
    ["off", "True", 1, 0, None, [1, 1, 0], (True, "no", True), np.array([1, 1, 0])]
    + [torch.tensor([1, 0, 1]), 1.0],
    ids=repr,
)
def test_pbc_must_be_bools(pbc):
    """``pbc="off"`` used to be read as periodic (a non-empty string is true)."""
    with pytest.raises(TypeError, match="pbc must be a bool or three bools"):
        neighbor_list(torch.zeros(1, 3), torch.eye(3) * 4, pbc, 2.0)


@pytest.mark.parametrize(
    "pbc",
    [
        True,
        np.bool_(True),
        torch.tensor(True),
        np.array(True),
        [True, True, True],
        (np.True_, True, torch.tensor(True)),
        np.array([True] * 3),
        torch.tensor([True] * 3),
    ],
    ids=repr,
)
def test_pbc_bools_of_every_kind(pbc):
    atoms = ecekern.systems.diamond(1)
    want = neighbor_list(atoms.positions, atoms.cell.array, True, 3.0)
    got = neighbor_list(atoms.positions, atoms.cell.array, pbc, 3.0)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_pbc_needs_three_values():
    for pbc in ([True, True], [False] * 4, np.array([True, False])):
        with pytest.raises(ValueError, match="three bools"):
            neighbor_list(torch.zeros(1, 3), torch.eye(3), pbc, 2.0)


# ----------------------------------------------------------------------------------
# Overlapping atoms
# ----------------------------------------------------------------------------------
def test_overlapping_atoms_in_a_molecule():
    """Two atoms at one place gave NaN energy and forces, silently."""
    model = ecekern.ECEModel(SMALL).double()
    atoms = Atoms("CCO", positions=[[0, 0, 0], [1.2, 0, 0], [1.2, 0, 0]])
    with pytest.raises(ValueError, match="atoms 1 and 2 are 0 A apart.*MIN_DISTANCE"):
        ecekern.energy_and_forces(model, atoms)
    atoms.positions[2, 1] = MIN_DISTANCE / 2
    with pytest.raises(ValueError, match="atoms 1 and 2 are 0.05 A apart"):
        build_graph(atoms.positions, np.zeros((3, 3)), False, 5.0)
    with pytest.raises(ValueError, match="closer than MIN_DISTANCE"):
        neighbor_list(atoms.positions, np.zeros((3, 3)), False, 5.0)
    atoms.positions[2, 1] = 1.01 * MIN_DISTANCE  # close, but allowed
    e, f = ecekern.energy_and_forces(model, atoms)
    assert torch.isfinite(e) and torch.isfinite(f).all()


def test_overlapping_atoms_across_a_periodic_boundary():
    model = ecekern.ECEModel(SMALL).double()
    atoms = ecekern.systems.diamond(1)
    atoms.positions[5] = atoms.positions[2] + atoms.cell.array[1]
    with pytest.raises(ValueError, match="the periodic image of atom"):
        ecekern.energy_and_forces(model, atoms)
    # an atom and its own image: a cell thinner than MIN_DISTANCE (and not thin
    # enough for the search to be refused first)
    thin = np.diag([3.0, 3.0, 0.05])
    with pytest.raises(ValueError, match="atom 0 and its own periodic image"):
        neighbor_list(np.zeros((1, 3)), thin, True, 0.5)


# ----------------------------------------------------------------------------------
# Species and configurations
# ----------------------------------------------------------------------------------
def test_species_must_be_atomic_numbers():
    for bad in ((6, -1), (0,), (119,), (6.0,), (True,), (), "CH", (6, 6)):
        with pytest.raises(ValueError, match="from 1 to 118"):
            ecekern.ECEConfig(species=bad)
    with pytest.raises(TypeError, match="sequence of atomic numbers"):
        ecekern.ECEConfig(species=6)
    cfg = ecekern.ECEConfig(species=[np.int64(6), 1])
    assert cfg.species == (6, 1) and type(cfg.species[0]) is int


def test_unknown_atomic_numbers_are_named():
    model = ecekern.ECEModel(SMALL).double()
    atoms = Atoms("CC", positions=[[0, 0, 0], [1.4, 0, 0]])
    atoms.numbers = [6, -3]
    with pytest.raises(ValueError, match=r"\[-3\] are not .* run from 1 to 118"):
        ecekern.energy_and_forces(model, atoms)
    atoms.numbers = [6, 14]
    with pytest.raises(ValueError, match=r"\[14\] .* ECEConfig\(species=\.\.\.\)"):
        ecekern.energy_and_forces(model, atoms)
    pos, numbers, graph = ecekern.model.prepare_inputs(atoms, SMALL.cutoff)
    with pytest.raises(TypeError, match="numbers must be a torch.Tensor"):
        model(pos, [6, 6], graph)
    with pytest.raises(TypeError, match="graph must be an ecekern.Graph"):
        model(pos, numbers, (graph.src, graph.dst))


def test_a_model_without_interactions_is_refused():
    """With n_interactions=0 the readout sees only h[:, 0] = the species embedding:
    the energy would ignore the geometry and every force would be zero."""
    with pytest.raises(ValueError, match="n_interactions must be >= 1.*geometry"):
        ecekern.ECEConfig(n_interactions=0)
    with pytest.raises(ValueError, match="n_interactions must be an int >= 0"):
        ecekern.ECEConfig(n_interactions=-1)
    for k in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="avg_num_neighbors"):
            ecekern.ECEConfig(avg_num_neighbors=k)


# ----------------------------------------------------------------------------------
# dtype and device follow the model
# ----------------------------------------------------------------------------------
def test_energy_and_forces_follows_the_model_and_never_converts_it():
    atoms = ecekern.systems.diamond(1, rattle=0.1)
    model = ecekern.ECEModel(SMALL)  # float32
    e, f = ecekern.energy_and_forces(model, atoms)
    assert e.dtype == f.dtype == torch.float32 and e.device.type == "cpu"
    with pytest.raises(TypeError, match=r"call model\.to\(torch\.float64\) first"):
        ecekern.energy_and_forces(model, atoms, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"call model\.to\('cuda'\) first"):
        ecekern.energy_and_forces(model, atoms, device="cuda")
    assert next(model.parameters()).dtype == torch.float32  # untouched
    model.double()
    e64, f64 = ecekern.energy_and_forces(model, atoms, torch.float64, "cpu")
    e0, _ = ecekern.energy_and_forces(model, atoms, torch.float64, "cpu:0")  # the CPU
    assert float(e0) == float(e64)
    assert e64.dtype == torch.float64 and abs(float(e64) - float(e)) < 1e-4
    with pytest.raises(TypeError, match="dtype must be None"):
        ecekern.energy_and_forces(model, atoms, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"model\.float\(\) or model\.double\(\)"):
        ecekern.energy_and_forces(model.half(), atoms)
    with pytest.raises(TypeError, match="atoms must be an ase.Atoms"):
        ecekern.energy_and_forces(model.double(), atoms.positions)
