"""Chapter 5's capture: the zonal scatter, reference vs fused, in the force step.

Its part ``steps`` -> model_steps.csv and profile_*: the force and training steps
with the reference and the fused scatter (the linear on the einsum: only the scatter
changes). The settled ``ncu`` part: ``book/history/05_zonal/ncu_capture.md``.
"""

from __future__ import annotations

import torch

from .. import zonal
from ..graph import csr_row_ptr
from ..model import force_step
from .common import BEFORE_CH6, option_steps, profile_table

__all__ = ["PARTS", "launch_label", "random_scatter"]


def launch_label(launch) -> str:
    """A ``ZonalLaunch`` as one line for a CSV column."""
    return (
        f"degrees tile={launch.fwd_tile} w={launch.fwd_warps} "
        f"st={launch.fwd_stages}; edge tile={launch.bwd_tile} w={launch.bwd_warps}"
    )


def notes(run) -> dict:
    """The manifest's notes before any part runs: the library's launch."""
    return {"config": launch_label(zonal.ZonalLaunch())}


def random_scatter(E: int, L: int, C: int, dev: str, seed: int):
    """A random scatter of ``E`` edges onto ``N = E // 89`` atoms (the diamond's
    in-degree), float64: ``(N, dst, row_ptr, Z, R, G)``, ``dst`` sorted with its CSR
    ``row_ptr``, ``Z`` ``(E, S - 1)`` and ``R`` ``(E, L, C)`` the edges' inputs and
    ``G`` ``(N, S, C)`` an output's gradient (S = (L + 1)^2)."""
    N, S = max(1, E // 89), (L + 1) ** 2
    g = torch.Generator(device=dev).manual_seed(seed)
    dst = torch.sort(torch.randint(0, N, (E,), device=dev, generator=g)).values
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.float64,
                                     generator=g)  # fmt: skip
    return N, dst, csr_row_ptr(dst, N), rnd(E, S - 1), rnd(E, L, C), rnd(N, S, C)


#: The options of the steps: the reference scatter against the fused op, the linear
#: on the einsum (only the scatter changes).
STEP_OPTIONS = {
    scatter: {"linear": "einsum", "zonal": scatter, **BEFORE_CH6}
    for scatter in ("reference", "fused")
}


def _train(model, pos, numbers, graph):
    """A force-training step: the loss of the energy and the forces, backward."""
    model.zero_grad(set_to_none=True)
    e, f = force_step(model, pos, numbers, graph, create_graph=True)
    (e**2 + (f**2).sum()).backward()


def _model_steps(run, arg: str) -> str:
    """model_steps.csv (step schema, ``kind``: force or training step): the reference
    scatter against the fused op, strict fp32: time, peak memory, and a profiler
    table of each at the larger box."""
    label, reps = launch_label(zonal.ZonalLaunch()), run.reps(quick=(2,))
    steps = (("force step", force_step), ("training step", _train))
    cases = [(s, opts, {"step": fn, "kind": kind,
                        "config": label if s == "fused" else ""})
             for s, opts in STEP_OPTIONS.items() for kind, fn in steps]  # fmt: skip

    def profile(rep, model, inputs, row, kw):
        if rep == reps[-1]:
            stem = f"profile_{kw['kind'].split()[0]}_{row['n_atoms']}_{row['system']}"
            profile_table(lambda: kw["step"](model, *inputs), run.out, stem)

    return option_steps(run, cases, "model_steps", reps=reps, each=profile)


PARTS = {"steps": _model_steps}
GPU_ONLY = tuple(PARTS)
