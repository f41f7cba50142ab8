"""Chapter 7's capture: the whole step, stage by stage.

Parts (``parts``, comma-separated):

* ``stages`` -> stages.csv (step schema, :func:`~.common.option_steps`): the force
  step replayed as a CUDA graph (float32, the library's plan otherwise) with chapter
  7's geometry and radial stages as the reference composition and fused
  (:data:`VARIANTS`), at 512 and 4096 atoms: time (median, p10, p90 of at least 10
  replays) and peak memory (that of the capture, which the graph's pool keeps); each
  row's ``plan`` the step plan its options resolved to.
* ``waterfall`` -> waterfall.csv: the replayed step split into its stages
  (:data:`ecekern.flops.STAGES`; the reference's own passes counted with the
  stage that folds them, :data:`FOLDED`), before and after chapter 7's stages
  (:data:`WATERFALL`), per precision of the mixing stack, at 512, 4096 and (the
  default precision, the recomputing cohorts) 32,768 atoms. Per stage: forward and
  backward kernel time (``torch.profiler`` over two eager steps, each kernel given
  to the ``ece::<stage>`` range that launched it or made its autograd node:
  :func:`~.stages.stage_times`), the stage's FLOP and bytes
  (:func:`ecekern.flops.stage_costs`), its floor at our measured ceilings
  (:func:`~.common.ceilings`: the copy bandwidth, the GEMM rate of the stage's
  precision) and the ratio. Two more rows close the sum: ``(outside the stages)``
  (the force step's own kernels: the energy's sum, gradient buffers) and
  ``(launch gaps)``, the replayed step's time minus every kernel's; the
  ``(replayed step)`` row is the step itself.
"""

from __future__ import annotations

import torch

from .. import bench, options
from ..flops import STAGES, stage_costs
from .common import (
    book_config,
    ceilings,
    for_boxes,
    force_row,
    free,
    option_steps,
    profiled,
)
from .stages import OUTSIDE, cpu_us, device_us, stage_times

__all__ = ["GPU_ONLY", "PARTS", "VARIANTS", "WATERFALL"]

#: chapter 7's stages: the reference composition, then the fused kernels
VARIANTS = {
    "reference geometry and radial": dict(geometry="reference", radial="reference"),
    "fused geometry": dict(geometry="fused", radial="reference"),
    "fused geometry and radial": dict(geometry="fused", radial="fused"),
}
#: the waterfall's cases: chapter 7's stages off and on (the packed frames they
#: need: CUDA's default, named for the interpreter's smoke run)
WATERFALL = {
    "before": VARIANTS["reference geometry and radial"],
    "after": {**VARIANTS["fused geometry and radial"], "edge_frame": "packed"},
}
#: the mixing stack's precisions, the fp32-accurate default first
PRECISIONS = ("3xtf32", "tf32", "bf16", "fp32")
#: the GEMM ceiling (methodology's ceilings.csv key) each precision's products run at
#: (3xTF32: three TF32 products per product)
RATE = {"fp32": ("gemm_float32", 1), "3xtf32": ("gemm_float32+tf32", 3),
        "tf32": ("gemm_float32+tf32", 1), "bf16": ("gemm_bfloat16", 1)}  # fmt: skip
GAPS, STEP = "(launch gaps)", "(replayed step)"
#: the reference's own passes, each counted with the stage chapter 3 folds it into
FOLDED = {"edge_frames": "geometry", "radial_modulation": "rotate_and_select",
          "aggregate": "pack_and_unrotate"}  # fmt: skip


def stages(run, arg: str = "") -> str:
    """stages.csv: the replayed step per variant of :data:`VARIANTS`."""
    cases = [(name, kw, {"rep_ms": 500.0, "min_reps": 10})
             for name, kw in VARIANTS.items()]  # fmt: skip

    def plan(rep, model, inputs, row, kw):  # the plan the options resolved to
        row["plan"] = model.plan(inputs[0].device, inputs[0].dtype).describe()

    return option_steps(run, cases, "stages", modes=("replay",), each=plan)


