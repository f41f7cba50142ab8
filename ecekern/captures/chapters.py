"""What each chapter's capture measures. Runs on a CUDA GPU only."""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import bench

NCU_METRICS_BASIC = [
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "lts__t_bytes.sum",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
]
#: Shared-memory bank conflicts and instruction counts (tried first, dropped if this
#: ncu does not know them)
NCU_COUNTERS = [
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "smsp__inst_executed.sum",
    "smsp__inst_executed_pipe_fma.sum",
]
NCU_STALLS = [
    f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio"
    for r in (
        "long_scoreboard",
        "short_scoreboard",
        "mio_throttle",
        "lg_throttle",
        "math_pipe_throttle",
        "barrier",
        "wait",
        "not_selected",
        "selected",
    )
]


def run_ncu(
    target: str, out_csv: Path, extra: list[str] | None = None, timeout=420
) -> str:
    """Run ncu on ``targets.<target>``; write the raw CSV page, return a status."""
    for metrics in (
        NCU_METRICS_BASIC + NCU_STALLS + NCU_COUNTERS,
        NCU_METRICS_BASIC + NCU_STALLS,
        NCU_METRICS_BASIC,
    ):
        cmd = [
            "ncu",
            "--clock-control",
            "none",
            "--nvtx",
            "--nvtx-include",
            "ece/",
            "--metrics",
            ",".join(metrics),
            "--csv",
            "--page",
            "raw",
            *(extra or []),
            sys.executable,
            "-m",
            "ecekern.captures.targets",
            target,
        ]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except Exception as exc:  # ncu missing or too slow
            status = f"ncu failed: {exc!r}"
            continue
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith('"')]
        if p.returncode == 0 and len(lines) > 2:
            out_csv.write_text("\n".join(lines) + "\n")
            return f"ok ({len(lines) - 2} kernels, {len(metrics)} metrics)"
        status = f"ncu rc={p.returncode}: {(p.stderr or p.stdout)[-400:]}"
    return status


