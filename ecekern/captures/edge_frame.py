"""Chapter 3's capture: the edge-frame kernels, table against packed, and the step.

Parts (``parts``, comma-separated), on the model's own tensors (the book's model,
L = 2, C = 32, diamond boxes of 512 and 4096 atoms: about 46k and 365k edges):

* ``kernels`` -> kernels.csv: each op (rotation with the modulation, unrotation with
  the aggregation) forward and backward, reference / table / packed, its GPU time,
  the bytes model and the floor, and the packing's own cost;
* ``steps`` -> steps.csv, stages.csv: the force step at 512 and 4096 atoms
  with chapters 2 and 5 on, the edge frame by the reference, the table kernels and
  the packed kernels: time, peak memory, and the forward and backward time by stage
  (the profiler) at 4096 atoms;
* ``ncu`` -> ncu_edge_frame.csv: the kernels at 365k edges, table then packed (the
  order of :func:`ecekern.captures.targets.edge_frame`).

The launch sweep (its last launch_sweep.csv stays stored) is retired to
``book/history/02_linear/launch_sweeps.md``.
"""

from __future__ import annotations

import torch

from .. import bench
from . import schema
from .common import (
    ceilings,
    device,
    free,
    ncu_part,
    option_steps,
)

__all__ = ["PARTS", "step_tensors"]
#: The kernels in the order the ncu target runs them, per variant (the rotations
#: launch once per side).
NCU_ORDER = (
    "rotate_fwd dst",
    "rotate_fwd src",
    "unrotate_fwd",
    "unrotate_bwd",
    "rotate_bwd dst",
    "rotate_bwd src",
)


def notes(run) -> dict:
    """The manifest's notes before any part runs: the library's launch, and the
    order of the kernels in ncu_edge_frame.csv."""
    from .. import edge_frame

    return {
        "launch": repr(edge_frame.EdgeFrameLaunch()),
        "ncu_order": [f"{v} {k}" for v in ("table", "packed") for k in NCU_ORDER],
    }


# --------------------------------------------------------------------------------------
# the step's tensors
# --------------------------------------------------------------------------------------
def step_tensors(rep: int, dtype=torch.float32, dev: str | None = None) -> dict:
    """The edge-frame ops' inputs at the model's shapes on ``diamond(rep)``: the real
    graph and edge frames, random features (h, rho, y) and the envelope as w."""
    import ecekern
    from ecekern import reference, so3
    from ecekern.graph import edge_vectors
    from ecekern.model import prepare_inputs

    dev = dev or device()
    cfg = ecekern.ECEConfig()
    if dev != "cuda":  # the interpreter: a small model
        cfg = ecekern.ECEConfig(channels=4)
    pos, _, graph = prepare_inputs(ecekern.systems.diamond(rep), cfg.cutoff, dtype, dev)
    r = edge_vectors(pos, graph)
    d = torch.linalg.vector_norm(r, dim=-1)
    L, M, C, E, N = cfg.lmax, cfg.M, cfg.channels, graph.n_edges, pos.shape[0]
    g = torch.Generator(device=dev).manual_seed(rep)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    return {
        "L": L,
        "M": M,
        "C": C,
        "E": E,
        "N": N,
        "graph": graph,
        "D": so3.edge_frames(L, r),
        "h": rnd(N, cfg.S, C),
        "rho": rnd(E, cfg.F),
        "y_cos": rnd(E, C * (L + 1), M + 1),
        "y_sin": rnd(E, C * (L + 1), M + 1),
        "w": reference.envelope(d, cfg.cutoff),
        "G": rnd(N, cfg.S, C),
        "scale": cfg.scale,
    }


def _frames(t: dict, variant: str, launch=None):
    from .. import edge_frame

    g = t["graph"]
    kw = {"launch": launch} if launch is not None else {}
    return edge_frame.Frames(t["D"], t["M"], g.src, g.dst, t["N"], g.row_ptr,
                             variant, **kw)  # fmt: skip


def _ops(fr, t: dict):
    """The four launchers of one Frames object, each a no-argument callable."""
    from .. import edge_frame as ef

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


