"""What each chapter's capture measures. Runs on a CUDA GPU only."""

from __future__ import annotations

import gc
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
    for metrics in (NCU_METRICS_BASIC + NCU_STALLS, NCU_METRICS_BASIC):
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

    todo = set(parts.split(","))
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


REGISTRY = {"methodology": methodology, "01_einsum_reference": einsum_reference}