def _profile_table(fn, out_dir: Path, stem: str, iters: int = 3) -> None:
    """torch.profiler over ``iters`` calls: a text table and a CSV of every op."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    sort = "self_cuda_time_total"
    (out_dir / f"{stem}_table.txt").write_text(ka.table(sort_by=sort, row_limit=40))
    rows = []
    for e in ka:
        self_dev = getattr(e, "self_device_time_total", None)
        if self_dev is None:
            self_dev = e.self_cuda_time_total
        dev = getattr(e, "device_time_total", None)
        if dev is None:
            dev = e.cuda_time_total
        rows.append(
            {
                "name": e.key,
                "device_type": str(getattr(e, "device_type", "")).split(".")[-1],
                "calls_per_step": e.count / iters,
                "self_cuda_ms_per_step": self_dev / 1e3 / iters,
                "cuda_total_ms_per_step": dev / 1e3 / iters,
                "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / iters,
            }
        )
    rows.sort(key=lambda r: -r["self_cuda_ms_per_step"])
    bench.write_csv(rows, out_dir / f"{stem}_ops.csv")


def _error_row(exc: Exception, dtype: torch.dtype, **keys) -> dict:
    """A sweep row for a case that raised (out of resources, say): its keys, the
    error, and the provenance, so the CSV says what failed and where."""
    return {**keys, "error": repr(exc)[:300], **bench.provenance(dtype)}


def _free():
    gc.collect()
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------
def methodology(out: Path, quick: bool = False, ncu: bool = True) -> dict:
    """The roofline: device copy bandwidth and GEMM rates, by our own harness."""
    rows = []
    sizes = [2**26, 2**28] if quick else [2**24, 2**26, 2**28, 2**30, 2**32]
    for nbytes in sizes:
        src = torch.randn(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        # a same-dtype copy_ is a cudaMemcpy; torch.neg is a read-one-write-one kernel
        for kind, fn in (
            ("copy", lambda src=src, dst=dst: dst.copy_(src)),
            ("elementwise", lambda src=src, dst=dst: torch.neg(src, out=dst)),
        ):
            t = bench.time_fn(fn)
            rows.append(
                {
                    "kind": kind,
                    "case": f"{nbytes / 2**20:.0f} MiB",
                    "bytes": 2 * nbytes,
                    "flops": 0,
                    "median_ms": t.median,
                    "p10_ms": t.p10,
                    "p90_ms": t.p90,
                    "rate": 2 * nbytes / t.median / 1e6,
                    "unit": "GB/s",
                    **bench.provenance(torch.float32),
                }
            )
        del src, dst
        _free()
    n = 4096 if quick else 8192
    for dtype, tf32 in [
        (torch.float64, False),
        (torch.float32, False),
        (torch.float32, True),
        (torch.bfloat16, False),
        (torch.float16, False),
    ]:
        bench.set_tf32(tf32)
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        t = bench.time_fn(lambda a=a, b=b: a @ b)
        rows.append(
            {
                "kind": "gemm",
                "case": f"{n}^3",
                "bytes": 3 * n * n * a.element_size(),
                "flops": 2 * n**3,
                "median_ms": t.median,
                "p10_ms": t.p10,
                "p90_ms": t.p90,
                "rate": 2 * n**3 / t.median / 1e9,
                "unit": "TFLOP/s",
                **bench.provenance(dtype),
            }
        )
        del a, b
        _free()
    bench.set_tf32(False)
    bench.write_csv(rows, out / "ceilings.csv")
    info = {}
    if ncu:
        info["ncu_copy"] = run_ncu("copy", out / "ncu_copy.csv")
        info["ncu_gemm"] = run_ncu("gemm", out / "ncu_gemm.csv")
    return info


# --------------------------------------------------------------------------------------
def _force_rows(name, model, inputs, dtype, extra=None, rep_ms=400.0):
    from ..model import force_step

    pos, numbers, graph = inputs

    def fwd():
        with torch.no_grad():
            model(pos, numbers, graph)

    step = lambda: force_step(model, pos, numbers, graph)
    t_f = bench.time_fn(fwd, rep_ms=rep_ms)
    t_s = bench.time_fn(step, rep_ms=rep_ms)
    mem = bench.peak_memory(step)
    return {
        "model": name,
        "n_atoms": pos.shape[0],
        "n_edges": graph.n_edges,
        "forward_ms": t_f.median,
        "forward_p10_ms": t_f.p10,
        "forward_p90_ms": t_f.p90,
        "step_ms": t_s.median,
        "step_p10_ms": t_s.p10,
        "step_p90_ms": t_s.p90,
        "backward_ms": t_s.median - t_f.median,
        "peak_mem_MiB": mem / 2**20,
        "reps": t_s.n,
        **(extra or {}),
        **bench.provenance(dtype),
    }


def _print_row(r):
    print(r["model"], r["n_atoms"], r["dtype"], f"{r['step_ms']:.2f} ms", flush=True)


def einsum_reference(
    out: Path,
    quick: bool = False,
    ncu: bool = True,
    parts: str = "reference,profiles,peers,ncu,scaling",
    boxes: str | None = None,
) -> dict:
    """Chapter 1: the reference force step, by stage, against size, and the peers.

    ``parts`` (comma-separated) selects what to run; each part writes its own files:
    ``reference`` -> force_step.csv, ``profiles`` -> profile_*, ``peers`` ->
    peers.csv, ``ncu`` -> ncu_force_step.csv, ``scaling`` -> scaling.csv.
    """
    import ecekern
    from ecekern.model import force_step, prepare_inputs
    from ecekern.peers import E3nnConvModel

    todo = parse_parts(parts, ("reference", "profiles", "peers", "ncu", "scaling"))
    cfg = ecekern.ECEConfig()
    info: dict = {"parts": sorted(todo)}
    boxes = (
        [int(b) for b in boxes.split(",")] if boxes else ([2, 4] if quick else [4, 8])
    )
    # 1. the reference at the two standard boxes, strict fp32, fp32+tf32, fp64
    if "reference" in todo:
        rows = []
        for rep in boxes:
            atoms = ecekern.systems.diamond(rep)
            for dtype, tf32 in [
                (torch.float32, False),
                (torch.float32, True),
                (torch.float64, False),
            ]:
                bench.set_tf32(tf32)
                model = ecekern.ECEModel(cfg).to(device="cuda", dtype=dtype)
                t0 = time.perf_counter()
                inputs = prepare_inputs(atoms, cfg.cutoff, dtype, "cuda")
                torch.cuda.synchronize()
                g_ms = (time.perf_counter() - t0) * 1e3
                rows.append(
                    _force_rows(
                        "reference", model, inputs, dtype, {"graph_ms_wall": g_ms}
                    )
                )
                _print_row(rows[-1])
                del model, inputs
                _free()
            bench.set_tf32(False)
        bench.write_csv(rows, out / "force_step.csv")
    # 2. profiles of the strict-fp32 force step
    if "profiles" in todo:
        for rep in boxes:
            model = ecekern.ECEModel(cfg).to(device="cuda", dtype=torch.float32)
            inputs = prepare_inputs(
                ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, "cuda"
            )
            _profile_table(
                lambda m=model, i=inputs: force_step(m, *i),
                out,
                f"profile_step_{8 * rep**3}",
            )
            with torch.no_grad():
                _profile_table(
                    lambda m=model, i=inputs: m(*i),
                    out,
                    f"profile_forward_{8 * rep**3}",
                )
            del model, inputs
            _free()
    # 3. the peers at the same width and degree, strict fp32
    if "peers" in todo:
        rows = []
        for rep in boxes:
            atoms = ecekern.systems.diamond(rep)
            inputs = prepare_inputs(atoms, cfg.cutoff, torch.float32, "cuda")
            model = ecekern.ECEModel(cfg).to(device="cuda", dtype=torch.float32)
            try:
                # a fresh compile per box: static shapes, as a user with one system has
                torch._dynamo.reset()
                compiled = torch.compile(model)
                t0 = time.perf_counter()
                force_step(compiled, *inputs)
                torch.cuda.synchronize()
                extra = {"compile_s": time.perf_counter() - t0}
                name = "reference + torch.compile"
                rows.append(_force_rows(name, compiled, inputs, torch.float32, extra))
                _print_row(rows[-1])
            except Exception as exc:
                info[f"compile_{rep}"] = f"failed: {exc!r}"[:500]
            del model
            _free()
            try:
                peer = E3nnConvModel(cfg).to(device="cuda", dtype=torch.float32)
                name = "e3nn TP conv (NequIP-style)"
                rows.append(_force_rows(name, peer, inputs, torch.float32))
                _print_row(rows[-1])
                bench.write_csv(rows, out / "peers.csv")
            except Exception as exc:
                info[f"e3nn_{rep}"] = f"failed: {exc!r}"[:500]
            del inputs
            _free()
        bench.write_csv(rows, out / "peers.csv")
    if ncu and "ncu" in todo:
        info["ncu_force_step"] = run_ncu(
            "force_step", out / "ncu_force_step.csv", timeout=180
        )
    # 4. time and peak memory against system size, strict fp32, until memory runs out
    if "scaling" in todo:
        scale_rows = []
        reps = [2, 3, 4] if quick else [2, 3, 4, 5, 6, 8, 10, 12, 14, 16]
        t_start = time.time()
        for rep in reps:
            if time.time() - t_start > 240:
                info["scaling_stopped"] = (
                    f"time budget reached before {8 * rep**3} atoms"
                )
                break
            try:
                model = ecekern.ECEModel(cfg).to(device="cuda", dtype=torch.float32)
                inputs = prepare_inputs(
                    ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, "cuda"
                )
                row = _force_rows(
                    "reference",
                    model,
                    inputs,
                    torch.float32,
                    rep_ms=200.0 if rep < 10 else 50.0,
                )
                scale_rows.append(row)
                bench.write_csv(scale_rows, out / "scaling.csv")
                print(
                    "scale",
                    rep,
                    f"{row['step_ms']:.1f} ms",
                    f"{row['peak_mem_MiB']:.0f} MiB",
                    flush=True,
                )
            except torch.cuda.OutOfMemoryError:
                info["scaling_stopped"] = f"out of memory at {8 * rep**3} atoms"
                break
            finally:
                model = inputs = None
                _free()
        bench.write_csv(scale_rows, out / "scaling.csv")
    return info


# --------------------------------------------------------------------------------------
def _device() -> str:
    """``cuda`` where there is a GPU; on a CPU the sweeps run as a smoke test."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _ceilings() -> dict:
    """Our measured H200 ceilings from the methodology capture (fallbacks otherwise)."""
    from . import load

    c = dict(bench.CEILINGS_H200)
    try:
        rows = load("methodology").csv("ceilings")
    except FileNotFoundError:
        return c
    c["copy_GBps"] = max(
        r["rate"] for r in rows if r["kind"] in ("copy", "elementwise")
    )
    for r in rows:
        if r["kind"] == "gemm":
            c[f"gemm_{r['dtype']}"] = r["rate"]
    return c


