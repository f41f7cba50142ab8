"""Chapter 2's capture: EquivariantLinear, einsum vs dense vs the per-mode kernels.

Its part ``steps`` (or ``steps=dense;einsum``) -> model_steps.csv and
profile_step_*: the force step with each path, the zonal scatter on the reference.
The settled ``ncu`` part: ``book/history/02_linear/ncu_capture.md``.
"""

from __future__ import annotations

import csv
import itertools

from ..linear import plan
from ..model import force_step
from .common import BEFORE_CH6, option_steps, profile_table

__all__ = ["PARTS", "PATHS_MEASURED"]

PATHS_MEASURED = ("einsum", "dense", "triton")


def notes(run) -> dict:
    """The manifest's notes before any part runs: the library's launch table."""
    return {"library_launch": {k: repr(v) for k, v in plan.LAUNCH.items()}}


#: The options of the force step with each EquivariantLinear path (the zonal scatter
#: on the reference: only the linear changes).
STEP_OPTIONS = {
    path: {"linear": path, "zonal": "reference", **BEFORE_CH6}
    for path in PATHS_MEASURED
}


def _model_steps(run, arg: str) -> str:
    """model_steps.csv (step schema): the model's force step with each
    EquivariantLinear path (``steps=dense;einsum``: some), strict fp32 and TF32:
    time, peak memory, and from a profile of each the calls per step of the ops the
    einsum path brings (copies, bmm) and the GEMMs of the dense path."""
    paths = arg.split(";") if arg else PATHS_MEASURED
    cases = [(path, STEP_OPTIONS[path], {"tf32": tf32})
             for tf32, path in itertools.product((False, True), paths)]  # fmt: skip

    def profile(rep, model, inputs, row, kw):
        tf32 = "_tf32" if row["precision"].endswith("tf32") else ""
        stem = f"profile_step_{row['n_atoms']}_{row['system']}{tf32}"
        profile_table(lambda: force_step(model, *inputs), run.out, stem)
        with (run.out / f"{stem}_ops.csv").open() as fh:
            ops = list(csv.DictReader(fh))
        for op in ("aten::copy_", "aten::bmm", "aten::addmm", "aten::mm"):
            calls = (float(r["calls_per_step"]) for r in ops if r["name"] == op)
            row["calls_" + op.split("::")[1]] = sum(calls)

    reps = run.reps(quick=(2,))
    return option_steps(run, cases, "model_steps", reps=reps, each=profile)


PARTS = {"steps": _model_steps}
GPU_ONLY = tuple(PARTS)
