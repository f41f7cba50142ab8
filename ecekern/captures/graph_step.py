"""Chapter 4's capture: host syncs, and the step as a CUDA graph.

Parts (``parts``, comma-separated), on the book's model (L = 2, C = 32, fp32):

* ``audit`` -> audit.csv: every host sync and host-to-device copy of one force step
  at 512 atoms, under the library's defaults and the reference (none is the target),
  and whether the step runs under ``torch.cuda.set_sync_debug_mode("error")``;
* ``steps`` -> steps.csv: the force step at 512 and 4096 atoms, eager and replayed
  as a :class:`~ecekern.graph_step.GraphStep`, under the defaults and the reference:
  time, the host's time per step, the GPU's busy fraction and device ops per step
  (the profiler over consecutive steps), the capture's cost (two eager warm-up steps
  and the recording, kernels already compiled) and peak memory (for a replay: the
  peak while the step is built and captured; the graph's pool keeps that memory).
"""

from __future__ import annotations

import math
import time

import torch

from .. import ECEModel, bench, options, systems
from ..host_sync import HostSyncAudit
from ..model import force_step, prepare_inputs
from . import schema
from .common import book_config, for_boxes, force_row, free, profiled

__all__ = ["PARTS"]

#: The option sets the audit and the steps run under.
PATHS = {"defaults": {}, "reference": {"reference": True}}
#: The audit's defaults in Triton's interpreter (no GPU): the fast paths it runs.
CPU_DEFAULTS = {"edge_frame": "packed", "zonal": "fused"}
#: The replays' headrooms: the library's default first, then none (capacity = E,
#: rounded up to the quantum), then the headroom of a first draft (25 %).
HEADROOMS = (None, 1.0, 1.25)


def _host_and_wall(fn, n: int) -> tuple[float, float]:
    """Per call, over ``n`` back-to-back calls: the host's time to return from the
    call, and the wall time until the GPU is done (ms)."""
    fn()
    torch.cuda.synchronize()
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return host / n * 1e3, wall / n * 1e3


def _audit(run, arg: str) -> dict:
    """audit.csv: every host sync and copy of one force step (module docstring)."""
    out, dev = run.out, run.dev
    cfg, atoms = book_config(dev), systems.diamond(run.reps()[0])
    inputs = prepare_inputs(atoms, cfg.cutoff, torch.float32, dev)
    model = ECEModel(cfg).to(dev)
    rows, info = [], {}
    for label, opts in PATHS.items():
        if dev != "cuda" and label == "defaults":
            opts = CPU_DEFAULTS
        with options.use(**opts):
            force_step(model, *inputs)  # compiles, checks the species, fills caches
            with HostSyncAudit() as audit:
                force_step(model, *inputs)
            for kind, op, where, count in audit.counts():
                rows.append({"options": label, "kind": kind, "op": op,
                             "where": where, "count": count})  # fmt: skip
            info[f"{label}: syncs, h2d"] = [audit.syncs, audit.h2d]
            if dev == "cuda":
                info[f"{label}: sync debug mode"] = _sync_debug(
                    lambda: force_step(model, *inputs)
                )
    if not rows:
        rows.append({"options": "all", "kind": "none", "op": "", "where": "",
                     "count": 0})  # fmt: skip
    bench.write_csv(
        [{**r, "n_atoms": inputs[0].shape[0], **bench.provenance(torch.float32)}
         for r in rows], out / "audit.csv",
    )  # fmt: skip
    return {"audit": info}


def _sync_debug(fn) -> str:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        result = "no synchronising call"
    except RuntimeError as exc:
        result = f"raised: {exc}"[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return result


def _busy(fn, n: int) -> tuple[float, float]:
    """The GPU's busy fraction and device ops (kernels, copies, fills) per call over
    ``n`` back-to-back calls: their time from the profiler over the wall time from
    the first launch to the end of the last one (:func:`~.common.profiled`)."""
    prof, wall_s = profiled(fn, n)
    ops = [e for e in prof.events()  # not a user annotation: it spans a region
           if not getattr(e, "is_user_annotation", False)
           and str(getattr(e, "device_type", "")).split(".")[-1] == "CUDA"]  # fmt: skip
    spans = sorted((e.time_range.start, e.time_range.end) for e in ops)
    busy_us, end = 0.0, -math.inf
    for a, b in spans:  # the union: nested or concurrent intervals count once
        if b > end:
            busy_us += b - max(a, end)
            end = b
    return busy_us / (wall_s * 1e6), len(ops) / n


def _step_row(model, inputs, label: str, mode: str, headroom) -> dict:
    """One row of steps.csv (step schema, :func:`~.common.force_row`): the eager
    step, or a GraphStep built (and captured) with this headroom; then the host's
    time, the wall time and the GPU's busy fraction over back-to-back steps."""
    N = inputs[0].shape[0]
    n = 20 if N <= 512 else 5

    def more(fn):
        host, wall = _host_and_wall(fn, n)
        busy, ops = _busy(fn, n)
        print(f"steps {label} {mode} {headroom} {N}: host {host:.2f} ms, busy "
              f"{busy:.2f}", flush=True)  # fmt: skip
        return {"wall_ms": wall, "host_ms": host, "gpu_busy": busy,
                "gpu_ops_per_step": ops}  # fmt: skip

    graph_kw = {} if headroom is None else {"headroom": headroom}
    plan, rep_ms = schema.plan(PATHS[label]), 200.0 if N <= 512 else 0.0
    return force_row(label, model, inputs, plan, mode, rep_ms, graph_kw=graph_kw,
                     min_reps=10, more=more)  # fmt: skip


def _steps(run, arg: str) -> str:
    """steps.csv: eager against replay, under the defaults and the reference."""
    rows: list[dict] = []

    def body(rep, model, inputs):
        for label, opts in PATHS.items():
            with options.use(**opts):
                force_step(model, *inputs)  # compiles: the capture's time is its own
                headrooms = HEADROOMS if label == "defaults" else HEADROOMS[:1]
                modes = [("eager", None)] + [("replay", h) for h in headrooms]
                for mode, headroom in modes:
                    rows.append(_step_row(model, inputs, label, mode, headroom))
                    schema.write(rows, run.out / "steps.csv")
                    free()

    for_boxes(run, body)
    return "done"


PARTS = {"audit": _audit, "steps": _steps}
GPU_ONLY = ("steps",)
