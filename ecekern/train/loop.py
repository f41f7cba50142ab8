"""Force-loss training of an :class:`~ecekern.ECEModel`: :func:`predict`,
:func:`loss`, :func:`evaluate` and :func:`fit`.

The loss of a batch of B systems (``n_b`` atoms each) is

    w_E mean_b ((E_b - E*_b) / n_b)^2 + w_F mean_{i,a} (F_ia - F*_ia)^2
        + w_S mean_{b with stress, a, c} (s_bac - s*_bac)^2

with ``F = -dE/dx`` and ``s_b = (dE/d eps_b) / V_b`` (the strain derivative at zero
strain, ASE's sign), in eV per atom, eV/A and eV/A^3. The forces and the stress are
one backward of the energy with ``create_graph=True``; the loss's backward then runs
the *mixed second derivative* ``d^2 E / d theta d x`` through every stage. Every
fast path of the step serves it: its first derivative is a kernel, its second one
differentiable PyTorch (the plan's stages; tested with ``gradgradcheck`` in float64).

:func:`fit` runs AdamW with a linear warm-up and a cosine decay of the learning
rate, an exponential moving average (EMA) of the weights that validation and the
saved model use, and early stopping on the EMA's validation loss. The species'
reference energies (:func:`~ecekern.train.data.fit_reference_energies`) and the
readout's scale (:func:`init_scale`) are set from the training set first.

Status: CPU and CUDA, float32 and float64; batches run eagerly (no CUDA graph).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ..checkpoint import write_whole
from ..graph import Graph
from ..model import unwrap
from .data import Batch, Sample, collate, fit_reference_energies

__all__ = ["TrainConfig", "evaluate", "fit", "init_scale", "loss", "predict"]


@dataclass(frozen=True)
class TrainConfig:
    """What :func:`fit` does: epochs, batch size, AdamW's learning rate and weight
    decay, the warm-up steps and the cosine's floor (``min_lr_ratio``), the loss
    weights of the module docstring, the EMA's decay, the early-stopping patience
    (epochs), the gradient clipping norm, the shuffling seed, and ``max_seconds``:
    stop after the epoch that passes this wall time, the cosine decaying over it
    (None: no limit)."""

    epochs: int = 100
    batch_size: int = 8
    lr: float = 2e-3
    weight_decay: float = 1e-6
    warmup_steps: int = 100
    min_lr_ratio: float = 0.02
    energy_weight: float = 10.0
    force_weight: float = 1.0
    stress_weight: float = 100.0
    ema_decay: float = 0.99
    patience: int = 20
    clip_norm: float = 10.0
    seed: int = 0
    max_seconds: float | None = None

    def __post_init__(self):
        for name in ("epochs", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("lr", "energy_weight", "force_weight", "stress_weight"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"TrainConfig.{name} must be finite and >= 0")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError("TrainConfig.ema_decay must be in [0, 1)")
        for name in ("patience", "warmup_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {v!r}")
        if not self.clip_norm > 0:
            raise ValueError("TrainConfig.clip_norm must be > 0")


def predict(model, batch: Batch, stress: bool = False, create_graph: bool = False):
    """``(energy (B,), forces (N, 3), stress (B, 3, 3) or None)`` of a batch: one
    forward of the whole batch and one backward for the forces (and the strain
    derivative), kept differentiable with ``create_graph``."""
    m = unwrap(model)
    B = batch.n_systems
    with torch.enable_grad():
        x = batch.positions.detach().requires_grad_(True)
        wrt, graph, xs = [x], batch.graph, x
        if stress:
            eps = torch.zeros(B, 3, 3, dtype=x.dtype, device=x.device)
            wrt.append(eps.requires_grad_(True))
            xs = x + (x[:, :, None] * eps[batch.atom_system]).sum(-2)
            cell = graph.cell + (graph.cell[:, :, :, None] * eps[:, None]).sum(-2)
            graph = Graph(graph.src, graph.dst, graph.shifts, graph.row_ptr, cell,
                          cutoff=graph.cutoff, system=graph.system)  # fmt: skip
            object.__setattr__(graph, "checked", batch.graph.checked)
        e_atom = m.atom_energies(xs, batch.numbers, graph)
        energy = torch.zeros(B, dtype=x.dtype, device=x.device)
        energy = energy.index_add(0, batch.atom_system, e_atom)
        grads = torch.autograd.grad(energy.sum(), wrt, create_graph=create_graph)
    forces = -grads[0]
    energy = energy if create_graph else energy.detach()
    if not stress:
        return energy, forces, None
    vol = torch.where(batch.has_stress, batch.volume, torch.ones_like(batch.volume))
    return energy, forces, grads[1] / vol[:, None, None]


def loss(model, batch: Batch, cfg: TrainConfig, create_graph: bool = True):
    """``(loss, parts)``: the weighted loss of the module docstring (a 0-d tensor)
    and its unweighted terms as floats."""
    use_stress = cfg.stress_weight > 0 and bool(batch.has_stress.any())
    energy, forces, stress = predict(model, batch, use_stress, create_graph)
    n = batch.n_atoms.to(energy.dtype)
    parts = {
        "energy": (((energy - batch.energy) / n) ** 2).mean(),
        "forces": ((forces - batch.forces) ** 2).mean(),
    }
    total = cfg.energy_weight * parts["energy"] + cfg.force_weight * parts["forces"]
    if use_stress:
        d = (stress - batch.stress)[batch.has_stress]
        parts["stress"] = (d**2).mean()
        total = total + cfg.stress_weight * parts["stress"]
    return total, {k: float(v.detach()) for k, v in parts.items()}


def evaluate(model, samples: list[Sample], batch_size: int = 8,
             by_family: bool = False) -> dict:  # fmt: skip
    """Errors of ``model`` on ``samples``: energy MAE and RMSE per atom (meV), force
    RMSE and MAE (eV/A, per component), the targets' force RMS, stress RMSE
    (meV/A^3, where labelled) and the count; with ``by_family``, ``{family: ...}``
    with ``"all"`` among them."""
    m = unwrap(model)
    p = next(m.parameters())
    groups = {"all": list(samples)}
    if by_family:
        for s in samples:
            name = s.family or "-"
            groups.setdefault(name if name != "all" else "all (family)", []).append(s)
    out = {}
    for name, group in groups.items():
        de, df, f2, ds = [], [], [], []
        for i in range(0, len(group), batch_size):
            b = collate(group[i : i + batch_size], m.config.cutoff, p.dtype, p.device)
            stress = bool(b.has_stress.any())
            energy, forces, s = predict(m, b, stress)
            de.append(((energy.detach() - b.energy) / b.n_atoms).double().cpu())
            df.append((forces.detach() - b.forces).double().cpu().flatten())
            f2.append(b.forces.double().cpu().flatten())
            if stress:
                ds.append((s.detach() - b.stress)[b.has_stress].double().cpu())
        de, df, f2 = torch.cat(de), torch.cat(df), torch.cat(f2)
        r = {
            "n": len(group),
            "energy_mae_meV_atom": 1e3 * float(de.abs().mean()),
            "energy_rmse_meV_atom": 1e3 * float(de.square().mean().sqrt()),
            "force_rmse": float(df.square().mean().sqrt()),
            "force_mae": float(df.abs().mean()),
            "force_rms": float(f2.square().mean().sqrt()),
        }
        if ds:
            r["stress_rmse_meV_A3"] = 1e3 * float(torch.cat(ds).square().mean().sqrt())
        out[name] = r
    return out if by_family else out["all"]


@torch.no_grad()
def init_scale(model, samples: list[Sample], batch_size: int = 32) -> float:
    """Set ``species_energy`` to the training set's reference energies and scale
    the readout's last layer (energies and forces are linear in it) by the largest
    factor that keeps both the model's force RMS and the spread of its energy per
    atom within the targets' (on ``batch_size`` samples drawn with a fixed seed);
    its bias then matches the targets' mean energy per atom beyond the reference
    energies there. Returns the factor applied."""
    m = unwrap(model)
    p = next(m.parameters())
    e0 = fit_reference_energies(samples, m.config.species)
    m.species_energy.copy_(e0)
    pick = random.Random(0).sample(range(len(samples)), min(batch_size, len(samples)))
    b = collate([samples[i] for i in pick], m.config.cutoff, p.dtype, p.device)
    base = torch.zeros_like(b.energy).index_add(
        0, b.atom_system, m.species_energy[m.species_index(b.numbers)]
    )
    n = b.n_atoms.to(b.energy.dtype)
    energy, forces, _ = predict(m, b)

    def rms(t):
        return float(t.square().mean().sqrt())

    def spread(t):
        return float(t.std()) if t.numel() > 1 else rms(t)

    ratios = [rms(b.forces) / rms(forces) if rms(forces) > 0 else math.inf,
              spread((b.energy - base) / n) / spread((energy - base) / n)
              if spread((energy - base) / n) > 0 else math.inf]  # fmt: skip
    scale = min(ratios) if math.isfinite(min(ratios)) else 1.0
    last = m.readout[-1]
    last.weight.mul_(scale)
    last.bias.zero_()
    energy, _, _ = predict(m, b)  # the bias: the targets' mean residual per atom
    last.bias.add_(float(((b.energy - base) - (energy - base)).sum() / n.sum()))
    return scale


def _lr(step: int, total: int, cfg: TrainConfig, elapsed: float = 0.0) -> float:
    """Linear warm-up to ``cfg.lr``, then a cosine decay to ``min_lr_ratio lr``
    over the steps or, with ``max_seconds``, over the wall time, whichever runs out
    first (``elapsed``: seconds since training started)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.max_seconds:
        t = max(t, min(1.0, elapsed / cfg.max_seconds))
    lo = cfg.min_lr_ratio
    return cfg.lr * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * t)))


