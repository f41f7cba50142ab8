"""The carbon dataset: its generators, splits, file round trip and stored labels."""

import json

import numpy as np
import pytest

from ecekern.data import carbon

CRYSTALS = ("diamond", "graphite", "graphene")


def _rng(i):
    return np.random.default_rng([123, i])


@pytest.mark.parametrize("family", CRYSTALS)
def test_crystal_generators_make_valid_structures(family):
    for p in range(6):
        frames = carbon.GENERATORS[family](_rng(p))
        assert len(frames) == carbon.FRAMES[family]
        for atoms in frames:
            assert 32 <= len(atoms) <= 64
            assert atoms.pbc.all() and set(atoms.get_chemical_symbols()) == {"C"}
            assert carbon.min_distance(atoms) >= carbon.DMIN
            assert 0.02 <= atoms.info["rattle"] <= 0.15
        # rattled copies of one strained cell: same cell, different positions
        assert all(np.allclose(a.cell, frames[0].cell) for a in frames)
        assert not np.allclose(frames[0].positions, frames[1].positions)


def test_graphene_vacuum_and_graphite_layer_spacing():
    for p in range(6):
        sheet = carbon.graphene(_rng(p))[0]
        z = sheet.positions[:, 2]
        assert sheet.cell[2, 2] - (z.max() - z.min()) >= 10.0
        assert np.allclose(sheet.cell[2, :2], 0) and np.allclose(sheet.cell[:2, 2], 0)
        stack = carbon.graphite(_rng(p))[0]
        z = np.sort(stack.positions[:, 2])
        n_layers = 1 + int((np.diff(z) > 1.5).sum())
        spacing = stack.cell[2, 2] / n_layers
        assert n_layers == 2  # one AB pair per cell
        repeats = np.linalg.norm(stack.cell[:2], axis=1) / carbon.A_GRAPHITE
        assert sorted(np.round(repeats).astype(int)) in ([3, 4], [3, 5], [4, 4])
        c0 = carbon.C_GRAPHITE / 2
        assert 0.9 * c0 - 1e-9 <= spacing <= 1.15 * c0 + 1e-9


def test_diamond_strain_range():
    for p in range(10):
        atoms = carbon.diamond(_rng(p))[0]
        reps = len(atoms) // 8
        volume_per_cell = atoms.get_volume() / reps
        linear = (volume_per_cell / carbon.A_DIAMOND**3) ** (1 / 3) - 1
        assert -0.065 <= linear <= 0.065


def test_random_packing_density_and_distance():
    rng = np.random.default_rng(0)
    for n, rho in ((32, 1.5), (48, 2.5), (64, 3.5)):
        atoms = carbon.random_packing(n, rho, rng)
        assert len(atoms) == n
        assert carbon.density(atoms) == pytest.approx(rho, rel=1e-12)
        assert carbon.min_distance(atoms) >= carbon.DMIN
    with pytest.raises(ValueError, match="rho > 0"):
        carbon.random_packing(32, 0.0, rng)
    with pytest.raises(RuntimeError, match="placed"):
        carbon.random_packing(64, 3.5, rng, dmin=2.0)  # no room for 2 A spheres


def test_amorphous_packings_without_quench():
    densities = []
    for p in range(8):
        (atoms,) = carbon.amorphous(_rng(p), n_frames=1)
        assert len(atoms) in carbon.SIZES
        rho = carbon.density(atoms)
        assert 1.5 <= rho <= 3.5
        assert rho == pytest.approx(atoms.info["density"], rel=1e-12)
        assert carbon.min_distance(atoms) >= carbon.DMIN
        densities.append(rho)
    assert np.ptp(densities) > 0.5  # the family spans densities


@pytest.mark.slow  # xTB MD in the test: a quarter of a minute
def test_liquid_trajectory_frames():
    pytest.importorskip("tblite")
    failures = []
    frames = carbon.liquid(_rng(0), n_frames=2, failures=failures)
    assert failures == [] and len(frames) == 2
    every, equilibrate = carbon.LIQUID["every"], carbon.LIQUID["equilibrate"]
    assert [a.info["step"] for a in frames] == [equilibrate, equilibrate + every]
    for atoms in frames:
        assert len(atoms) in carbon.SIZES and atoms.get_momenta().max() == 0
        assert 1.8 <= carbon.density(atoms) <= 3.2
        assert 3000 <= atoms.info["temperature_K"] <= 6000
    assert not np.allclose(frames[0].positions, frames[1].positions)


