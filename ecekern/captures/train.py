"""The training appendix's capture: what one training step costs, and the checks.

* ``step`` -> train_steps.csv (step schema, mode eager): one training step of the
  book's model (the forward, the forces with ``create_graph``, the loss's backward
  through them, AdamW) on batches of 8 and 32 structures of the shipped carbon set,
  the library's defaults against the reference: milliseconds and peak memory (on
  the CPU a small model on 4 structures: a smoke test);
* ``checks=CHECKPOINT`` -> model_checks.json: ``train.checks.diamond_checks`` of a
  model trained by ``python -m ecekern.train`` (README), with
  the NVE check: its side of GFN1-xTB's shipped ``carbon_gfn1_checks.json``.
"""

from __future__ import annotations

import json

import torch

from .. import ECEConfig, ECEModel, bench, options, train
from . import schema
from .common import free

__all__ = ["PARTS"]

#: The smoke test's model on the CPU (the GPU runs the book's, carbon only).
SMOKE = dict(lmax=1, channels=4, n_interactions=1, n_gated=1, radial_hidden=8,
             readout_hidden=8)  # fmt: skip


def _step(run, arg: str) -> str:
    from ..data import carbon

    cpu = run.dev != "cuda"
    cfg = ECEConfig(species=(6,), **(SMOKE if cpu else {}))
    samples = [train.from_atoms(a) for a in carbon.load()[: 4 if cpu else 32]]
    rows = []
    for size in (4,) if cpu else (8, 32):
        batch = train.collate(samples[:size], cfg.cutoff, torch.float32, run.dev)
        for name, opts in (("defaults", {}), ("reference", {"reference": True})):
            model = ECEModel(cfg).to(run.dev)
            opt = torch.optim.AdamW(model.parameters(), 1e-3)

            def step(model=model, opt=opt, batch=batch):
                value, _ = train.loss(model, batch, train.TrainConfig())
                opt.zero_grad(set_to_none=True)
                value.backward()
                opt.step()

            with options.use(**opts):
                t = bench.time_fn(step, device=run.dev, min_reps=3)
                peak = None if cpu else bench.peak_memory(step)
            rows.append(schema.step_row(
                f"training step, {size} carbon structures", batch.positions.shape[0],
                batch.graph.n_edges, "eager", "float32", name, t, peak))  # fmt: skip
            del model, opt
            free()
    schema.write(rows, run.out / "train_steps.csv")
    return "done"


def _checks(run, arg: str) -> str:
    from ..calculator import ECECalculator
    from ..train.checks import diamond_checks

    if not arg:
        return "skipped: give the checkpoint, --parts checks=PATH"
    model = ECEModel.load(arg, map_location=run.dev)
    out = diamond_checks(ECECalculator(model), 2 if run.dev == "cuda" else 1, nve=True)
    out["checkpoint"] = {"path": arg, "trained": model.metadata.get("provenance")}
    (run.out / "model_checks.json").write_text(json.dumps(out, indent=1))
    return "done"


PARTS = {"step": _step, "checks": _checks}
DEFAULT = "step"
