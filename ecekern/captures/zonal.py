"""Chapter 5's capture: the zonal scatter, reference vs fused, over E, L and C.

Parts (``parts``, comma-separated):

* ``sweep`` -> scatter_sweep.csv: forward and forward + backward times, peak memory,
  the DRAM floor and the error against float64, the fused op at the library's launch
  (``zonal._scatter_op``, past the CUDA gate);
* ``steps`` -> model_steps.csv and profile_*: the force and training steps with the
  reference and the fused scatter (the linear on the einsum: only the scatter
  changes);
* ``ncu`` -> ncu_fused.csv: the gather and the forward at the library's launch.

The launch sweep (launch_sweep.csv, still read by the chapter) is retired to
``book/history/02_linear/launch_sweeps.md``.
"""

from __future__ import annotations

import torch

from .. import bench
from . import schema
from .common import (
    ceilings,
    free,
    ncu_part,
    option_steps,
    profile_table,
    rel_err_gpu,
    timing_columns,
)

__all__ = ["PARTS", "launch_label", "random_scatter"]


def launch_label(launch) -> str:
    """A ``ZonalLaunch`` as one line for a CSV column."""
    return (
        f"degrees tile={launch.fwd_tile} w={launch.fwd_warps} "
        f"st={launch.fwd_stages}; edge tile={launch.bwd_tile} w={launch.bwd_warps}"
    )


def notes(run) -> dict:
    """The manifest's notes before any part runs: the library's launch."""
    from .. import zonal

    return {"config": launch_label(zonal.ZonalLaunch())}


def random_scatter(E: int, L: int, C: int, dev: str, seed: int):
    """A random scatter of ``E`` edges onto ``N = E // 89`` atoms (the diamond's
    in-degree), float64: ``(N, dst, row_ptr, Z, R, G)``, ``dst`` sorted with its CSR
    ``row_ptr``, ``Z`` ``(E, S - 1)`` and ``R`` ``(E, L, C)`` the edges' inputs and
    ``G`` ``(N, S, C)`` an output's gradient (S = (L + 1)^2)."""
    from ..graph import csr_row_ptr

    N, S = max(1, E // 89), (L + 1) ** 2
    g = torch.Generator(device=dev).manual_seed(seed)
    dst = torch.sort(torch.randint(0, N, (E,), device=dev, generator=g)).values
    rnd = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.float64,
                                     generator=g)  # fmt: skip
    return N, dst, csr_row_ptr(dst, N), rnd(E, S - 1), rnd(E, L, C), rnd(N, S, C)


# --------------------------------------------------------------------------------------
# the sweep over E, L and C
# --------------------------------------------------------------------------------------
def _cases(quick: bool, dev: str) -> list[tuple[int, int, int]]:
    small = (4096, 3, 32) if dev == "cuda" else (300, 2, 8)
    if quick:
        return [small]
    return (
        [(E, 3, 32) for E in (46_000, 365_000, 1_000_000, 3_000_000)]
        + [(365_000, L, 32) for L in (1, 2, 4)]
        + [(365_000, 3, C) for C in (16, 64, 100)]
    )


def _sweep(run, arg: str) -> str:
    """Rows of scatter_sweep.csv."""
    from .. import reference, zonal

    out, quick, dev = run.out, run.quick, run.dev
    ceil = ceilings()
    label = launch_label(zonal.ZonalLaunch())
    rows: list[dict] = []
    ops = {"reference": reference.zonal_scatter, "fused": zonal._scatter_op}
    for E, L, C in _cases(quick, dev):
        N, dst, row_ptr, Z64, R64, _ = random_scatter(E, L, C, dev, E + L + C)
        truth = reference.zonal_scatter(Z64, R64, dst, row_ptr, 0.1)
        Z, R = Z64.float().requires_grad_(), R64.float().requires_grad_()
        model = zonal.traffic(E, N, L, C, 4)
        floor = bench.floor_ms(model["bytes_fwd"], 0, ceil["copy_GBps"])
        problem = f"E={E}, L={L}, C={C}"
        for name, fn in ops.items():
            try:
                t, cols = _sweep_row(fn, name == "fused", Z, R, dst, row_ptr, truth)
            except Exception as exc:
                err = repr(exc)[:300]
                rows.append(schema.kernel_row(name, problem, E, "float32", None,
                                              L=L, C=C, error=err))  # fmt: skip
                schema.write(rows, out / "scatter_sweep.csv", schema.KERNEL_COLUMNS)
                continue
            gpu_f, b2b_f = cols["forward_gpu_ms"], cols["forward_b2b_ms"]
            rows.append(schema.kernel_row(
                name, problem, E, "float32", t, model["bytes_fwd"], N=N, L=L, C=C,
                **cols, floor_ms=floor, floor_fraction=floor / t.median,
                floor_fraction_gpu=floor / gpu_f, floor_fraction_b2b=floor / b2b_f,
                config=label if name == "fused" else "",
            ))  # fmt: skip
            print(name, E, L, C, f"fwd {t.median:.3f} ms (gpu {gpu_f:.3f}, b2b "
                  f"{b2b_f:.3f}) fwd+bwd {cols['fwd_bwd_ms']:.3f} ms (gpu "
                  f"{cols['fwd_bwd_gpu_ms']:.3f}) err {cols['rel_err_vs_fp64']:.1e}",
                  flush=True)  # fmt: skip
            schema.write(rows, out / "scatter_sweep.csv", schema.KERNEL_COLUMNS)
        free()


