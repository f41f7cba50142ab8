"""Chapter 3's capture: the edge frame by the reference, the table and the packed
kernels in the force step.

Parts (``parts``, comma-separated), on the model's own tensors (the book's model,
L = 2, C = 32, diamond boxes of 512 and 4096 atoms: about 46k and 365k edges):

* ``steps`` -> steps.csv, stages.csv: the force step at 512 and 4096 atoms
  with chapters 2 and 5 on, the edge frame by the reference, the table kernels and
  the packed kernels: time, peak memory, and the forward and backward time by stage
  (the profiler) at 4096 atoms;
* ``ncu`` -> ncu_edge_frame.csv: the kernels at 365k edges, table then packed (the
  order of :func:`ecekern.captures.targets.edge_frame`).
"""

from __future__ import annotations

import torch

from .. import ECEConfig, bench, reference, so3, systems
from .. import edge_frame as ef
from ..graph import edge_vectors
from ..model import force_step, prepare_inputs
from .common import BEFORE_CH6, device, ncu_part, option_steps
from .stages import stage_rows

__all__ = ["PARTS", "step_tensors"]
#: The kernels in the order the ncu target runs them, per variant (the rotations
#: launch once per side).
NCU_ORDER = ("rotate_fwd dst", "rotate_fwd src", "unrotate_fwd", "unrotate_bwd",
             "rotate_bwd dst", "rotate_bwd src")  # fmt: skip


def notes(run) -> dict:
    """The manifest's notes before any part runs: the library's launch, and the
    order of the kernels in ncu_edge_frame.csv."""
    return {
        "launch": repr(ef.EdgeFrameLaunch()),
        "ncu_order": [f"{v} {k}" for v in ("table", "packed") for k in NCU_ORDER],
    }


def step_tensors(rep: int, dtype=torch.float32, dev: str | None = None) -> dict:
    """The edge-frame ops' inputs at the model's shapes on ``diamond(rep)``: the real
    graph and edge frames, random features (h, rho, y) and the envelope as w."""
    dev = dev or device()
    cfg = ECEConfig() if dev == "cuda" else ECEConfig(channels=4)  # interpreter: small
    pos, _, graph = prepare_inputs(systems.diamond(rep), cfg.cutoff, dtype, dev)
    r = edge_vectors(pos, graph)
    d = torch.linalg.vector_norm(r, dim=-1)
    L, M, C, E, N = cfg.lmax, cfg.M, cfg.channels, graph.n_edges, pos.shape[0]
    g = torch.Generator(device=dev).manual_seed(rep)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    return dict(L=L, M=M, C=C, E=E, N=N, graph=graph, D=so3.edge_frames(L, r),
                h=rnd(N, cfg.S, C), rho=rnd(E, cfg.F),
                y_cos=rnd(E, C * (L + 1), M + 1), y_sin=rnd(E, C * (L + 1), M + 1),
                w=reference.envelope(d, cfg.cutoff), G=rnd(N, cfg.S, C),
                scale=cfg.scale)  # fmt: skip


def _frames(t: dict, variant: str, launch=None):
    g = t["graph"]
    kw = {"launch": launch} if launch is not None else {}
    return ef.Frames(t["D"], t["M"], g.src, g.dst, t["N"], g.row_ptr,
                             variant, **kw)  # fmt: skip


def _ops(fr, t: dict):
    """The four launchers of one Frames object, each a no-argument callable."""
    D = (fr.d, fr.tab)
    rot = (t["h"], *D, t["rho"], fr.csr, fr.L, fr.M, fr.packed, fr.launch)
    y, rp = (t["y_cos"], t["y_sin"]), t["graph"].row_ptr
    unrot = (*D, t["w"], rp, t["scale"], fr.L, fr.M, fr.packed)
    gen = torch.Generator(device=t["h"].device).manual_seed(11)  # the same in fp64
    gx = [torch.randn(v.shape, device=v.device, dtype=torch.float64, generator=gen)
          .to(v.dtype) for v in ef.rotate_fwd(*rot)]  # fmt: skip
    return {
        "rotate_fwd": lambda: ef.rotate_fwd(*rot),
        "rotate_bwd": lambda: ef.rotate_bwd(*gx, *rot),
        "unrotate_fwd": lambda: ef.unrotate_fwd(*y, *unrot, fr.launch),
        "unrotate_bwd": lambda: ef.unrotate_bwd(
            t["G"], *y, *unrot, True, True, fr.launch
        ),  # fmt: skip
    }


#: The options of the steps: chapters 2 and 5 on, the edge frame switched.
STEP_OPTIONS = {
    v: {"linear": "auto", "zonal": "fused", "edge_frame": v, **BEFORE_CH6}
    for v in ("reference", "table", "packed")
}


def _steps(run, arg: str) -> str:
    """steps.csv (step schema) and stages.csv (chapters 2 and 5 on; the edge frame
    switched): time, peak memory, and at the largest box the time by stage."""
    rows: list[dict] = []

    def stages(rep, model, inputs, row, kw):
        if rep != run.reps()[-1]:
            return
        step, variant = lambda: force_step(model, *inputs), row["system"]
        for r in stage_rows(variant, step, row["n_atoms"], "cuda"):
            rows.append({"edge_frame": variant, **r})
        bench.write_csv(rows, run.out / "stages.csv")

    cases = [(variant, opts, {}) for variant, opts in STEP_OPTIONS.items()]
    return option_steps(run, cases, "steps", each=stages)


_ncu = ncu_part({"edge_frame": ("edge_frame", None)})
PARTS = {"steps": _steps, "ncu": _ncu}
GPU_ONLY = tuple(PARTS)
