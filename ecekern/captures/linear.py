"""Chapter 2's capture: EquivariantLinear, einsum vs dense vs the per-mode kernels.

Parts (``parts``, comma-separated):

* ``steps`` (or ``steps=dense;einsum``) -> model_steps.csv and profile_step_*: the
  force step with each path, the zonal scatter on the reference;
* ``ncu`` -> ncu_triton.csv, ncu_dense.csv: the forward of each precision at the
  library's choice of kernel and launch, then the Triton kernel in strict fp32
  (:func:`ecekern.captures.targets.eqlin_triton`), and the dense path's;
* ``sweep`` (or ``sweep=E:n_ang;E:n_ang:tf32/bf16``, see :func:`sweep_cell`) ->
  linear_sweep.csv: forward and forward + backward times against the floor, and the
  error against float64. The ``triton`` path is called past ``auto``'s choice
  (``EquivariantLinearFn``): these rows are how that choice is made.

The launch sweep of the kernels (launch_sweep.csv, still read by the chapter) is
retired to ``book/history/02_linear/launch_sweeps.md``.
"""

from __future__ import annotations

import csv
import itertools

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
)

__all__ = ["PARTS", "PATHS_MEASURED", "sweep_cell"]

PATHS_MEASURED = ("einsum", "dense", "triton")
#: The precisions of the sweeps: (dtype, TF32, the GEMM ceiling's key)
PRECISIONS = {
    "fp32": (torch.float32, False, "gemm_float32"),
    "tf32": (torch.float32, True, "gemm_float32+tf32"),
    "bf16": (torch.bfloat16, False, "gemm_bfloat16"),
}


def notes(run) -> dict:
    """The manifest's notes before any part runs: the library's launch table."""
    from ..linear import plan

    return {"library_launch": {k: repr(v) for k, v in plan.LAUNCH.items()}}


# --------------------------------------------------------------------------------------
# model steps
# --------------------------------------------------------------------------------------
#: The options of the force step with each EquivariantLinear path (the zonal scatter
#: on the reference: only the linear changes).
STEP_OPTIONS = {  # (the stack as before chapter 6: the linears, no cohorts)
    path: {"linear": path, "zonal": "reference", "stack": "linears", "memory": "plain"}
    for path in PATHS_MEASURED
}


def _model_steps(run, arg: str) -> str:
    """model_steps.csv (step schema): the model's force step with each
    EquivariantLinear path (``steps=dense;einsum``: some), strict fp32 and TF32:
    time, peak memory, and from a profile of each the calls per step of the ops the
    einsum path brings (copies, bmm) and the GEMMs of the dense path."""
    from ecekern.model import force_step

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


# --------------------------------------------------------------------------------------
# the E sweep
# --------------------------------------------------------------------------------------
def sweep_cell(
    spec: str, precisions, paths=PATHS_MEASURED
) -> tuple[int, int, list[str], list[str]]:
    """``"E:n_ang"``, ``"E:n_ang:tf32/bf16"`` (some precisions only) or
    ``"E:n_ang:tf32/bf16:triton"`` (and some paths only; ``:all:`` for every
    precision) as ``(E, n_ang, [precision, ...], [path, ...])``."""
    E, n, *which = spec.split(":")
    names = which[0].split("/") if which and which[0] != "all" else list(precisions)
    chosen = which[1].split("/") if len(which) > 1 else list(paths)
    unknown = [p for p in names if p not in precisions]
    unknown += [p for p in chosen if p not in paths]
    if len(which) > 2 or unknown:
        raise ValueError(
            f"sweep cell {spec!r}: E:n_ang, E:n_ang:p1/p2 or E:n_ang:p1/p2:path1/path2 "
            f"with p in {'/'.join(precisions)} (or all), path in {'/'.join(paths)}"
        )
    return int(E), int(n), names, chosen


def _paths() -> dict:
    from .. import reference
    from ..linear import autograd, dense

    def triton(xc, xs, w, b):  # the library's triton path, whatever auto would take
        return autograd.EquivariantLinearFn.apply(
            xc, xs, w, b, torch.backends.cuda.matmul.allow_tf32
        )

    return {
        "einsum": reference.equivariant_linear,
        "dense": dense.dense,
        "triton": triton,
    }