def _sweep_row(fn, fused: bool, Z, R, dst, row_ptr, truth) -> tuple:
    """One op at one shape: its eager forward's Timing and its other columns: eager
    times, and for the fused op its kernels' GPU time alone (CUDA graph replay: the
    op's host-side launch cost is larger than its kernels at small E) and back to
    back. The backward's kernel is the gather
    (autograd's engine is not graphed; the reference checks its CSR on the host: not
    capturable)."""
    from .. import zonal

    args = (Z.detach(), R.detach(), dst, row_ptr, 0.1)
    h = fn(Z, R, dst, row_ptr, 0.1)
    err = rel_err_gpu(h, truth)
    G = torch.randn_like(h)
    t_f = bench.time_fn(lambda: fn(Z, R, dst, row_ptr, 0.1))

    def fwd_bwd():
        torch.autograd.backward(fn(Z, R, dst, row_ptr, 0.1), G)

    t_fb = bench.time_fn(fwd_bwd)
    mem = bench.peak_memory(fwd_bwd)
    g_f = g_fb = b_f = b_fb = None
    if fused:
        g_f = bench.time_graph(lambda: zonal._scatter_op(*args))
        g_fb = bench.time_graph(
            lambda: (zonal._scatter_op(*args), zonal._gather_op(G, *args))
        )
        # back to back, alternating between two copies of the inputs (together past
        # the 60 MB of L2 from E = 365k up)
        args2 = (Z.detach().clone(), R.detach().clone(), *args[2:])
        b_f = bench.time_back_to_back(
            [lambda a=a: zonal._scatter_op(*a) for a in (args, args2)]
        )
        b_fb = bench.time_back_to_back(
            [
                lambda a=a: (zonal._scatter_op(*a), zonal._gather_op(G, *a))
                for a in (args, args2)
            ]
        )
    nan = bench.Timing(float("nan"), float("nan"), float("nan"), 0)  # not timed
    g_f, g_fb, b_f, b_fb = (x or nan for x in (g_f, g_fb, b_f, b_fb))
    return t_f, {
        "fwd_bwd_ms": t_fb.median, **timing_columns("forward_gpu", g_f),
        "fwd_bwd_gpu_ms": g_fb.median, **timing_columns("forward_b2b", b_f),
        "fwd_bwd_b2b_ms": b_fb.median, "peak_MiB": mem / 2**20,
        "rel_err_vs_fp64": err,
    }  # fmt: skip


# --------------------------------------------------------------------------------------
# model steps
# --------------------------------------------------------------------------------------
#: The options of the steps: the reference scatter against the fused op, the linear
#: on the einsum (only the scatter changes).
STEP_OPTIONS = {  # (the stack as before chapter 6: the linears, no cohorts)
    scatter: {"linear": "einsum", "zonal": scatter, "stack": "linears",
              "memory": "plain"}
    for scatter in ("reference", "fused")
}  # fmt: skip


def _train(model, pos, numbers, graph):
    """A force-training step: the loss of the energy and the forces, backward."""
    from ecekern.model import force_step

    model.zero_grad(set_to_none=True)
    e, f = force_step(model, pos, numbers, graph, create_graph=True)
    (e**2 + (f**2).sum()).backward()


def _model_steps(run, arg: str) -> str:
    """model_steps.csv (step schema, ``kind``: force or training step): the reference
    scatter against the fused op, strict fp32: time, peak memory, and a profiler
    table of each at the larger box."""
    from ecekern import zonal
    from ecekern.model import force_step

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


_ncu = ncu_part({"fused": ("zonal_fused", None)})
PARTS = {"sweep": _sweep, "steps": _model_steps, "ncu": _ncu}
GPU_ONLY = ("steps", "ncu")
