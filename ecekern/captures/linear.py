"""Chapter 2's capture: EquivariantLinear, einsum vs dense vs the per-mode kernels.

Parts (``parts``, comma-separated):

* ``launch`` -> launch_sweep.csv: every kernel's launch choices at E = 47k, F = 192,
  n_ang = 3 (one of cos and sin), strict fp32, TF32 and bf16: the Triton kernel's
  ``TritonLaunch`` variants, the Gluon FMA kernel's register tiles (``FmaLaunch``) and
  the Gluon tensor-core kernel's ``gluon_tc.Launch``; the fastest per precision is
  reported (the library's own table is ``linear.plan.LAUNCH``: a human changes it);
* ``steps`` (or ``steps=dense;einsum``) -> model_steps.csv and profile_step_*: the
  force step with each path, the zonal scatter on the reference;
* ``ncu`` -> ncu_triton.csv, ncu_dense.csv: the forward of each precision at the
  library's choice of kernel and launch, then the Triton kernel in strict fp32
  (:func:`ecekern.captures.targets.eqlin_triton`), and the dense path's;
* ``sweep`` (or ``sweep=E:n_ang;E:n_ang:tf32/bf16``, see :func:`sweep_cell`) ->
  linear_sweep.csv: forward and forward + backward times against the floor, and the
  error against float64. The ``triton`` path is called past ``auto``'s choice
  (``EquivariantLinearFn``): these rows are how that choice is made.
"""

from __future__ import annotations

import csv
import itertools
from typing import Any

import torch

from .. import bench
from . import schema
from .common import (
    LaunchCase,
    ceilings,
    free,
    launch_sweep,
    ncu_part,
    option_steps,
    profile_table,
    rel_err_gpu,
)

__all__ = ["PARTS", "PATHS_MEASURED", "kernel_fn", "launch_cases", "sweep_cell"]

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
# launch sweep
# --------------------------------------------------------------------------------------
#: Tiles of the Triton kernel: (BLOCK_B, BLOCK_K, BLOCK_O, warps), the fastest of the
#: wider tuning runs (history/02_linear)
TILES = [(64, 64, 64, 4), (64, 32, 64, 4), (32, 64, 64, 4), (32, 32, 64, 4)]
#: (variant, switches, tiles, stages): the strided loads at one and two stages; then
#: the next K step prefetched (pre), the modes interleaved in registers for one store
#: (st3, or built by tl.join: st3j) and W through a tensor descriptor (desc), at two
#: stages (the descriptor loads of W are pipelined only with two or more)
TRITON_KINDS = [("strided", {}, TILES[:3], (1, 2))] + [
    (name, flags, TILES[1:], (2,))
    for name, flags in (
        ("pre", {"prefetch": True}),
        ("pre+st3", {"prefetch": True, "store3": True}),
        ("pre+desc", {"prefetch": True, "w_desc": True}),
        ("pre+st3+desc", {"prefetch": True, "store3": True, "w_desc": True}),
        (
            "pre+st3j+desc",
            {"prefetch": True, "store3": True, "w_desc": True, "join": True},
        ),
    )
]


