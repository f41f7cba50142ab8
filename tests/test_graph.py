import numpy as np
import pytest
import torch
from ase import Atoms
from ase.neighborlist import neighbor_list as ase_neighbor_list

import ecekern
from ecekern.graph import build_graph, csr_row_ptr, edge_vectors


def _as_set(src, dst, shifts):
    return set(zip(src.tolist(), dst.tolist(), map(tuple, shifts.tolist())))


def _cells():
    rng = np.random.default_rng(0)
    yield "diamond 2x2x2 (cell < 2 rc)", ecekern.systems.diamond(2), 5.0
    yield (
        "tiny skewed triclinic",
        Atoms(
            "C3",
            positions=rng.random((3, 3)) * 2,
            cell=[[2.0, 0, 0], [0.9, 2.2, 0], [0.3, -0.6, 1.9]],
            pbc=True,
        ),
        4.5,
    )
    yield (
        "one atom, its own images",
        Atoms("C", positions=[[0.1, 0.2, 0.3]], cell=np.eye(3) * 1.7, pbc=True),
        3.0,
    )
    yield (
        "slab: z not periodic",
        Atoms(
            "C6",
            positions=rng.random((6, 3)) * 4,
            cell=[[4.0, 0, 0], [1.5, 3.5, 0], [0, 0, 9]],
            pbc=[True, True, False],
        ),
        3.2,
    )
    yield (
        "wire: only x periodic",
        Atoms(
            "C5",
            positions=rng.random((5, 3)) * 3,
            cell=[[3.0, 0, 0], [0, 8, 0], [0, 0, 8]],
            pbc=[True, False, False],
        ),
        2.9,
    )
    yield (
        "slab with a zero non-periodic cell vector",
        Atoms(
            "C6",
            positions=rng.random((6, 3)) * 4,
            cell=[[4.0, 0, 0], [1.5, 3.5, 0], [0, 0, 0]],
            pbc=[True, True, False],
        ),
        3.1,
    )
    yield (
        "skewed wire: only y periodic, other vectors zero",
        Atoms(
            "C6",
            positions=rng.random((6, 3)) * 4,
            cell=[[0, 0, 0], [0.3, 2.9, 0.4], [0, 0, 0]],
            pbc=[False, True, False],
        ),
        3.1,
    )
    yield (
        "molecule, no cell",
        Atoms("C7", positions=rng.random((7, 3)) * 3, pbc=False),
        2.5,
    )


@pytest.mark.parametrize(
    "name, atoms, rc", list(_cells()), ids=[c[0] for c in _cells()]
)
def test_neighbor_list_equals_ase(name, atoms, rc):
    i, j, S = ase_neighbor_list("ijS", atoms, rc)
    expected = set(zip(j.tolist(), i.tolist(), map(tuple, S.tolist())))
    src, dst, shifts = ecekern.neighbor_list(
        torch.tensor(atoms.positions), torch.tensor(atoms.cell.array), atoms.pbc, rc
    )
    assert src.dtype == dst.dtype == shifts.dtype == torch.int64
    assert _as_set(src, dst, shifts) == expected
    assert len(src) == len(expected)  # no duplicates
    assert bool((dst[1:] >= dst[:-1]).all())
    # the edge vectors are shorter than the cutoff
    pos = torch.tensor(atoms.positions)
    g = build_graph(pos, torch.tensor(atoms.cell.array), atoms.pbc, rc)
    if g.n_edges:
        assert edge_vectors(pos, g).norm(dim=-1).max() < rc


def test_numpy_inputs_and_float32():
    atoms = ecekern.systems.diamond(2)
    a = ecekern.neighbor_list(atoms.positions, atoms.cell.array, True, 3.0)
    b = ecekern.neighbor_list(
        torch.tensor(atoms.positions, dtype=torch.float32),
        atoms.cell.array,
        [True] * 3,
        3.0,
    )
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_order_is_deterministic_and_csr_matches():
    atoms = ecekern.systems.diamond(2, seed=3)
    pos = torch.tensor(atoms.positions)
    g1 = build_graph(pos, torch.tensor(atoms.cell.array), True, 5.0)
    g2 = build_graph(pos.clone(), torch.tensor(atoms.cell.array), True, 5.0)
    assert torch.equal(g1.src, g2.src) and torch.equal(g1.shifts, g2.shifts)
    counts = torch.bincount(g1.dst, minlength=len(atoms))
    assert torch.equal(g1.row_ptr[1:] - g1.row_ptr[:-1], counts)
    assert g1.row_ptr[0] == 0 and g1.row_ptr[-1] == g1.n_edges