def fit(model, train: list[Sample], val: list[Sample], cfg: TrainConfig = None,
        out=None, log=None, init: bool = True, quiet: bool = False,
        state=None):  # fmt: skip
    """Train ``model`` (in place) on ``train``, validating on ``val`` each epoch.

    Returns the EMA model with the best validation loss (its ``metadata`` holds the
    metrics, the config and the history); saves it to ``out`` (a path) whenever
    it improves. ``log``: a path to write one JSON line per epoch (appended to when
    resuming). ``init``: set the reference energies and the readout's scale first
    (:func:`init_scale`).

    ``state``: a path for the resumable state, written after each epoch (the
    weights, the EMA, AdamW's moments, the step, the wall time spent, the shuffling
    generator, the best model and the history). If that file exists, training
    continues from it instead of starting: the same data and ``cfg`` give the same
    run as one uninterrupted (``max_seconds`` counts the time of every part; a
    larger one restarts the cosine's decay). A state of another model is a
    ValueError.
    """
    cfg = cfg or TrainConfig()
    if not train or not val:
        raise ValueError("fit needs training and validation structures")
    m = unwrap(model)
    p = next(m.parameters())
    rng = random.Random(cfg.seed)
    saved = _load_state(state, m) if state is not None else None
    if init and saved is None:
        init_scale(m, train, cfg.batch_size)
    params = [q for n, q in m.named_parameters() if n != "species_energy"]
    m.species_energy.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ema = copy.deepcopy(m).requires_grad_(False)
    n_batches, started = math.ceil(len(train) / cfg.batch_size), time.perf_counter()
    total, step, best, since, history = cfg.epochs * n_batches, 0, math.inf, 0, []
    best_state, first = copy.deepcopy(ema.state_dict()), 0
    if saved is not None:
        m.load_state_dict(saved["model"])
        ema.load_state_dict(saved["ema"])
        opt.load_state_dict(saved["opt"])
        rng.setstate(saved["rng"])
        step, best, since = saved["step"], saved["best"], saved["since"]
        best_state, history = saved["best_state"], saved["history"]
        stopped = _done(cfg, since, saved["elapsed"])  # the saved run had ended
        first = cfg.epochs if stopped else saved["epoch"]
        started -= saved["elapsed"]
    logf = open(log, "a" if saved else "w") if log is not None else None  # noqa: SIM115
    try:
        for epoch in range(first, cfg.epochs):
            t0, order, sums = time.perf_counter(), list(train), {}
            rng.shuffle(order)
            for i in range(n_batches):
                b = collate(order[i * cfg.batch_size : (i + 1) * cfg.batch_size],
                            m.config.cutoff, p.dtype, p.device)  # fmt: skip
                lr = _lr(step, total, cfg, time.perf_counter() - started)
                for g in opt.param_groups:
                    g["lr"] = lr
                value, parts = loss(m, b, cfg)
                if not math.isfinite(float(value.detach())):
                    raise FloatingPointError(
                        f"training diverged: the loss of epoch {epoch + 1}, batch "
                        f"{i + 1} is {float(value.detach())} (try a smaller --lr)"
                    )
                opt.zero_grad(set_to_none=True)
                value.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
                opt.step()
                with torch.no_grad():
                    for qe, q in zip(ema.parameters(), m.parameters()):
                        qe.lerp_(q, 1.0 - cfg.ema_decay)
                step += 1
                for k, v in {"loss": float(value.detach()), **parts}.items():
                    sums[k] = sums.get(k, 0.0) + v / n_batches
                if not quiet:
                    print(f"\repoch {epoch + 1}/{cfg.epochs} batch {i + 1}/"
                          f"{n_batches} loss {float(value.detach()):.4g}", end="",
                          file=sys.stderr, flush=True)  # fmt: skip
            metrics = evaluate(ema, val, cfg.batch_size)
            stress_rmse = metrics.get("stress_rmse_meV_A3", 0.0) / 1e3
            val_loss = (cfg.energy_weight * (metrics["energy_rmse_meV_atom"] / 1e3) ** 2
                        + cfg.force_weight * metrics["force_rmse"] ** 2
                        + cfg.stress_weight * stress_rmse**2)  # fmt: skip
            row = {"epoch": epoch + 1, "lr": lr,
                   "seconds": time.perf_counter() - t0, "train": sums,
                   "val": metrics, "val_loss": val_loss}  # fmt: skip
            history.append(row)
            if logf is not None:
                logf.write(json.dumps(row) + "\n")
                logf.flush()
            if not quiet:
                print(f"\repoch {epoch + 1}/{cfg.epochs} loss {sums['loss']:.4g} "
                      f"val E {metrics['energy_mae_meV_atom']:.1f} meV/atom, F rmse "
                      f"{metrics['force_rmse']:.3f} eV/A ({row['seconds']:.1f} s)",
                      file=sys.stderr)  # fmt: skip
            if val_loss < best:
                best, since = val_loss, 0
                best_state = copy.deepcopy(ema.state_dict())
                if out is not None:
                    _meta(ema, cfg, metrics, history).save(out)
            else:
                since += 1
            elapsed = time.perf_counter() - started
            if state is not None:
                now = dict(format="ecekern-train-state", config=m.config.to_dict(),
                           model=m.state_dict(), ema=ema.state_dict(),
                           opt=opt.state_dict(), rng=rng.getstate(), step=step,
                           epoch=epoch + 1, elapsed=elapsed, best=best,
                           since=since, best_state=best_state,
                           history=history)  # fmt: skip
                write_whole(now, state)
            if _done(cfg, since, elapsed):
                break
    finally:
        if logf is not None:
            logf.close()
    ema.load_state_dict(best_state)
    return _meta(ema, cfg, evaluate(ema, val, cfg.batch_size), history)