def block_diagonal_gemm(
    out: Path,
    quick: bool = False,
    ncu: bool = True,
    parts: str = "launch,steps,ncu,sweep",
) -> dict:
    """Chapter 2: EquivariantLinear, einsum vs dense vs triton, over E, n_ang, dtype.

    Each row: forward and forward+backward times, the floor (DRAM bytes at the copy
    bandwidth, or the needed flops at the dtype's GEMM ceiling), the fraction of it,
    and the relative error of the forward against float64 on fresh inputs. The Triton
    path is called past its CUDA gate (``_EquivariantLinearFn``): these rows are how
    the gate gets lifted.

    ``parts`` (comma-separated): ``launch``, ``steps`` (or ``steps=dense;einsum``
    for some paths), ``ncu``, ``sweep`` (or ``sweep=E:n_ang;E:n_ang:tf32/bf16`` for some
    cells, ``E:n_ang:all:triton`` for some paths: see :func:`sweep_cell`). Without
    ``launch`` the library's launch choices are used.
    """
    from .. import linear, reference

    ceil = _ceilings()
    rows = []
    dev = _device()
    todo = parse_parts(parts, ("launch", "steps", "ncu", "sweep"))
    info = {"parts": parts}
    if dev == "cuda" and "launch" in todo:
        # first: the launch choices the rest of the capture then uses
        chosen = _linear_launch_sweep(out, quick)
        info["launch"] = {k: str(v) for k, v in chosen.items()}
        info["launch_configs"] = {k: list(v) for k, v in chosen.items()}
    if dev == "cuda" and "steps" in todo:
        # then what the chapter cannot do without (the force steps, Nsight
        # Compute), before the long E sweep
        paths = tuple(todo["steps"].split(";")) if todo["steps"] else None
        _linear_model_steps(out, quick, info, paths or LINEAR_PATHS_MEASURED)
    if dev == "cuda" and ncu and "ncu" in todo:
        os.environ["ECEKERN_LINEAR_CONFIG"] = json.dumps(info.get("launch_configs", {}))
        info["ncu_triton"] = run_ncu("eqlin_triton", out / "ncu_triton.csv")
        info["ncu_dense"] = run_ncu("eqlin_dense", out / "ncu_dense.csv")
    F = 192 if dev == "cuda" else 32  # a CPU run is a smoke test in the interpreter
    Es = ([4096] if dev == "cuda" else [64]) if quick else [47_000, 365_000]
    angs = [3] if quick else [2, 3, 4, 5]
    precisions = {
        "fp32": (torch.float32, False, "gemm_float32"),
        "tf32": (torch.float32, True, "gemm_float32+tf32"),
        "bf16": (torch.bfloat16, False, "gemm_bfloat16"),
    }
    paths = {
        "einsum": lambda xc, xs, w, b: reference.equivariant_linear(xc, xs, w, b),
        "dense": lambda xc, xs, w, b: linear._dense(xc, xs, w, b),
        "triton": lambda xc, xs, w, b: linear._EquivariantLinearFn.apply(xc, xs, w, b),
    }
    cells = [(E, n, list(precisions), list(paths)) for E in Es for n in angs]
    if todo.get("sweep"):
        cells = [sweep_cell(c, precisions, paths) for c in todo["sweep"].split(";")]
    elif "sweep" not in todo:
        cells = []
    for E, n_ang, which, cell_paths in cells:
        # one (E, n_ang) cell: fresh inputs, every precision and path
        g = torch.Generator(device=dev).manual_seed(E + n_ang)
        x64 = [
            torch.randn(E, F, n_ang, device=dev, dtype=torch.float64, generator=g)
            for _ in range(2)
        ]
        w64 = (
            torch.randn(n_ang, F, F, device=dev, dtype=torch.float64, generator=g)
            / F**0.5
        )
        b64 = torch.randn(F, device=dev, dtype=torch.float64, generator=g)
        truth = reference.equivariant_linear(*x64, w64, b64)
        for dtype, tf32, ceiling in (precisions[p] for p in which):
            bench.set_tf32(tf32)
            xc, xs = (t.to(dtype).requires_grad_() for t in x64)
            w, b = w64.to(dtype).requires_grad_(), b64.to(dtype).requires_grad_()
            model = linear.traffic(E, F, F, n_ang, xc.element_size())
            for name in cell_paths:
                fn = paths[name]
                try:
                    y = fn(xc, xs, w, b)
                    err = max(rel_err_gpu(a, t) for a, t in zip(y, truth))
                    t_f = bench.time_fn(lambda fn=fn: fn(xc, xs, w, b))
                    gy = [torch.randn_like(t) for t in y]

                    def fwd_bwd(fn=fn, gy=gy):
                        out = fn(xc, xs, w, b)
                        torch.autograd.backward(out, gy)

                    t_fb = bench.time_fn(fwd_bwd)
                    g_f = bench.time_graph(lambda fn=fn: fn(xc, xs, w, b))
                except Exception as exc:
                    rows.append(_error_row(exc, dtype, E=E, n_ang=n_ang, path=name))
                    bench.write_csv(rows, out / "linear_sweep.csv")
                    continue
                floor = bench.floor_ms(
                    model["bytes"],
                    model["flops"],
                    ceil["copy_GBps"],
                    ceil.get(ceiling),
                )
                rows.append(
                    {
                        "E": E,
                        "F": F,
                        "n_ang": n_ang,
                        "path": name,
                        "forward_ms": t_f.median,
                        "forward_p10_ms": t_f.p10,
                        "forward_p90_ms": t_f.p90,
                        "fwd_bwd_ms": t_fb.median,
                        "forward_gpu_ms": g_f.median if g_f else float("nan"),
                        "bytes": model["bytes"],
                        "flops": model["flops"],
                        "floor_ms": floor,
                        "floor_fraction": floor / t_f.median,
                        "rel_err_vs_fp64": err,
                        **bench.provenance(dtype),
                    }
                )
                print(
                    name,
                    E,
                    n_ang,
                    rows[-1]["dtype"],
                    f"{t_f.median:.3f} ms",
                    f"({100 * floor / t_f.median:.0f} % of floor) err {err:.1e}",
                    flush=True,
                )
                bench.write_csv(rows, out / "linear_sweep.csv")
        bench.set_tf32(False)
        _free()
    return info