def test_assign_splits_by_parent():
    splits = carbon.assign_splits(120, seed=0, family="amorphous")
    assert [splits.count(s) for s in ("train", "val", "test")] == [96, 12, 12]
    assert splits == carbon.assign_splits(120, seed=0, family="amorphous")
    assert splits != carbon.assign_splits(120, seed=1, family="amorphous")
    assert carbon.assign_splits(3, seed=0, family="liquid") == ["train"] * 3


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m ecekern.data.carbon"):
        carbon.load(tmp_path / "absent.extxyz.xz")


def test_build_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="scale"):
        carbon.build(tmp_path, scale=0)
    with pytest.raises(ValueError, match="unknown families"):
        carbon.build(tmp_path, families=("diamond", "fullerene"))


def test_label_drops_failed_scf():
    tblite_ase = pytest.importorskip("tblite.ase")
    atoms = carbon.diamond(_rng(0))[0]
    starved = lambda: tblite_ase.TBLite(  # noqa: E731
        method="GFN1-xTB", max_iterations=2, verbosity=0
    )
    assert carbon.label(atoms, calc_factory=starved) is None


@pytest.mark.slow  # a small generation labelled with xTB: half a minute
def test_tiny_run_writes_readable_labelled_file(tmp_path):
    pytest.importorskip("tblite")
    families = ("diamond", "amorphous")
    args = ["--out", str(tmp_path), "--scale", "0.01"]
    carbon.main([*args, "--families", ",".join(families)])
    frames = carbon.load(tmp_path / "carbon_gfn1.extxyz.xz")
    assert len(frames) == sum(carbon.FRAMES[f] for f in families)
    parent_split = {}
    for atoms in frames:
        assert np.isfinite(atoms.get_potential_energy())
        assert atoms.get_forces().shape == (len(atoms), 3)
        assert atoms.get_stress().shape == (6,)
        assert atoms.info["family"] in families
        assert atoms.info["split"] in ("train", "val", "test")
        split = parent_split.setdefault(atoms.info["parent"], atoms.info["split"])
        assert split == atoms.info["split"]
    assert {a.info["family"] for a in frames} == set(families)
    # quench frames follow one trajectory: the energy drops along it
    quench = [a for a in frames if a.info["family"] == "amorphous"]
    assert [a.info["index"] for a in quench] == [0, 1, 2]
    assert quench[-1].get_potential_energy() < quench[0].get_potential_energy()
    prov = json.loads((tmp_path / "carbon_gfn1.json").read_text())
    assert prov["complete"] and prov["n_structures"] == len(frames)
    assert prov["calculator"]["method"] == "GFN1-xTB"
    assert prov["families"]["diamond"]["scf_failures_dropped"] == 0
    # the same seed reproduces the same structures
    again = carbon.diamond(np.random.default_rng([0, 0, 0]))
    assert np.allclose(again[0].positions, frames[0].positions, atol=1e-7)


def test_shipped_labels_reproduce():
    pytest.importorskip("tblite")
    rows = carbon.reproduce(n=2, seed=0)
    assert len(rows) == 2
    for row in rows:
        assert row["energy_per_atom"] < 1e-6, row
        assert row["forces"] < 1e-5, row
        assert row["stress"] < 1e-6, row


def test_shipped_file_splits_are_disjoint_by_parent():
    frames = carbon.load()
    assert carbon.DEFAULT_PATH.stat().st_size <= 10 * 2**20
    parent_split = {}
    for atoms in frames:
        assert 32 <= len(atoms) <= 64
        split = parent_split.setdefault(atoms.info["parent"], atoms.info["split"])
        assert split == atoms.info["split"], atoms.info["parent"]
    families = {a.info["family"] for a in frames}
    assert families == set(carbon.FAMILIES)
    for family in families:
        splits = {a.info["split"] for a in frames if a.info["family"] == family}
        assert splits == {"train", "val", "test"}, family