def _done(cfg: TrainConfig, since: int, elapsed: float) -> bool:
    """Early stopping's patience is spent, or the wall-time budget."""
    return since >= cfg.patience or bool(cfg.max_seconds and elapsed > cfg.max_seconds)


def _load_state(path, model) -> dict | None:
    """The resumable state at ``path`` (None if there is no such file), checked to
    be one of ``model``'s config."""

    if not os.path.exists(path):
        return None
    saved = torch.load(path, map_location=next(model.parameters()).device,
                       weights_only=True)  # fmt: skip
    if not isinstance(saved, dict) or saved.get("format") != "ecekern-train-state":
        raise ValueError(f"{path} is not a training state of ecekern.train.fit")
    if saved["config"] != model.config.to_dict():
        raise ValueError(
            f"the training state {path} is of another model: {saved['config']} "
            f"against {model.config.to_dict()}"
        )
    return saved


def _meta(model, cfg: TrainConfig, metrics: dict, history: list):
    model.metadata = {
        "train_config": asdict(cfg),
        "val_metrics": metrics,
        "epochs_run": len(history),
        "history": [
            {
                "epoch": r["epoch"],
                "val_loss": r["val_loss"],
                "train_loss": r["train"]["loss"],
            }
            for r in history
        ],  # fmt: skip
    }
    return model