# --------------------------------------------------------------------------------------
# the ops, reference / table / packed
# --------------------------------------------------------------------------------------
def _kernels(run, arg: str) -> str:
    """kernels.csv (kernel schema: ``kernel`` the op, ``n`` its edges, with its
    ``variant``): each op's GPU time by variant, with the bytes model."""
    from .. import edge_frame as ef
    from .. import reference

    out, reps = run.out, run.reps()
    bw = ceilings()["copy_GBps"]
    rows: list[dict] = []
    for rep in reps:
        t = step_tensors(rep)
        g = t["graph"]
        L, M = t["L"], t["M"]
        problem = f"E={t['E']}, L={L}, M={M}, C={t['C']}"
        gx = [torch.randn(t["E"], 2 * t["C"] * (L + 1), M + 1, device=t["h"].device)
              for _ in range(2)]  # fmt: skip

        def ref_rotate():
            xc, xs = reference.rotate_and_select(t["h"], g.src, g.dst, t["D"], M)
            return xc * t["rho"][:, :, None], xs * t["rho"][:, :, None]

        def ref_unrotate():
            msg = reference.pack_and_unrotate(t["y_cos"], t["y_sin"], t["D"], M)
            return reference.aggregate(msg, g.dst, t["N"], t["scale"], t["w"])

        def leaf(*names):
            return [t[n].detach().requires_grad_() for n in names]

        def ref_rotate_fb():
            h, D, rho = leaf("h", "D", "rho")
            xc, xs = reference.rotate_and_select(h, g.src, g.dst, D, M)
            torch.autograd.backward((xc * rho[:, :, None], xs * rho[:, :, None]), gx)

        def ref_unrotate_fb():
            yc, ys, D, w = leaf("y_cos", "y_sin", "D", "w")
            msg = reference.pack_and_unrotate(yc, ys, D, M)
            delta = reference.aggregate(msg, g.dst, t["N"], t["scale"], w)
            delta.backward(t["G"])

        timings = {
            ("reference", "rotate"): (ref_rotate, ref_rotate_fb),
            ("reference", "unrotate"): (ref_unrotate, ref_unrotate_fb),
        }
        for variant in ef.VARIANTS:
            o = _ops(_frames(t, variant), t)
            for op in ("rotate", "unrotate"):
                fwd, bwd = o[f"{op}_fwd"], o[f"{op}_bwd"]
                timings[(variant, op)] = (fwd, lambda f=fwd, b=bwd: (f(), b()))
        for (variant, op), (fwd, fb) in timings.items():
            packed = variant == "packed"
            model = ef.traffic(t["E"], t["N"], L, M, t["C"], 4, packed=packed)
            t_f = bench.time_graph(fwd) or bench.time_fn(fwd)
            t_fb = bench.time_fn(fb) if variant == "reference" else (
                bench.time_graph(fb) or bench.time_fn(fb))  # fmt: skip
            floor_f = bench.floor_ms(model[f"floor_{op}_fwd"], 0, bw)
            fb_bytes = model[f"floor_{op}_fwd"] + model[f"floor_{op}_bwd"]
            floor_fb = bench.floor_ms(fb_bytes, 0, bw)
            rows.append(schema.kernel_row(
                op, problem, t["E"], "float32", t_f, model[f"floor_{op}_fwd"],
                variant=variant, n_atoms=t["N"], fwd_bwd_ms=t_fb.median,
                backward_ms=t_fb.median - t_f.median, floor_fwd_ms=floor_f,
                floor_fwd_bwd_ms=floor_fb, floor_fraction_fwd=floor_f / t_f.median,
                floor_fraction_fwd_bwd=floor_fb / t_fb.median,
                timer_fwd_bwd="eager" if variant == "reference" else "graph",
                message_MB=model["message_bytes"] / 1e6,
            ))  # fmt: skip
            print(op, variant, t["E"], f"fwd {t_f.median:.3f} ms",
                  f"fwd+bwd {t_fb.median:.3f} ms", flush=True)  # fmt: skip
            schema.write(rows, out / "kernels.csv", schema.KERNEL_COLUMNS)
        t_pack = bench.time_graph(lambda: ef.pack(t["D"], M))
        if t_pack is not None:
            pack = schema.kernel_row("pack", problem, t["E"], "float32", t_pack)
            rows.append({**pack, "variant": "packed", "n_atoms": t["N"]})
            schema.write(rows, out / "kernels.csv", schema.KERNEL_COLUMNS)
        t = timings = None
        free()
    return "done"


# --------------------------------------------------------------------------------------
# the force step
# --------------------------------------------------------------------------------------
#: (the stack as before chapter 6: the linears, no cohorts)
STEP_OPTIONS = {
    ef: {"linear": "auto", "zonal": "fused", "edge_frame": ef, "stack": "linears",
         "memory": "plain"}
    for ef in ("reference", "table", "packed")
}  # fmt: skip


def _steps(run, arg: str) -> str:
    """steps.csv (step schema) and stages.csv (chapters 2 and 5 on; the edge frame
    switched): time, peak memory, and at the largest box the time by stage."""
    from ecekern.model import force_step

    from .progress import _stages

    stage_rows: list[dict] = []

    def stages(rep, model, inputs, row, kw):
        if rep != run.reps()[-1]:
            return
        step, variant = lambda: force_step(model, *inputs), row["system"]
        for r in _stages(variant, step, row["n_atoms"], "cuda"):
            stage_rows.append({"edge_frame": variant, **r})
        bench.write_csv(stage_rows, run.out / "stages.csv")

    cases = [(variant, opts, {}) for variant, opts in STEP_OPTIONS.items()]
    return option_steps(run, cases, "steps", each=stages)


_ncu = ncu_part({"edge_frame": ("edge_frame", None)})
PARTS = {"kernels": _kernels, "steps": _steps, "ncu": _ncu}
GPU_ONLY = ("steps", "ncu")
