"""Checkpoints (``ECEModel.save`` / ``ECEModel.load``) and the config in the state
dict: round trips give the same energy, and a file or state dict of another model is
refused with an error naming what differs."""

import dataclasses
import io
import warnings

import pytest
import torch

import ecekern
from ecekern import checkpoint
from ecekern.model import ECEModel

TINY = ecekern.ECEConfig(channels=4, n_gated=1, cutoff=3.0, radial_hidden=8,
                         readout_hidden=4)  # fmt: skip


def _other(**changes):
    return ECEModel(dataclasses.replace(TINY, **changes)).double()


@pytest.fixture(scope="module")
def atoms():
    return ecekern.systems.diamond(repeats=1, rattle=0.1, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_gives_the_same_model(tmp_path, atoms, dtype):
    model = ECEModel(dataclasses.replace(TINY, seed=5)).to(dtype)
    with torch.no_grad():  # parameters no fresh model of this seed has
        model.species_energy.add_(0.25)
    e, f = ecekern.energy_and_forces(model, atoms)
    path = tmp_path / "model.pt"
    model.save(path, metadata={"mae": 0.0125, "epochs": [1, 2], "note": None})
    again = ECEModel.load(path)
    assert again.config == model.config and next(again.parameters()).dtype == dtype
    assert again.metadata == {"mae": 0.0125, "epochs": [1, 2], "note": None}
    e2, f2 = ecekern.energy_and_forces(again, atoms)
    assert torch.equal(e2, e) and torch.equal(f2, f)
    # a file object too; metadata defaults to the model's own, so it survives a resave
    buf = io.BytesIO()
    again.save(buf)
    buf.seek(0)
    third = ECEModel.load(buf, map_location="cpu")
    assert third.metadata == again.metadata
    assert torch.equal(ecekern.energy_and_forces(third, atoms)[0], e)


def test_a_checkpoint_holds_plain_containers_only(tmp_path):
    model = ECEModel(TINY)
    model.save(tmp_path / "m.pt")
    data = torch.load(tmp_path / "m.pt", weights_only=True)
    assert data["format"] == checkpoint.FORMAT
    assert data["version"] == checkpoint.FORMAT_VERSION
    assert data["config"] == TINY.to_dict() and data["dtype"] == "float32"
    assert data["state_dict"]["_extra_state"] == {"config": TINY.to_dict()}
    assert data["metadata"] == {} and ECEModel.load(tmp_path / "m.pt").metadata == {}
    with pytest.raises(
        TypeError, match=r"metadata\['fit'\]\['when'\] is a 'object' object"
    ):
        model.save(tmp_path / "bad.pt", metadata={"fit": {"when": object()}})
    with pytest.raises(TypeError, match="metadata must be a dict"):
        model.save(tmp_path / "bad.pt", metadata=[("mae", 1.0)])
    with pytest.raises(TypeError, match="metadata must be a dict"):
        model.metadata = "trained"


def test_files_that_are_not_checkpoints_are_named(tmp_path):
    model = ECEModel(TINY)
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="notes.txt is not an ecekern checkpoint"):
        ECEModel.load(text)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    with pytest.raises(ValueError, match="bare state_dict"):
        ECEModel.load(tmp_path / "sd.pt")
    torch.save(model, tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match="not an ecekern checkpoint"):
        ECEModel.load(tmp_path / "pickled.pt")  # a whole pickled module: code on load
    model.save(tmp_path / "m.pt")
    data = torch.load(tmp_path / "m.pt", weights_only=True)
    torch.save({**data, "version": 99}, tmp_path / "future.pt")
    with pytest.raises(ValueError, match="format version 99; this ecekern reads"):
        ECEModel.load(tmp_path / "future.pt")
    torch.save({**data, "config": {**data["config"], "lmax2": 3}}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"unknown ECEConfig fields \['lmax2'\]"):
        ECEModel.load(tmp_path / "x.pt")
    torch.save({**data, "dtype": "float16"}, tmp_path / "h.pt")
    with pytest.raises(ValueError, match="damaged"):
        ECEModel.load(tmp_path / "h.pt")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"cutoff": 4.0}, r"cutoff 3\.0 \(checkpoint\) vs 4\.0 \(model\)"),
        ({"species": (6, 1, 7, 8)}, r"species \(1, 6, 7, 8\) \(checkpoint\) vs \(6, 1"),
        ({"avg_num_neighbors": 40.0}, r"avg_num_neighbors 90\.0 \(checkpoint\) vs 40"),
        ({"channels": 6}, r"channels 4 \(checkpoint\) vs 6 \(model\)"),
        ({"cutoff": 4.0, "lmax": 1}, r"lmax 2 .* vs 1 \(model\); cutoff 3\.0"),
    ],
)
def test_a_state_dict_of_another_config_is_refused(tmp_path, changes, named):
    """Before any parameter is copied, by name: swapped species or another cutoff
    have the same shapes and would load silently otherwise."""
    a = ECEModel(TINY).double()
    b = _other(**changes)
    before = {k: v.clone() for k, v in b.named_parameters()}
    with pytest.raises(ValueError, match="config differs: " + named):
        b.load_state_dict(a.state_dict())
    assert all(torch.equal(v, before[k]) for k, v in b.named_parameters())
    a.save(tmp_path / "a.pt")  # a checkpoint's state dict, the same
    sd = torch.load(tmp_path / "a.pt", weights_only=True)["state_dict"]
    with pytest.raises(ValueError, match=named):
        b.load_state_dict(sd)


def test_another_seed_loads_and_gives_the_same_energy(atoms):
    """``seed`` draws the initial parameters only: the state dict replaces them."""
    a, b = ECEModel(TINY).double(), _other(seed=11)
    e_a = ecekern.energy_and_forces(a, atoms)[0]
    assert not torch.equal(ecekern.energy_and_forces(b, atoms)[0], e_a)
    b.load_state_dict(a.state_dict())
    assert torch.equal(ecekern.energy_and_forces(b, atoms)[0], e_a)
    assert b.config.seed == 11  # the model's own config is kept


def test_a_state_dict_without_the_config_loads_with_a_warning(atoms):
    a, b = ECEModel(TINY).double(), _other(seed=1)
    old = {k: v for k, v in a.state_dict().items() if k != "_extra_state"}
    with pytest.warns(UserWarning, match="no _extra_state .* shapes alone"):
        b.load_state_dict(old)
    e_a = ecekern.energy_and_forces(a, atoms)[0]
    assert torch.equal(ecekern.energy_and_forces(b, atoms)[0], e_a)
    with pytest.raises(RuntimeError, match="size mismatch"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _other(channels=6).load_state_dict(old)  # the shapes still have to fit
    with pytest.raises(ValueError, match="not an ecekern config"):
        b.load_state_dict({**a.state_dict(), "_extra_state": 3})


def test_the_config_is_checked_inside_a_larger_module():
    """``_extra_state`` is per module: an ECEModel held by another module checks
    its own, under its prefix."""
    outer_a = torch.nn.ModuleDict({"potential": ECEModel(TINY)})
    outer_b = torch.nn.ModuleDict({"potential": _other(cutoff=3.5).float()})
    assert "potential._extra_state" in outer_a.state_dict()
    with pytest.raises(ValueError, match="cutoff 3.0 .checkpoint. vs 3.5"):
        outer_b.load_state_dict(outer_a.state_dict())
    assert ecekern.ECEConfig.from_dict(TINY.to_dict()) == TINY
