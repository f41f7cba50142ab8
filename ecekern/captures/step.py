"""Chapter 7's capture: the whole step, stage by stage.

Parts (``parts``, comma-separated):

* ``stages`` -> stages.csv (step schema, :func:`~.common.option_steps`): the force
  step replayed as a CUDA graph (float32, the library's plan otherwise) with chapter
  7's geometry and radial stages as the reference composition and fused
  (:data:`VARIANTS`), at 512 and 4096 atoms: time (median, p10, p90 of at least 10
  replays) and peak memory (that of the capture, which the graph's pool keeps); each
  row's ``plan`` the step plan its options resolved to.
"""

from __future__ import annotations

from .common import option_steps

__all__ = ["GPU_ONLY", "PARTS", "VARIANTS"]

#: chapter 7's stages: the reference composition, then the fused kernels
VARIANTS = {
    "reference geometry and radial": dict(geometry="reference", radial="reference"),
    "fused geometry": dict(geometry="fused", radial="reference"),
    "fused geometry and radial": dict(geometry="fused", radial="fused"),
}


def stages(run, arg: str = "") -> str:
    """stages.csv: the replayed step per variant of :data:`VARIANTS`."""
    cases = [(name, kw, {"rep_ms": 500.0, "min_reps": 10})
             for name, kw in VARIANTS.items()]  # fmt: skip

    def plan(rep, model, inputs, row, kw):  # the plan the options resolved to
        row["plan"] = model.plan(inputs[0].device, inputs[0].dtype).describe()

    return option_steps(run, cases, "stages", modes=("replay",), each=plan)


PARTS = {"stages": stages}
GPU_ONLY = ()
