"""The training appendix's capture: what one training step costs.

* ``step`` -> train_steps.csv (step schema, mode eager): one training step of the
  book's model (the forward, the forces with ``create_graph``, the loss's backward
  through them, AdamW) on batches of 8 and 32 structures of the shipped carbon set,
  the library's defaults against the reference: milliseconds and peak memory.

* ``xtb`` -> xtb_checks.json (CPU, minutes): GFN1-xTB's side of the appendix's
  physics checks, for the trained model to be compared with: diamond's equation of
  state (64-atom cubic cell) and its Gamma-point frequencies at xTB's lattice
  constant (the 2 x 2 x 2 supercell: the crystal's phonons at Gamma, X and L).

The model itself is trained by ``python -m ecekern.train`` (README), which stores
its metrics, its training log's path and its provenance in the checkpoint.
With ``--cpu`` the part runs a small model on 4 structures (a smoke test).
"""

from __future__ import annotations

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


def _xtb(run, arg: str) -> str:
    import json

    from ase.build import bulk
    from tblite.ase import TBLite

    from ..train import checks

    calc = TBLite(method="GFN1-xTB", verbosity=0)
    cell = bulk("C", "diamond", a=3.567, cubic=True).repeat(1 if run.quick else 2)
    eos = checks.equation_of_state(calc, cell)
    a0 = 3.567 * eos["scale"]
    at_a0 = bulk("C", "diamond", a=a0, cubic=True).repeat(1 if run.quick else 2)
    freqs = checks.gamma_frequencies(calc, at_a0)
    out = {"eos": eos, "a0": a0, "cell_atoms": len(at_a0),
           "gamma_THz": [float(f) for f in freqs],
           "calculator": "tblite.ase.TBLite(method='GFN1-xTB')",
           "provenance": bench.provenance()}  # fmt: skip
    (run.out / "xtb_checks.json").write_text(json.dumps(out, indent=1))
    return f"a0 {a0:.4f} A, B {eos['B_GPa']:.0f} GPa"


PARTS = {"step": _step, "xtb": _xtb}
DEFAULT = "step"