def floor_ms(cost: dict, precision: str, ceil: dict) -> float:
    """A stage's floor (ms): its bytes at the copy bandwidth or its FLOP at the GEMM
    rate of ``precision`` (:data:`RATE`), whichever is longer."""
    key, passes = RATE[precision]
    rate = ceil.get(key, bench.CEILINGS_H200["fp32_TFLOPs"]) / passes
    return bench.floor_ms(cost["bytes"], cost["flop"], ceil["copy_GBps"], rate)


def waterfall_rows(label, precision, model, inputs, dev, ceil, replay_ms) -> list:
    """The waterfall's rows of one case (module docstring)."""
    from ..model import force_step

    pos, numbers, graph = inputs
    n, E = pos.shape[0], graph.n_edges
    prof = profiled(lambda: force_step(model, pos, numbers, graph), 2, dev)[0]
    times = stage_times(prof.events(), device_us if dev == "cuda" else cpu_us, 2)
    costs = stage_costs(model.config, n, E)
    merged: dict = {}
    for stage, (fwd, bwd) in times.items():  # the reference's own passes, folded
        f0, b0 = merged.get(FOLDED.get(stage, stage), (0.0, 0.0))
        merged[FOLDED.get(stage, stage)] = (f0 + fwd, b0 + bwd)
    rows, kernels = [], 0.0
    for stage in [*(s for s in STAGES if s not in FOLDED), OUTSIDE]:
        fwd, bwd = merged.get(stage, (0.0, 0.0))
        cost = costs.get(stage, {"flop": 0, "bytes": 0})
        floor = floor_ms(cost, precision, ceil)
        kernels += fwd + bwd
        rows.append(dict(stage=stage, forward_ms=fwd, backward_ms=bwd, ms=fwd + bwd,
                         flop=cost["flop"], bytes=cost["bytes"], floor_ms=floor,
                         ratio=(fwd + bwd) / floor if floor > 0 else None))  # fmt: skip
    rows.append(dict(stage=GAPS, ms=replay_ms - kernels))
    total = sum(floor_ms(c, precision, ceil) for c in costs.values())
    rows.append(dict(stage=STEP, ms=replay_ms, floor_ms=total, ratio=replay_ms / total))
    prov = bench.provenance(pos.dtype)
    keys = dict(variant=label, precision=precision, n_atoms=n, n_edges=E)
    return [{**keys, **r, **prov} for r in rows]


def waterfall(run, arg: str = "", cfg=None) -> str:
    """waterfall.csv (module docstring); ``cfg``: the model's config (the book's,
    :func:`~.common.book_config`, by default)."""
    rows: list[dict] = []
    ceil = ceilings()
    big = [] if run.quick or run.dev != "cuda" else [16]

    # the interpreter's smoke run: one timed call
    timing = (
        dict(rep_ms=300.0, min_reps=10)
        if run.dev == "cuda"
        else dict(rep_ms=1.0, min_reps=1)
    )

    def body(rep, model, inputs):
        precisions = PRECISIONS if rep not in big else PRECISIONS[:1]
        extra = {} if rep not in big else {"memory": "recompute"}
        for precision in precisions if run.dev == "cuda" else ("fp32",):
            for label, opts in WATERFALL.items():
                opts = {**opts, **extra}
                if run.dev == "cuda":
                    opts["precision"] = precision
                with options.use(**opts):
                    plan = model.plan(inputs[0].device, inputs[0].dtype).describe()
                    try:
                        step = force_row(label, model, inputs, plan, "replay",
                                         **timing)  # fmt: skip
                        rows.extend(waterfall_rows(
                            label, precision, model, inputs, run.dev, ceil, step["ms"]
                        ))  # fmt: skip
                        rows[-1] |= {"plan": plan, "peak_MiB": step["peak_MiB"]}
                    except torch.OutOfMemoryError as exc:
                        rows.append(dict(variant=label, precision=precision,
                                         n_atoms=inputs[0].shape[0], stage=STEP,
                                         error=repr(exc)[:200]))  # fmt: skip
                bench.write_csv(rows, run.out / "waterfall.csv")
                free()

    cfg = cfg or book_config(run.dev)
    for_boxes(run, body, cfg, run.reps() + big, run.dev)
    return "done"


PARTS = {"stages": stages, "waterfall": waterfall}
GPU_ONLY = ()