def test_the_graph_records_its_cutoff():
    """build_graph sets ``cutoff``; with_cell and dataclasses.replace carry it; a
    Graph made by hand must state it (keyword-only), as a number of Angstrom."""
    import dataclasses

    from ecekern.graph import Graph, with_cell

    atoms = ecekern.systems.diamond(1)
    pos, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
    g = build_graph(pos, cell, True, np.float32(2.5))
    assert g.cutoff == 2.5 and type(g.cutoff) is float
    assert with_cell(g, cell * 1.01).cutoff == 2.5
    assert dataclasses.replace(g, padded=True).cutoff == 2.5
    parts = (g.src, g.dst, g.shifts, g.row_ptr, g.cell)
    with pytest.raises(TypeError, match="cutoff"):
        Graph(*parts)
    with pytest.raises(TypeError, match="cutoff"):
        Graph(*parts, True)  # padded, positionally: the cutoff is still wanted
    assert Graph(*parts, cutoff=4).cutoff == 4.0
    for bad, err in ((None, TypeError), (True, TypeError), ("5", TypeError),
                     (float("nan"), ValueError), (0.01, ValueError)):  # fmt: skip
        with pytest.raises(err, match="Graph.cutoff must be"):
            Graph(*parts, cutoff=bad)
    g.check_cutoff(2.5 * (1 + 1e-12))  # rounding is not a difference
    with pytest.raises(ValueError, match="built with cutoff 2.5 A but the model's"):
        g.check_cutoff(2.6)


def test_csr_row_ptr_with_empty_nodes():
    dst = torch.tensor([0, 0, 2, 2, 2, 5])
    assert csr_row_ptr(dst, 7).tolist() == [0, 2, 2, 5, 5, 5, 6, 6]


def test_empty_and_isolated():
    src, dst, shifts = ecekern.neighbor_list(
        torch.zeros(0, 3), torch.eye(3) * 5, True, 2.0
    )
    assert src.shape == (0,) and shifts.shape == (0, 3)
    far = torch.tensor([[0.0, 0, 0], [10.0, 0, 0]])
    src, dst, _ = ecekern.neighbor_list(far, torch.zeros(3, 3), False, 2.0)
    assert len(src) == 0


def test_standard_systems():
    atoms = ecekern.systems.diamond(4)
    assert len(atoms) == 512 and atoms.pbc.all()
    again = ecekern.systems.diamond(4)
    assert np.array_equal(atoms.positions, again.positions)
    other = ecekern.systems.diamond(4, seed=1)
    assert not np.array_equal(atoms.positions, other.positions)
    src, _, _ = ecekern.neighbor_list(atoms.positions, atoms.cell.array, True, 5.0)
    assert 44_000 < len(src) < 48_000
    with pytest.raises(ValueError):
        ecekern.systems.diamond(0)


@pytest.mark.parametrize(
    "args, err",
    [
        ((torch.zeros(4, 2), torch.eye(3), True, 2.0), ValueError),
        ((torch.zeros(4, 3, dtype=torch.long), torch.eye(3), True, 2.0), TypeError),
        ((torch.zeros(4, 3), torch.eye(2), True, 2.0), ValueError),
        ((torch.zeros(4, 3), torch.zeros(3, 3), True, 2.0), ValueError),
        ((torch.zeros(4, 3), torch.eye(3), [True, True], 2.0), ValueError),
        ((torch.zeros(4, 3), torch.eye(3), True, -1.0), ValueError),
        ((torch.full((4, 3), float("nan")), torch.eye(3), True, 2.0), ValueError),
        (("positions", torch.eye(3), True, 2.0), TypeError),
        ((torch.rand(4, 3), torch.eye(3) * float("nan"), True, 2.0), ValueError),
        ((torch.rand(4, 3), torch.eye(3) * float("inf"), False, 2.0), ValueError),
        ((torch.rand(4, 3), torch.eye(3), "off", 2.0), TypeError),
        ((torch.rand(4, 3), torch.eye(3), True, 0.01), ValueError),
        ((torch.rand(4, 3), torch.eye(3), True, None), TypeError),
        ((torch.zeros(2, 3), torch.eye(3) * 4, False, 2.0), ValueError),  # overlap
        (
            (
                torch.rand(4, 3),
                torch.tensor([[1.0, 0, 0], [2, 0, 0], [0, 0, 1]]),
                True,
                2,
            ),
            ValueError,
        ),  # singular: two parallel periodic vectors
    ],
)
def test_bad_inputs(args, err):
    with pytest.raises(err):
        ecekern.neighbor_list(*args)
    with pytest.raises(err):
        build_graph(*args)


def test_checks_do_not_refuse_a_large_system():
    """The search estimates (edges, cells and pairs checked) pass a 4096-atom box
    and a 3,000-atom molecule with room to spare."""
    atoms = ecekern.systems.diamond(8)
    src, _, _ = ecekern.neighbor_list(atoms.positions, atoms.cell.array, True, 5.0)
    assert 360_000 < len(src) < 370_000
    blob = atoms.positions[:3000] + 50.0
    src, _, _ = ecekern.neighbor_list(blob, np.zeros((3, 3)), False, 5.0)
    assert len(src) > 100_000
