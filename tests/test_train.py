"""Training (ecekern.train): batches that agree with the single-system step, the
reference energies, the loss's parameter gradient through the forces, the loop, the
checkpoint it writes and the command line."""

import json

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.lj import LennardJones
from ase.io import write

import ecekern
from ecekern import train
from ecekern.graph import Graph, check_graph
from ecekern.graph_step import eager_step

CFG = dict(lmax=1, channels=4, n_gated=1, n_interactions=1, cutoff=3.0,
           radial_hidden=8, readout_hidden=8, avg_num_neighbors=10.0)  # fmt: skip


def _model(species=(6,), dtype=torch.float64, **kw):
    return ecekern.ECEModel(ecekern.ECEConfig(species=species, **{**CFG, **kw})).to(
        dtype
    )


def _labelled(atoms, family="", split=""):
    atoms.calc = LennardJones(sigma=1.3, epsilon=0.1, rc=3.0, smooth=True)
    atoms.get_potential_energy()
    if all(atoms.pbc):
        atoms.get_stress()
    atoms.info.update(family=family, split=split)
    return atoms


def _structures(n=6, seed=0):
    """Small periodic carbon cells (8 or 16 atoms), strained and rattled, LJ
    labels."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a = bulk("C", "diamond", a=3.57 * (1 + 0.03 * rng.standard_normal()),
                 cubic=True).repeat((1, 1, 1 + i % 2))  # fmt: skip
        a.rattle(0.08, seed=seed * 100 + i)
        out.append(_labelled(a, family="diamond" if i % 2 else "cube"))
    return out


def test_a_batch_is_its_systems_side_by_side():
    """One batch of three systems (a periodic cell, a longer one, a free molecule
    with no stress) gives each system's energy, forces and stress as the
    single-system step does, in float64 to 1e-12."""
    model = _model(species=(1, 6))
    mol = Atoms("CH2", positions=[[0, 0, 0], [1.0, 0.2, 0], [-0.3, 1.0, 0.1]])
    atoms = [*_structures(2), _labelled(mol)]
    samples = [train.from_atoms(a) for a in atoms]
    batch = train.collate(samples, model.config.cutoff, torch.float64)
    assert batch.graph.system is not None and batch.graph.cell.shape == (3, 3, 3)
    assert batch.has_stress.tolist() == [True, True, False]
    energy, forces, stress = train.predict(model, batch, stress=True)
    start = 0
    for b, s in enumerate(samples):
        periodic = all(s.pbc)
        e1, grads = eager_step(model, s.positions, s.numbers,
                               s.graph_at(model.config.cutoff), periodic)  # fmt: skip
        n = s.n_atoms
        assert float(energy[b]) == pytest.approx(float(e1), abs=1e-12)
        torch.testing.assert_close(forces[start : start + n], -grads[0], atol=1e-12,
                                   rtol=0)  # fmt: skip
        if periodic:
            torch.testing.assert_close(stress[b], grads[1] / batch.volume[b],
                                       atol=1e-12, rtol=0)  # fmt: skip
        start += n


def test_reference_energies_are_the_least_squares_fit():
    """Energies made exactly from per-species values are fitted back exactly; one
    element alone gets the mean energy per atom."""
    e = {1: -13.6, 6: -58.0}
    samples = []
    for nh, nc in [(1, 3), (4, 1), (2, 2), (0, 5)]:
        a = Atoms(
            "H" * nh + "C" * nc, positions=np.arange(3 * (nh + nc)).reshape(-1, 3)
        )
        s = train.Sample(torch.tensor(a.positions), torch.tensor(a.numbers),
                         torch.zeros(3, 3), (False,) * 3, nh * e[1] + nc * e[6],
                         torch.zeros(nh + nc, 3))  # fmt: skip
        samples.append(s)
    got = train.fit_reference_energies(samples, (1, 6)).tolist()
    assert got == pytest.approx([e[1], e[6]], abs=1e-9)
    carbon = [s for s in samples if set(s.numbers.tolist()) == {6}]
    only = train.fit_reference_energies(carbon, (6,))
    assert float(only[0]) == pytest.approx(e[6])
    with pytest.raises(ValueError, match="element 1"):
        train.fit_reference_energies(samples, (6,))


def test_the_force_loss_gradient_matches_finite_differences():
    """d loss / d theta through the forces (the mixed second derivative) against
    central differences of the loss, in float64, for entries of the radial MLP, an
    interaction layer and the readout."""
    model = _model()
    batch = train.collate([train.from_atoms(a) for a in _structures(2)],
                          model.config.cutoff, torch.float64)  # fmt: skip
    cfg = train.TrainConfig(energy_weight=1.0, force_weight=1.0, stress_weight=1.0)
    value, _ = train.loss(model, batch, cfg)
    params = dict(model.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(value, list(params.values()),
                                                 allow_unused=True)))  # fmt: skip
    checked = 0
    for name, p in params.items():
        if not any(k in name for k in ("radial.0", "interactions.0", "readout.0")):
            continue
        flat, g = p.data.view(-1), grads[name].reshape(-1)
        for i in (0, flat.numel() // 2):
            old, h = float(flat[i]), 1e-6
            flat[i] = old + h
            up = float(train.loss(model, batch, cfg, create_graph=False)[0])
            flat[i] = old - h
            down = float(train.loss(model, batch, cfg, create_graph=False)[0])
            flat[i] = old
            fd = (up - down) / (2 * h)
            assert float(g[i]) == pytest.approx(fd, rel=1e-5, abs=1e-8), name
            checked += 1
    assert checked >= 6


def test_training_lowers_the_loss_and_the_checkpoint_round_trips(tmp_path):
    """A few epochs on a tiny LJ-labelled set: the training loss falls, the best
    EMA model is saved and loads back with the same energies, its metadata holds
    the validation metrics and the history; the log has one line per epoch."""
    samples = [train.from_atoms(a) for a in _structures(8)]
    model = _model(dtype=torch.float32)
    cfg = train.TrainConfig(epochs=6, batch_size=2, lr=5e-3, warmup_steps=2,
                            patience=100)  # fmt: skip
    out, log = tmp_path / "m.pt", tmp_path / "log.jsonl"
    best = train.fit(model, samples[:6], samples[6:], cfg, out=out, log=log,
                     quiet=True)  # fmt: skip
    hist = best.metadata["history"]
    assert len(hist) == 6 and hist[-1]["train_loss"] < 0.7 * hist[0]["train_loss"]
    assert len(log.read_text().splitlines()) == 6
    loaded = ecekern.ECEModel.load(out)
    b = train.collate(samples[6:], model.config.cutoff, torch.float32)
    e1, f1, _ = train.predict(loaded, b)
    e2, f2, _ = train.predict(best, b)
    assert loaded.metadata["val_metrics"]["n"] == 2
    # the file holds the best epoch's EMA; `best` is that state too
    torch.testing.assert_close(e1, e2)
    torch.testing.assert_close(f1, f2)
    assert float(best.species_energy[0]) == pytest.approx(
        float(train.fit_reference_energies(samples[:6], (6,))[0]), rel=1e-5
    )  # the reference energy is set first and not trained


def test_the_command_line_trains_and_refuses_a_mismatched_checkpoint(tmp_path):
    """``python -m ecekern.train`` on an extxyz with split labels writes a
    checkpoint with test metrics per family; ``--init`` of it with another width is
    refused, naming the field."""
    from ecekern.train.__main__ import main

    atoms = _structures(10)
    for i, a in enumerate(atoms):
        a.info["split"] = "train" if i < 6 else "val" if i < 8 else "test"
    data = tmp_path / "d.extxyz"
    write(data, atoms)
    out = tmp_path / "m.pt"
    args = [str(data), "--out", str(out), "--epochs", "2", "--batch-size", "3",
            "--lmax", "1", "--channels", "4", "--n-interactions", "1",
            "--n-gated", "1", "--cutoff", "3", "--avg-num-neighbors", "10",
            "--state", str(tmp_path / "s.pt")]  # fmt: skip
    assert main(args) == 0
    assert (tmp_path / "s.pt").is_file()  # the resumable state
    m = ecekern.ECEModel.load(out)
    assert m.config.species == (6,) and m.config.channels == 4
    test = m.metadata["test_metrics"]
    assert set(test) == {"all", "cube", "diamond"} and test["all"]["n"] == 2
    assert json.dumps(m.metadata)  # plain values only
    with pytest.raises(SystemExit, match="channels"):
        main([str(data), "--out", str(tmp_path / "x.pt"), "--init", str(out),
              "--channels", "8", "--epochs", "1"])  # fmt: skip


def test_bad_training_input_is_refused(tmp_path):
    """A structure without forces, unknown split labels, a bad TrainConfig and a
    batch graph without its system index are clear errors."""
    a = bulk("C", "diamond", cubic=True)
    with pytest.raises(ValueError, match="no 'energy' label"):
        train.from_atoms(a)
    s = [train.from_atoms(x) for x in _structures(2)]
    s[0].split, s[1].split = "train", "holdout"
    with pytest.raises(ValueError, match="holdout"):
        train.split(s)
    with pytest.raises(ValueError, match="batch_size"):
        train.TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="training and validation"):
        train.fit(_model(), s, [], train.TrainConfig(epochs=1))
    g = train.collate(s, 3.0, torch.float64).graph
    bad = Graph(g.src, g.dst, g.shifts, g.row_ptr, g.cell, cutoff=3.0)
    with pytest.raises(ValueError, match="graph.system"):
        check_graph(bad)
    with pytest.raises(ValueError, match="one system"):
        ecekern.GraphStep(_model(), s[0].numbers)(s[0].positions, g)


def test_the_physics_checks_agree_with_ase(tmp_path):
    """The checks on EMT copper: the Gamma frequencies equal ASE's Phonons (a
    different implementation) to 1e-4 THz, the EOS gives EMT's lattice constant
    (3.59 A) and a bulk modulus near its 134 GPa, and g(r) integrates to 12
    neighbours in the first shell of fcc."""
    from ase.calculators.emt import EMT
    from ase.phonons import Phonons

    from ecekern.train import checks

    a = bulk("Cu", "fcc", a=3.6, cubic=True)
    mine = checks.gamma_frequencies(EMT(), a)
    ph = Phonons(a, EMT(), supercell=(1, 1, 1), delta=0.01, name=str(tmp_path / "ph"))
    ph.run()
    ph.read(acoustic=False)
    theirs = np.sort(ph.band_structure([[0, 0, 0]])[0]) / 4.135667696e-3  # eV -> THz
    np.testing.assert_allclose(mine[3:], theirs[3:], atol=1e-4)
    assert np.abs(mine[:3]).max() < 1e-3  # the translations
    eos = checks.equation_of_state(EMT(), a)
    assert 3.6 * eos["scale"] == pytest.approx(3.59, abs=0.01)
    assert 120 < eos["B_GPa"] < 150
    r, g = checks.rdf([a.repeat(2)], r_max=3.0, n_bins=60)
    rho = len(a) / a.get_volume()
    lo, hi = r - 0.025, r + 0.025  # the bins' edges
    n1 = float((g * rho * 4 / 3 * np.pi * (hi**3 - lo**3)).sum())
    assert n1 == pytest.approx(12.0, rel=1e-9)


def test_a_diverging_run_stops_with_a_clear_error():
    """A learning rate that sends the loss to infinity or NaN ends training with a
    FloatingPointError naming the batch, not with NaN weights."""
    samples = [train.from_atoms(a) for a in _structures(4)]
    cfg = train.TrainConfig(epochs=3, batch_size=2, lr=1e30, warmup_steps=0)
    with pytest.raises(FloatingPointError, match="diverged"):
        train.fit(_model(), samples[:2], samples[2:], cfg, quiet=True)


def test_learning_rate_decays_over_the_time_budget():
    from ecekern.train.loop import _lr

    cfg = train.TrainConfig(epochs=100, lr=1e-3, warmup_steps=10, max_seconds=60.0)
    assert _lr(0, 1000, cfg, 0.0) == pytest.approx(1e-4)
    assert _lr(20, 1000, cfg, 0.0) == pytest.approx(1e-3, rel=1e-3)
    # half the time gone with a tenth of the steps: the cosine is halfway down
    lo = cfg.min_lr_ratio * cfg.lr
    assert _lr(100, 1000, cfg, 30.0) == pytest.approx(lo + (1e-3 - lo) / 2)
    assert _lr(100, 1000, cfg, 90.0) == pytest.approx(lo)
    untimed = train.TrainConfig(epochs=100, lr=1e-3, warmup_steps=10)
    assert _lr(100, 1000, untimed, 90.0) > 0.9e-3


def test_nve_energy_error_scales_as_dt_squared_for_a_smooth_potential():
    from ase.calculators.emt import EMT

    from ecekern.train import checks

    cu = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    rows = checks.nve_energy_error(EMT(), cu, dts_fs=(1.0, 2.0, 4.0), length_fs=100,
                                   temperature_K=600)  # fmt: skip
    assert [r["steps"] for r in rows] == [100, 50, 25]
    ratios = [b["rms_meV_atom"] / a["rms_meV_atom"] for a, b in zip(rows, rows[1:])]
    assert ratios == pytest.approx([4.0, 4.0], rel=0.1)


def test_an_interrupted_run_resumes_to_the_same_model(tmp_path, monkeypatch):
    """A run killed during its third epoch and resumed from its state file ends
    with the weights, EMA and history of the same run uninterrupted (float64, the
    same data and options); the log is appended to; a state of another model is
    refused."""
    from ecekern.train import loop

    samples = [train.from_atoms(a) for a in _structures(8)]
    cfg = train.TrainConfig(epochs=4, batch_size=3, lr=5e-3, warmup_steps=2,
                            patience=100)  # fmt: skip
    whole = train.fit(_model(), samples[:6], samples[6:], cfg, quiet=True)
    state, log = tmp_path / "state.pt", tmp_path / "log.jsonl"
    calls, evaluate = [], loop.evaluate

    def dies_in_epoch_three(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(*args, **kw)

    monkeypatch.setattr(loop, "evaluate", dies_in_epoch_three)
    with pytest.raises(KeyboardInterrupt):
        train.fit(_model(), samples[:6], samples[6:], cfg, state=state, log=log,
                  quiet=True)  # fmt: skip
    monkeypatch.setattr(loop, "evaluate", evaluate)
    assert len(log.read_text().splitlines()) == 2
    other = _model()
    with torch.no_grad():  # weights the state must replace
        for q in other.parameters():
            q.add_(0.1)
    resumed = train.fit(other, samples[:6], samples[6:], cfg, state=state, log=log,
                        quiet=True)  # fmt: skip
    assert len(log.read_text().splitlines()) == 4
    assert [h["epoch"] for h in resumed.metadata["history"]] == [1, 2, 3, 4]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="another model"):
        train.fit(_model(channels=8), samples[:6], samples[6:], cfg, state=state,
                  quiet=True)  # fmt: skip


@pytest.mark.parametrize("suffix", [".xz", ".gz", ".bz2"])
def test_compressed_files_read_as_the_plain_one(tmp_path, suffix):
    """A compressed extxyz (decompressed in memory, not seeked in) gives the plain
    file's samples: positions, energies, forces, stresses and labels."""
    import bz2
    import gzip
    import lzma

    atoms = _structures(3)
    for i, a in enumerate(atoms):
        a.info["split"] = ("train", "val", "test")[i]
    plain = tmp_path / "d.extxyz"
    write(plain, atoms)
    opener = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}[suffix]
    packed = tmp_path / f"d.extxyz{suffix}"
    with opener(packed, "wb") as fh:
        fh.write(plain.read_bytes())
    a, b = train.read(plain), train.read(packed)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert (x.split, x.family, x.energy) == (y.split, y.family, y.energy)
        for name in ("positions", "forces", "stress", "cell"):
            torch.testing.assert_close(getattr(x, name), getattr(y, name), rtol=0,
                                       atol=0)  # fmt: skip