def launch_cases(
    data: dict, E: int, F: int, n_ang: int, quick: bool, dev: str
) -> list[LaunchCase]:
    """Every launch of the sweep: ``data`` maps a dtype to ``(x, w, bias)`` (the
    Gluon kernels' conditions are read off them)."""
    from ..linear import gluon_fma, gluon_tc, triton_modes

    nbytes = _bytes(E, F, n_ang, data)
    copy = ceilings()["copy_GBps"]
    problem = f"E={E}, F={F}, n_ang={n_ang}"
    cases = []
    for dtype, tf32 in ((torch.float32, False), (torch.float32, True),
                        (torch.bfloat16, False)):  # fmt: skip
        label = "float32+tf32" if tf32 else str(dtype).replace("torch.", "")
        tol = 1e-5 if dtype == torch.float32 and not tf32 else 3e-2
        floor = {"floor_ms": nbytes[dtype] / (copy * 1e6)}

        def case(kernel, launch, variant, bb, bk, bo, warps, stages, dtype=dtype,
                 tf32=tf32, tol=tol, label=label, floor=floor, **more):  # fmt: skip
            keys = {"variant": variant, "block_b": bb, "block_k": bk, "block_o": bo,
                    "warps": warps, "stages": stages, **more}  # fmt: skip
            return LaunchCase(label, launch, kernel, problem, E, keys, dtype, tf32,
                              tol, nbytes[dtype], floor)  # fmt: skip

        triton = triton_modes.TritonLaunch
        mine = [
            case("triton", triton(*tile, st, **flags), name, *tile, st)
            for name, flags, tiles, stages in TRITON_KINDS
            for tile, st in itertools.product(tiles[:2] if quick else tiles, stages)
        ]
        if dev != "cuda":  # the interpreter runs every tile at 16 x 16 x 16: a few
            mine = mine[:3]
        x, w, _ = data[dtype]
        # strict fp32: the Gluon kernel on the FMA units, each register tile
        if gluon_fma.fma_reason(x, w, tf32) is None:
            g = gluon_fma
            for tile, cap in itertools.product(g.TILES, (168, None)):
                name = f"fma{tile}" + ("" if cap else " nocap")
                tiles = (g.BLOCK_B, g.BLOCK_K, g.BLOCK_O, g.WARPS, 1)
                launch = g.FmaLaunch(tile, cap)
                mine.append(case("fma", launch, name, *tiles, maxnreg=cap or ""))
        # bf16 and TF32: the Gluon kernel that splits the modes on the tensor cores
        if (dtype == torch.bfloat16 or tf32) and gluon_tc.tc_reason(x, w) is None:
            default = gluon_tc.default_launch(dtype, F)
            launches = [default]
            if dtype == torch.bfloat16:
                launches += [gluon_tc.Launch(64, 1, 2, 0), gluon_tc.Launch(64, 1, 3, 0)]
            for ln in dict.fromkeys(launches):
                name = "tc" if ln == default else f"tc c{ln.consumers} s{ln.stages}"
                # rows in flight per program, its warps: the consumers' and the loader's
                mine.append(case("tc", ln, name, 64 * ln.consumers,
                                 gluon_tc.BLOCK_K[dtype], ln.block_o,
                                 4 * ln.consumers + 1, ln.stages))  # fmt: skip
        cases += mine
    return cases


def _bytes(E, F, n_ang, data) -> dict:
    """The bytes one of cos and sin must move, by dtype (its DRAM floor)."""
    from .. import linear

    return {
        dt: linear.traffic(E, F, F, n_ang, x.element_size())["bytes"] / 2
        for dt, (x, *_) in data.items()
    }


def kernel_fn(kernel: str, launch, tf32: bool, w: torch.Tensor):
    """``fn(x, b) -> y``: one of cos and sin through ``kernel`` (``triton``, ``fma``
    or ``tc``) at ``launch`` against ``w``, with what the kernel reads (for ``fma``,
    W with O contiguous) prepared here, once, outside any timing."""
    from ..linear import gluon_fma, gluon_tc, triton_modes

    if kernel == "fma":
        w_o = w.transpose(1, 2).contiguous().transpose(1, 2)
        return lambda x, b: gluon_fma.fma_fwd(x, w_o, b, launch)
    if kernel == "tc":
        return lambda x, b: gluon_tc.tc_fwd(x, w, b, launch)
    return lambda x, b: triton_modes.triton_fwd(x, w, b, launch, tf32)


def _launch(run, arg: str) -> dict:
    """launch_sweep.csv: each case timed and checked against float64; the notes
    name the fastest correct launch per precision."""
    from .. import reference

    quick, dev = run.quick, run.dev
    E, F, n = (4096, 192, 3) if quick else (47_000, 192, 3)
    if dev != "cuda":
        E, F = 64, 32
    g = torch.Generator(device=dev).manual_seed(3)
    x64 = torch.randn(E, F, n, device=dev, dtype=torch.float64, generator=g)
    w64 = torch.randn(n, F, F, device=dev, dtype=torch.float64, generator=g) / F**0.5
    b64 = torch.randn(F, device=dev, dtype=torch.float64, generator=g)
    truth = reference.equivariant_linear(x64, x64, w64, b64)[0]
    data = {dt: (x64.to(dt), w64.to(dt), b64.to(dt))
            for dt in (torch.float32, torch.bfloat16)}  # fmt: skip
    fns: dict[int, Any] = {}  # each case's kernel, its operands prepared once

    def run_case(case):
        x, w, b = data[case.dtype]
        if id(case) not in fns:
            fns[id(case)] = kernel_fn(case.kernel, case.launch, case.tf32, w)
        return fns[id(case)](x, b)

    cases = launch_cases(data, E, F, n, quick, dev)
    out = run.out / "launch_sweep.csv"
    chosen = launch_sweep(cases, run_case, lambda c, y: rel_err_gpu(y, truth), out)
    free()
    return {"launch": {k: f"{c.kernel} {c.keys['variant']}: {c.launch!r}"
                       for k, c in chosen.items()}}  # fmt: skip


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
PARTS = {"launch": _launch, "steps": _model_steps, "ncu": _ncu, "sweep": _sweep}
GPU_ONLY = ("steps", "ncu")