def parse_parts(parts: str, known: tuple[str, ...]) -> dict[str, str]:
    """``"a,b=arg,c"`` as ``{"a": "", "b": "arg", "c": ""}``; a name that is not one
    of ``known`` is an error (a typo would otherwise measure nothing)."""
    todo = dict(p.partition("=")[::2] for p in parts.split(","))
    unknown = sorted(set(todo) - set(known))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}: choose from {', '.join(known)}")
    return todo


def sweep_cell(
    spec: str, precisions, paths=("einsum", "dense", "triton")
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


def _linear_launch_sweep(out: Path, quick: bool) -> dict:
    """The Triton EquivariantLinear forward's launch choices at E = 47k, F = 192,
    n_ang = 3 in fp32, TF32 and bf16: each timed and checked against float64 (one of
    cos/sin). The fastest per precision is kept for the rest of the capture (by
    replacing ``linear._config``) and returned, by dtype label."""
    from .. import linear, linear_fma, linear_tc, reference

    E, F, n = (4096, 192, 3) if quick else (47_000, 192, 3)
    g = torch.Generator(device="cuda").manual_seed(3)
    x64 = torch.randn(E, F, n, device="cuda", dtype=torch.float64, generator=g)
    w64 = torch.randn(n, F, F, device="cuda", dtype=torch.float64, generator=g) / F**0.5
    b64 = torch.randn(F, device="cuda", dtype=torch.float64, generator=g)
    truth = reference.equivariant_linear(x64, x64, w64, b64)[0]
    # the fastest tiles of the wider tuning runs (02_block_diagonal_gemm_history):
    # the strided loads at one and two stages, the register split and the batched
    # dot at one; then the strided loads with the next K step prefetched (pre), the
    # modes interleaved in registers for one store (st3) and W through a tensor
    # descriptor (desc), the three that session 5's prototypes found to help, at two
    # stages (the descriptor loads of W are pipelined only with two or more)
    tiles = [(64, 64, 64, 4), (64, 32, 64, 4), (32, 64, 64, 4), (32, 32, 64, 4)]
    # (name, split, bdot, prefetch, store3, w_desc, join), tiles, stages; st3j: the
    # single store built by tl.join
    kinds = [
        (("strided", False, False, False, False, False, False), tiles[:3], (1, 2)),
        (("bdot", True, True, False, False, False, False), tiles[1:2], (1,)),
        (("split", True, False, False, False, False, False), tiles[1:2], (1,)),
    ] + [
        ((name, False, False, *flags), tiles[1:], (2,))
        for name, flags in (
            ("pre", (True, False, False, False)),
            ("pre+st3", (True, True, False, False)),
            ("pre+desc", (True, False, True, False)),
            ("pre+st3+desc", (True, True, True, False)),
            ("pre+st3j+desc", (True, True, True, True)),
        )
    ]
    rows, best = [], {}
    precisions = [("float32", False), ("float32", True), ("bfloat16", False)]
    launches = [
        (k, t, s) for k, ts, ss in kinds for t in (ts[:2] if quick else ts) for s in ss
    ]
    runs = [
        (dt, tf32, name, tile, stages, linear.Config(*tile, stages, *flags))
        for (dt, tf32), ((name, *flags), tile, stages) in itertools.product(
            precisions, launches
        )
    ]
    # strict fp32 only: the Gluon kernel on the FMA units, each register tile
    runs += [
        (
            "float32",
            False,
            f"fma{t}",
            (64, 16, 64, 4),
            1,
            linear.FP32_FMA._replace(fma=t),
        )
        for t in linear_fma.TILES
    ]
    # bf16 and TF32: the Gluon kernel that splits the modes on the tensor cores
    # (the library runs it in bf16; in TF32 it lost to the Triton kernel)
    for dt, tf32, cfg in (
        ("bfloat16", False, linear.BF16_TC),
        ("float32", True, linear.TF32_TRITON._replace(tc=True)),
    ):
        ln = linear_tc.launch(getattr(torch, dt), F)
        # rows in flight per program, its warps: the consumers' and the loader's
        tile = (
            64 * ln.consumers,
            linear_tc.BLOCK_K[getattr(torch, dt)],
            ln.block_o,
            4 * ln.consumers + 1,
        )
        runs.append((dt, tf32, "tc", tile, ln.stages, cfg))
    for dt, tf32, name, tile, stages, cfg in runs:
        bench.set_tf32(tf32)
        dtype = getattr(torch, dt)
        x, w, b = x64.to(dtype), w64.to(dtype), b64.to(dtype)
        saved = linear._config
        linear._config = lambda d, kind="fwd", cfg=cfg: cfg
        try:
            y = linear.eqlin_fwd(x, w, b)
            err = rel_err_gpu(y, truth)
            fwd = lambda: linear.eqlin_fwd(x, w, b)
            t = bench.time_graph(fwd) or bench.time_fn(fwd, rep_ms=100.0)
        except Exception as exc:  # out of resources
            rows.append(
                _error_row(exc, dtype, variant=name, tile=str(tile), stages=stages)
            )
            continue
        finally:
            linear._config = saved
        model = linear.traffic(E, F, F, n, x.element_size())
        rows.append(
            {
                "variant": name,
                "block_b": tile[0],
                "block_k": tile[1],
                "block_o": tile[2],
                "warps": tile[3],
                "stages": stages,
                "E": E,
                "time_ms": t.median,
                "p10_ms": t.p10,
                "p90_ms": t.p90,
                "floor_bytes_ms": model["bytes"] / 2 / (_ceilings()["copy_GBps"] * 1e6),
                "rel_err_vs_fp64": err,
                **bench.provenance(dtype),
            }
        )
        label = rows[-1]["dtype"]
        tol = 1e-5 if dt == "float32" and not tf32 else 3e-2
        if err < tol and t.median < best.get(label, (float("inf"),))[0]:
            best[label] = (t.median, cfg)
        print(
            "eqlin", label, name, tile, stages, f"{t.median * 1e3:.1f} us", flush=True
        )
        bench.write_csv(rows, out / "launch_sweep.csv")
    bench.set_tf32(False)
    chosen = {k: v[1] for k, v in best.items()}
    default = linear._config

    def pick(dtype, kind="fwd"):
        if kind != "fwd" or dtype == torch.float64:
            return default(dtype, kind)
        return chosen.get(bench.dtype_label(dtype), default(dtype, kind))

    linear._config = pick  # for the rest of this capture process
    return chosen


def _count_ops(prof_rows: list[dict], names: tuple[str, ...]) -> dict:
    return {
        n: sum(r["calls_per_step"] for r in prof_rows if r["name"] == n) for n in names
    }


def _linear_model_steps(
    out: Path, quick: bool, info: dict, paths: tuple[str, ...]
) -> None:
    """The model's force step with each EquivariantLinear path, strict fp32 and TF32:
    time, peak memory, and from a profile of each the calls per step of the ops the
    einsum path brings (copies, bmm) and the GEMMs of the dense path."""
    import csv

    import ecekern
    from ecekern import options
    from ecekern.model import force_step, prepare_inputs

    cfg = ecekern.ECEConfig()
    rows = []
    for rep in [2] if quick else [4, 8]:
        model = ecekern.ECEModel(cfg).to(device="cuda", dtype=torch.float32)
        inputs = prepare_inputs(
            ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, "cuda"
        )
        n_atoms = inputs[0].shape[0]
        for tf32, path in itertools.product((False, True), paths):
            bench.set_tf32(tf32)
            with options.use(linear=path):
                step = lambda: force_step(model, *inputs)
                t = bench.time_fn(step, rep_ms=400.0)
                mem = bench.peak_memory(step)
                stem = f"profile_step_{n_atoms}_{path}{'_tf32' if tf32 else ''}"
                _profile_table(step, out, stem)
            with (out / f"{stem}_ops.csv").open() as fh:
                ops = [
                    {**r, "calls_per_step": float(r["calls_per_step"])}
                    for r in csv.DictReader(fh)
                ]
            counts = _count_ops(
                ops, ("aten::copy_", "aten::bmm", "aten::addmm", "aten::mm")
            )
            rows.append(
                {
                    "path": path,
                    "n_atoms": n_atoms,
                    "n_edges": inputs[2].n_edges,
                    "step_ms": t.median,
                    "step_p10_ms": t.p10,
                    "step_p90_ms": t.p90,
                    "reps": t.n,
                    "peak_mem_MiB": mem / 2**20,
                    **{f"calls_{k.split('::')[1]}": v for k, v in counts.items()},
                    **bench.provenance(torch.float32),
                }
            )
            print(
                "step",
                path,
                n_atoms,
                rows[-1]["dtype"],
                f"{t.median:.2f} ms",
                flush=True,
            )
            bench.write_csv(rows, out / "model_steps.csv")
        bench.set_tf32(False)
        model = inputs = None
        _free()


LINEAR_PATHS_MEASURED = ("einsum", "dense", "triton")


def rel_err_gpu(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` on the device, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def fused_scatter(
    out: Path,
    quick: bool = False,
    ncu: bool = True,
    parts: str = "launch,sweep,steps,ncu",
) -> dict:
    """Chapter 5: the zonal scatter, reference vs fused, over E, L and C.

    Rows: forward and forward+backward times, peak memory of forward+backward, the
    DRAM floor of the forward and its fraction, and the relative error against
    float64. The fused op is called past its CUDA gate (``zonal._scatter_op``).
    ``parts`` (comma-separated) selects what runs: without ``launch`` the library's
    ``zonal.CONFIG`` is used as it is.
    """
    todo = parse_parts(parts, ("launch", "sweep", "steps", "ncu"))
    from .. import reference, zonal
    from ..graph import csr_row_ptr

    ceil = _ceilings()
    rows = []
    dev = _device()
    small = (4096, 3, 32) if dev == "cuda" else (300, 2, 8)
    cases = (
        [small]
        if quick
        else (
            [(E, 3, 32) for E in (46_000, 365_000, 1_000_000, 3_000_000)]
            + [(365_000, L, 32) for L in (1, 2, 4)]
            + [(365_000, 3, C) for C in (16, 64, 100)]
        )
    )
    info = {"parts": sorted(todo), "config": dict(zonal.CONFIG)}
    if dev == "cuda" and "launch" in todo:
        info["config"] = _launch_sweep(out, quick)
    if "sweep" not in todo:
        cases = []
    ops = {
        "reference": reference.zonal_scatter,
        "fused": lambda *a: zonal._scatter_op(*a),
    }
    for E, L, C in cases:
        N = max(1, E // 89)
        g = torch.Generator(device=dev).manual_seed(E + L + C)
        dst = torch.sort(torch.randint(0, N, (E,), device=dev, generator=g)).values
        row_ptr = csr_row_ptr(dst, N)
        Z64 = torch.randn(
            E, (L + 1) ** 2 - 1, device=dev, dtype=torch.float64, generator=g
        )
        R64 = torch.randn(E, L, C, device=dev, dtype=torch.float64, generator=g)
        truth = reference.zonal_scatter(Z64, R64, dst, row_ptr, 0.1)
        Z, R = Z64.float().requires_grad_(), R64.float().requires_grad_()
        model = zonal.traffic(E, N, L, C, 4)
        for name, fn in ops.items():
            try:
                args = (Z.detach(), R.detach(), dst, row_ptr, 0.1)
                h = fn(Z, R, dst, row_ptr, 0.1)
                err = rel_err_gpu(h, truth)
                G = torch.randn_like(h)
                t_f = bench.time_fn(lambda fn=fn: fn(Z, R, dst, row_ptr, 0.1))

                def fwd_bwd(fn=fn, G=G):
                    torch.autograd.backward(fn(Z, R, dst, row_ptr, 0.1), G)

                t_fb = bench.time_fn(fwd_bwd)
                mem = bench.peak_memory(fwd_bwd)
                # the fused kernels' GPU time alone (CUDA graph replay): the op's
                # host-side launch cost is larger than its kernels at small E. The
                # backward's kernel is the gather (autograd's engine is not graphed;
                # the reference checks its CSR on the host: not capturable)
                g_f = g_fb = b_f = b_fb = None
                if name == "fused":
                    g_f = bench.time_graph(lambda: zonal._scatter_op(*args))
                    g_fb = bench.time_graph(
                        lambda: (
                            zonal._scatter_op(*args),
                            zonal._gather_op(G, *args),
                        )
                    )
                    # back to back, alternating between two copies of the inputs
                    # (together past the 60 MB of L2 from E = 365k up)
                    args2 = (Z.detach().clone(), R.detach().clone(), *args[2:])
                    b_f = bench.time_back_to_back(
                        [lambda a=a: zonal._scatter_op(*a) for a in (args, args2)]
                    )
                    b_fb = bench.time_back_to_back(
                        [
                            lambda a=a: (
                                zonal._scatter_op(*a),
                                zonal._gather_op(G, *a),
                            )
                            for a in (args, args2)
                        ]
                    )
                    args2 = None
            except Exception as exc:
                rows.append(_error_row(exc, torch.float32, E=E, L=L, C=C, op=name))
                bench.write_csv(rows, out / "scatter_sweep.csv")
                continue
            floor = bench.floor_ms(model["bytes_fwd"], 0, ceil["copy_GBps"])
            nan = float("nan")
            gpu_f = g_f.median if g_f else nan
            rows.append(
                {
                    "E": E,
                    "N": N,
                    "L": L,
                    "C": C,
                    "op": name,
                    "forward_ms": t_f.median,
                    "forward_p10_ms": t_f.p10,
                    "forward_p90_ms": t_f.p90,
                    "fwd_bwd_ms": t_fb.median,
                    "forward_gpu_ms": gpu_f,
                    "forward_gpu_p10_ms": g_f.p10 if g_f else nan,
                    "forward_gpu_p90_ms": g_f.p90 if g_f else nan,
                    "fwd_bwd_gpu_ms": g_fb.median if g_fb else nan,
                    "forward_b2b_ms": b_f.median if b_f else nan,
                    "forward_b2b_p10_ms": b_f.p10 if b_f else nan,
                    "forward_b2b_p90_ms": b_f.p90 if b_f else nan,
                    "fwd_bwd_b2b_ms": b_fb.median if b_fb else nan,
                    "peak_mem_MiB": mem / 2**20,
                    "bytes_fwd": model["bytes_fwd"],
                    "floor_ms": floor,
                    "floor_fraction": floor / t_f.median,
                    "floor_fraction_gpu": floor / gpu_f,
                    "floor_fraction_b2b": floor / b_f.median if b_f else nan,
                    "rel_err_vs_fp64": err,
                    "config": _config_label() if name == "fused" else "",
                    **bench.provenance(torch.float32),
                }
            )
            print(
                name,
                E,
                L,
                C,
                f"fwd {t_f.median:.3f} ms (gpu {gpu_f:.3f}, "
                f"b2b {rows[-1]['forward_b2b_ms']:.3f})",
                f"fwd+bwd {t_fb.median:.3f} ms (gpu {rows[-1]['fwd_bwd_gpu_ms']:.3f})",
                f"err {err:.1e}",
                flush=True,
            )
            bench.write_csv(rows, out / "scatter_sweep.csv")
        _free()
    if "steps" in todo:
        _model_steps(out, quick, info)
    os.environ["ECEKERN_ZONAL_CONFIG"] = json.dumps(zonal.CONFIG)
    if ncu and "ncu" in todo:
        info["ncu_fused"] = run_ncu("zonal_fused", out / "ncu_fused.csv")
    return info


def _config_label() -> str:
    from .. import zonal

    c = zonal.CONFIG
    return (
        f"{c['forward']} tile={c['fwd_tile']} w={c['fwd_warps']} "
        f"st={c['fwd_stages']} acc={c['fwd_acc']}; "
        f"{c['gather']} tile={c['bwd_tile']} w={c['bwd_warps']} st={c['bwd_stages']}"
    )


def _launch_sweep(out: Path, quick: bool) -> dict:
    """The fused kernels' launch choices at E = 365k, L = 3, C = 32, fp32: each
    forward and backward variant timed (GPU time: CUDA graph replay) and checked
    against float64. The fastest of
    each is kept in ``zonal.CONFIG`` for the rest of the capture and returned."""
    from .. import reference, zonal
    from ..graph import csr_row_ptr

    E, L, C = (20_000, 3, 32) if quick else (365_000, 3, 32)
    N = E // 89
    g = torch.Generator(device="cuda").manual_seed(7)
    dst = torch.sort(torch.randint(0, N, (E,), device="cuda", generator=g)).values
    row_ptr = csr_row_ptr(dst, N)
    Z64 = torch.randn(E, 15, device="cuda", dtype=torch.float64, generator=g)
    R64 = torch.randn(E, L, C, device="cuda", dtype=torch.float64, generator=g)
    G64 = torch.randn(N, 16, C, device="cuda", dtype=torch.float64, generator=g)
    Zr, Rr = Z64.clone().requires_grad_(), R64.clone().requires_grad_()
    h64 = reference.zonal_scatter(Zr, Rr, dst, row_ptr, 0.1)
    dz64, dr64 = torch.autograd.grad(h64, (Zr, Rr), G64)
    Z, R, G = Z64.float(), R64.float(), G64.float()
    model = zonal.traffic(E, N, L, C, 4)
    floor = bench.floor_ms(model["bytes_fwd"], 0, _ceilings()["copy_GBps"])
    base = dict(zonal.CONFIG)
    rows, best = [], {}
    # (variant, BLOCK_E, warps, software-pipelining stages of the CSR walk)
    product = itertools.product
    # and, for the degrees forward, the partial sums per edge lane or per row
    fwd = [("lanes", *c, "edge") for c in product((2, 4, 8), (1, 2, 4), (1, 3))]
    fwd += [
        ("degrees", *c)
        for c in product((4, 8, 16, 32), (1, 2, 4), (1, 3, 4), ("edge", "block"))
    ]
    bwd = [("edge", b, w, 1, "") for b, w in product((4, 8, 16, 32), (1, 2, 4))]
    bwd += [("node", *c, "") for c in product((4, 8, 16), (1, 2, 4), (1, 3))]
    for kind, variants in (("forward", fwd), ("backward", bwd)):
        for variant, be, warps, stages, acc in variants:
            cfg = dict(base)
            if kind == "forward":
                cfg.update(
                    forward=variant,
                    fwd_tile=be * zonal.fwd_rows(variant, L) * C,
                    fwd_warps=warps,
                    fwd_stages=stages,
                    fwd_acc=acc,
                )
                fn = lambda: zonal.zonal_scatter_fwd(Z, R, row_ptr, 0.1)
            else:
                cfg.update(
                    gather=variant,
                    bwd_tile=be * 16 * C,
                    bwd_warps=warps,
                    bwd_stages=stages,
                )
                fn = lambda: zonal.zonal_edge_gather(G, Z, R, dst, row_ptr, 0.1)
            zonal.CONFIG.update(cfg)
            keys = {"kind": kind, "variant": variant, "block_e": be, "warps": warps}
            keys |= {"stages": stages, "acc": acc}
            try:
                got = fn()
                if kind == "forward":
                    err = rel_err_gpu(got, h64)
                else:
                    err = max(rel_err_gpu(got[0], dz64), rel_err_gpu(got[1], dr64))
                t = bench.time_graph(fn) or bench.time_fn(fn, rep_ms=100.0)
            except Exception as exc:  # e.g. out of registers or shared memory
                rows.append(_error_row(exc, torch.float32, **keys))
                continue
            rows.append(
                {
                    **keys,
                    "E": E,
                    "L": L,
                    "C": C,
                    "time_ms": t.median,
                    "p10_ms": t.p10,
                    "p90_ms": t.p90,
                    "floor_ms": floor if kind == "forward" else float("nan"),
                    "rel_err_vs_fp64": err,
                    **bench.provenance(torch.float32),
                }
            )
            if err < 1e-5 and t.median < best.get(kind, (float("inf"),))[0]:
                best[kind] = (t.median, cfg)
            print(kind, variant, be, warps, stages, acc, f"{t.median * 1e3:.1f} us")
        bench.write_csv(rows, out / "launch_sweep.csv")
    zonal.CONFIG.update(base)
    # for Nsight Compute (a separate process): the best launch of each forward variant
    fastest = {}

    def cfg_of(r):
        return r["block_e"], r["warps"], r["stages"], r["acc"]

    for r in rows:
        if r["kind"] == "forward" and "time_ms" in r and r["rel_err_vs_fp64"] < 1e-5:
            if r["time_ms"] < fastest.get(r["variant"], (float("inf"),))[0]:
                fastest[r["variant"]] = (r["time_ms"], *cfg_of(r))
    os.environ["ECEKERN_ZONAL_NCU_FORWARDS"] = json.dumps(
        [[v, *c] for v, (_, *c) in sorted(fastest.items())]
    )
    keys = {
        "forward": ("forward", "fwd_tile", "fwd_warps", "fwd_stages", "fwd_acc"),
        "backward": ("gather", "bwd_tile", "bwd_warps", "bwd_stages"),
    }
    for kind, (_, c) in best.items():
        zonal.CONFIG.update({k: c[k] for k in keys[kind]})
    return dict(zonal.CONFIG)


def _model_steps(out: Path, quick: bool, info: dict) -> None:
    """The force step and the force-training step of the model, reference scatter
    against the fused op (``fused_scatter``), strict fp32: time, peak memory, and a
    profiler table of each at the larger box."""
    import ecekern
    from ecekern import options
    from ecekern.model import force_step, prepare_inputs

    if _device() != "cuda":
        info["model_steps"] = "skipped: no GPU"
        return
    cfg = ecekern.ECEConfig()
    rows = []
    boxes = [2] if quick else [4, 8]

    def train(model, pos, numbers, graph):
        model.zero_grad(set_to_none=True)
        e, f = force_step(model, pos, numbers, graph, create_graph=True)
        (e**2 + (f**2).sum()).backward()

    for rep in boxes:
        model = ecekern.ECEModel(cfg).to(device="cuda", dtype=torch.float32)
        pos, numbers, graph = prepare_inputs(
            ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, "cuda"
        )
        for fused in (False, True):
            with options.use(fused_scatter=fused):
                for kind, fn in (("force step", force_step), ("training step", train)):
                    step = lambda fn=fn: fn(model, pos, numbers, graph)
                    t = bench.time_fn(step, rep_ms=400.0)
                    mem = bench.peak_memory(step)
                    rows.append(
                        {
                            "kind": kind,
                            "scatter": "fused" if fused else "reference",
                            "n_atoms": pos.shape[0],
                            "n_edges": graph.n_edges,
                            "step_ms": t.median,
                            "step_p10_ms": t.p10,
                            "step_p90_ms": t.p90,
                            "reps": t.n,
                            "peak_mem_MiB": mem / 2**20,
                            "config": _config_label() if fused else "",
                            **bench.provenance(torch.float32),
                        }
                    )
                    print(
                        kind,
                        rows[-1]["scatter"],
                        pos.shape[0],
                        f"{t.median:.2f} ms",
                        f"{mem / 2**20:.0f} MiB",
                        flush=True,
                    )
                    bench.write_csv(rows, out / "model_steps.csv")
                    if rep == boxes[-1]:
                        tag = "fused" if fused else "reference"
                        stem = f"profile_{kind.split()[0]}_{pos.shape[0]}_{tag}"
                        _profile_table(step, out, stem)
        model = pos = numbers = graph = None
        _free()


REGISTRY = {
    "methodology": methodology,
    "01_einsum_reference": einsum_reference,
    "02_block_diagonal_gemm": block_diagonal_gemm,
    "05_fused_scatter": fused_scatter,
}