def _sweep(run, spec: str) -> str:
    """Rows of linear_sweep.csv (kernel schema: ``kernel`` the path, ``n`` the edges,
    with ``F`` and ``n_ang``): for each (E, n_ang) cell, fresh inputs, every
    precision and path."""
    from .. import linear, reference

    out, quick, dev = run.out, run.quick, run.dev
    ceil = ceilings()
    paths = _paths()
    F = 192 if dev == "cuda" else 32  # a CPU run is a smoke test in the interpreter
    Es = ([4096] if dev == "cuda" else [64]) if quick else [47_000, 365_000]
    angs = [3] if quick else [2, 3, 4, 5]
    cells = [(E, n, list(PRECISIONS), list(paths)) for E in Es for n in angs]
    if spec:
        cells = [sweep_cell(c, PRECISIONS, tuple(paths)) for c in spec.split(";")]
    rows: list[dict] = []
    for E, n_ang, which, cell_paths in cells:
        g = torch.Generator(device=dev).manual_seed(E + n_ang)
        x64 = [
            torch.randn(E, F, n_ang, device=dev, dtype=torch.float64, generator=g)
            for _ in range(2)
        ]
        w64 = torch.randn(n_ang, F, F, device=dev, dtype=torch.float64, generator=g)
        w64 /= F**0.5
        b64 = torch.randn(F, device=dev, dtype=torch.float64, generator=g)
        truth = reference.equivariant_linear(*x64, w64, b64)
        for dtype, tf32, ceiling in (PRECISIONS[p] for p in which):
            bench.set_tf32(tf32)
            xc, xs = (t.to(dtype).requires_grad_() for t in x64)
            w, b = w64.to(dtype).requires_grad_(), b64.to(dtype).requires_grad_()
            args = (xc, xs, w, b)
            model = linear.traffic(E, F, F, n_ang, xc.element_size())
            precision = bench.dtype_label(dtype)

            def row(name, t, *work, precision=precision, E=E, n_ang=n_ang, **extra):
                problem = f"E={E}, F={F}, n_ang={n_ang}: cos and sin"
                return schema.kernel_row(name, problem, E, precision, t, *work, F=F,
                                         n_ang=n_ang, **extra)  # fmt: skip

            for name in cell_paths:
                fn = paths[name]
                try:
                    y = fn(*args)
                    err = max(rel_err_gpu(a, t) for a, t in zip(y, truth))
                    t_f = bench.time_fn(lambda fn=fn, a=args: fn(*a))
                    gy = [torch.randn_like(t) for t in y]

                    def fwd_bwd(fn=fn, gy=gy, a=args):
                        torch.autograd.backward(fn(*a), gy)

                    t_fb = bench.time_fn(fwd_bwd)
                    g_f = bench.time_graph(lambda fn=fn, a=args: fn(*a))
                except Exception as exc:
                    rows.append(row(name, None, error=repr(exc)[:300]))
                    schema.write(rows, out / "linear_sweep.csv", schema.KERNEL_COLUMNS)
                    continue
                floor = bench.floor_ms(
                    model["bytes"], model["flops"], ceil["copy_GBps"], ceil.get(ceiling)
                )
                rows.append(row(
                    name, t_f, model["bytes"], model["flops"], fwd_bwd_ms=t_fb.median,
                    forward_gpu_ms=g_f.median if g_f else float("nan"), floor_ms=floor,
                    floor_fraction=floor / t_f.median, rel_err_vs_fp64=err,
                ))  # fmt: skip
                print(name, E, n_ang, rows[-1]["precision"], f"{t_f.median:.3f} ms",
                      f"({100 * floor / t_f.median:.0f} % of floor) err {err:.1e}",
                      flush=True)  # fmt: skip
                schema.write(rows, out / "linear_sweep.csv", schema.KERNEL_COLUMNS)
        bench.set_tf32(False)
        free()
    return "done"


_ncu = ncu_part({"triton": ("eqlin_triton", None), "dense": ("eqlin_dense", None)})
PARTS = {"steps": _model_steps, "ncu": _ncu, "sweep": _sweep}
GPU_ONLY = ("steps", "ncu")
