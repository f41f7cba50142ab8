"""Chapter 7's capture: the whole step, stage by stage.

Parts (``parts``, comma-separated):

* ``stages`` -> stages.csv: the replayed force step (float32, the library's plan)
  with chapter 7's geometry and radial stages as the reference composition and
  fused, at each size of ``run.reps()`` (512 and 4096 atoms); each row its plan,
  the step's median GPU time and its peak memory.
"""

from __future__ import annotations

import torch

from .. import bench

__all__ = ["GPU_ONLY", "PARTS"]

#: chapter 7's stages: the reference composition, then the fused kernels
VARIANTS = {
    "reference geometry and radial": dict(geometry="reference", radial="reference"),
    "fused geometry": dict(geometry="fused", radial="reference"),
    "fused geometry and radial": dict(geometry="fused", radial="fused"),
}


def stages(run, arg: str = "") -> str:
    """The replayed step per variant of :data:`VARIANTS` (module docstring)."""
    import ecekern
    from ecekern import options
    from ecekern.graph_step import GraphStep
    from ecekern.model import prepare_inputs

    rows = []
    torch.manual_seed(0)
    model = ecekern.ECEModel().to(run.dev, torch.float32)
    for reps in run.reps():
        atoms = ecekern.systems.diamond(reps)
        pos, numbers, graph = prepare_inputs(atoms, 5.0, torch.float32, run.dev)
        for name, kw in VARIANTS.items():
            with options.use(**kw):
                step = GraphStep(model, numbers, graphs=run.dev == "cuda")
                step(pos, graph)  # the capture
                if run.dev == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t = bench.time_fn(lambda s=step: s(pos, graph), rep_ms=500,
                                  min_reps=10)  # fmt: skip
                peak = (torch.cuda.max_memory_allocated() / 2**20
                        if run.dev == "cuda" else float("nan"))  # fmt: skip
                plan = step.plan() or model.plan()
                mode = "replay" if run.dev == "cuda" else "eager"
                rows.append(dict(
                    atoms=len(atoms), edges=graph.n_edges, variant=name,
                    plan=plan.describe(), mode=mode, step_ms=t.median,
                    p10_ms=t.p10, p90_ms=t.p90, peak_MiB=peak,
                ))  # fmt: skip
                print(rows[-1], flush=True)
    prov = bench.provenance(torch.float32, "python -m ecekern.captures 07_step")
    bench.write_csv([r | prov for r in rows], run.out / "stages.csv")
    return f"{len(rows)} rows"


PARTS = {"stages": stages}
GPU_ONLY = ()
