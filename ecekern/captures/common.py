"""What the chapters' captures share: one Nsight Compute part (:func:`ncu_part`,
on the library's own launches), profiler tables, the force-step row
(:func:`force_row`) and one part that times the force step under a list of option
dicts (:func:`option_steps`).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from .. import ECEConfig, ECEModel, bench, options, systems
from ..graph_step import GraphStep
from ..model import force_step, prepare_inputs
from ..peers import graphed_force_step
from . import NCU_COLUMNS, NCU_COUNTS, load, schema
from .stages import device_us

__all__ = ["BEFORE_CH6", "compile_model", "device", "for_boxes", "force_row", "free",
           "ncu_part", "option_steps", "profile_table", "profiled", "run_ncu",
           "step_error", "switched", "sync"]  # fmt: skip

#: What Nsight Compute is asked for: the metrics the loader reads
#: (:data:`ecekern.captures.NCU_COLUMNS`, L2 bytes), the stall reasons, and the
#: counters (:data:`ecekern.captures.NCU_COUNTS`: tried first, dropped if this ncu
#: does not know them).
NCU_METRICS_BASIC = [*NCU_COLUMNS, "lts__t_bytes.sum"]
NCU_STALLS = [
    f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio"
    for r in ("long_scoreboard", "short_scoreboard", "mio_throttle", "lg_throttle",
              "math_pipe_throttle", "barrier", "wait", "not_selected", "selected")
]  # fmt: skip
#: The stack as before chapter 6 (the linears, no cohorts): chapters 1 to 5's steps.
BEFORE_CH6 = {"stack": "linears", "memory": "plain"}


def run_ncu(target: str, out_csv: Path, extra: list[str] | None = None,
            timeout: float = 420) -> str:  # fmt: skip
    """Run ncu on ``targets.<target>``; write the raw CSV page, return a status."""
    status, basic = "ncu not run", NCU_METRICS_BASIC
    for metrics in (basic + NCU_STALLS + [*NCU_COUNTS], basic + NCU_STALLS, basic):
        cmd = ["ncu", "--clock-control", "none", "--nvtx", "--nvtx-include", "ece/",
               "--metrics", ",".join(metrics), "--csv", "--page", "raw", *(extra or []),
               sys.executable, "-m", "ecekern.captures.targets", target]  # fmt: skip
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


def sync(dev: str = "cuda") -> None:
    """Wait for the GPU (nothing on a CPU)."""
    if dev == "cuda":
        torch.cuda.synchronize()


def profiled(fn, iters: int, dev: str = "cuda"):
    """``(profile, seconds)``: ``torch.profiler`` (CPU, and CUDA on a GPU) over
    ``iters`` back-to-back calls of ``fn`` after one call outside it, and the wall
    time of those calls until the device is done."""
    fn()
    sync(dev)
    cuda = [ProfilerActivity.CUDA] if dev == "cuda" else []
    with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(dev)
        seconds = time.perf_counter() - t0
    return prof, seconds


def compile_model(model, inputs, dev: str = "cuda"):
    """``(torch.compile(model), seconds)``: compiled afresh (static shapes, as a
    user with one system has) by one force step on ``inputs``, under the current
    options and TF32."""
    torch._dynamo.reset()
    compiled = torch.compile(model)
    t0 = time.perf_counter()
    force_step(compiled, *inputs)
    sync(dev)
    return compiled, time.perf_counter() - t0


@contextlib.contextmanager
def switched(opts: dict, tf32: bool = False):
    """A block under the options ``opts`` (yields :func:`ecekern.options.use`'s
    options in force) with TF32 switched to ``tf32``, and off again after."""
    bench.set_tf32(tf32)
    try:
        with options.use(**opts) as now:
            yield now
    finally:
        bench.set_tf32(False)


def device() -> str:
    """``cuda`` where there is a GPU; on a CPU the sweeps run as a smoke test."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def book_config(dev: str, n_gated: int = 1):
    """The book's model (``ECEConfig()``) on a GPU; in Triton's interpreter a small
    one on the nearest neighbours only (the captures' CPU smoke tests)."""
    if dev == "cuda":
        return ECEConfig()
    small = dict(radial_hidden=8, readout_hidden=8, n_gated=n_gated, cutoff=2.0)
    return ECEConfig(channels=4, **small)


def free() -> None:
    """Drop what the last case left behind (a GPU's cached blocks too)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ceilings() -> dict:
    """Our measured H200 ceilings from the methodology capture (fallbacks otherwise)."""
    c = dict(bench.CEILINGS_H200)
    try:
        rows = load("methodology").csv("ceilings")
    except FileNotFoundError:
        return c
    c["copy_GBps"] = max(r["GBps"] for r in rows if r["kernel"] != "gemm")
    return c | {f"gemm_{r['precision']}": r["TFLOPs"] for r in rows
                if r["kernel"] == "gemm"}  # fmt: skip


def force_row(system: str, model, inputs, plan: str = "", mode: str = "eager",
              rep_ms: float = 400.0, step=None, graph_kw: dict | None = None,
              min_reps: int = 5, more=None, **extra) -> dict:  # fmt: skip
    """A step row (:mod:`.schema`) of one model's force step (energy + forces) on
    prepared ``inputs`` (``step``: another step of the model, ``step(model, pos,
    numbers, graph)``): its time (median, p10, p90 of at least ``min_reps`` runs)
    and peak memory, at the inputs' precision (TF32 as it is switched now).
    ``mode="replay"``: the step as a :class:`~ecekern.graph_step.GraphStep`
    (chapter 4; ``graph_kw``: its arguments, say ``headroom``; a peer's through
    :func:`ecekern.peers.graphed_force_step`), its peak memory that of the capture
    (the graph's pool holds the step's intermediates), with ``capture_s`` (seconds
    to build and capture it) and ours its ``headroom`` and ``capacity`` (edge
    slots). ``more(fn) -> dict``: columns measured on the step ``fn`` after its
    timing."""
    pos, numbers, graph = inputs
    if step is not None and mode == "replay":
        raise ValueError("a replay is of the force step: no other step")
    peak = None
    if mode == "replay":
        holder = {}
        ours = isinstance(getattr(model, "_orig_mod", model), ECEModel)

        def first():  # a peer's force step under torch.cuda.graph, or a GraphStep
            if ours:
                holder["step"] = GraphStep(model, numbers, **(graph_kw or {}))
                holder["step"](pos, graph)
            else:
                holder["step"] = graphed_force_step(model, pos, numbers, graph)

        sync(pos.device.type)
        t0 = time.perf_counter()
        peak = bench.peak_memory(first)
        if "step" not in holder:  # no GPU: peak_memory runs nothing
            first()
        cap = holder["step"]
        extra |= {"capture_s": time.perf_counter() - t0}
        if ours:
            extra |= {"headroom": cap.headroom, "capacity": cap.capacity}
        fn = (lambda: cap(pos, graph)) if ours else cap
    else:
        fn = lambda: (step or force_step)(model, pos, numbers, graph)
    t = bench.time_fn(fn, rep_ms=rep_ms, min_reps=min_reps)
    if more is not None:
        extra |= more(fn)
    if peak is None:
        peak = bench.peak_memory(fn)
    precision = bench.dtype_label(pos.dtype)
    row = schema.step_row(system, pos.shape[0], graph.n_edges, mode, precision, plan,
                          t, peak, **extra)  # fmt: skip
    print(system, row["n_atoms"], precision, mode, f"{t.median:.2f} ms",
          f"{peak / 2**20:.0f} MiB", flush=True)  # fmt: skip
    return row


def for_boxes(run, body, cfg=None, reps=None, dev: str = "cuda") -> None:
    """``body(rep, model, inputs)`` for each diamond box (``reps``, else
    ``run.reps()``): a fresh model of ``cfg`` (the book's, ``ECEConfig()``, by
    default) and the box's prepared inputs, in float32 on ``dev``, both dropped and
    the cache freed before the next box."""
    cfg = cfg or ECEConfig()
    for rep in run.reps() if reps is None else reps:
        atoms = systems.diamond(rep)
        inputs = prepare_inputs(atoms, cfg.cutoff, torch.float32, dev)
        model = ECEModel(cfg).to(device=dev, dtype=torch.float32)
        body(rep, model, inputs)
        model = inputs = None
        free()


def option_steps(run, cases, name, cfg=None, reps=None, modes=("eager",), each=None):
    """``<name>.csv`` (step schema): the force step of each box (:func:`for_boxes`)
    in each mode, under each case's options. ``cases``: ``(label, options, kw)``,
    ``kw`` what :func:`force_row` takes beyond them (``step``, the chapter's
    columns) and ``tf32`` (TF32 on for the case). ``each(rep, model, inputs, row,
    kw)`` runs after each row under its options and TF32 (profiles, stages; it may
    add columns to the row). The CSV is rewritten after every row."""
    rows: list[dict] = []

    def body(rep, model, inputs):
        for mode, (label, opts, kw) in itertools.product(modes, cases):
            kw = dict(kw)
            with switched(opts, kw.pop("tf32", False)):
                plan = schema.plan(opts)
                rows.append(force_row(label, model, inputs, plan, mode, **kw))
                if each is not None:
                    each(rep, model, inputs, rows[-1], kw)
            schema.write(rows, run.out / f"{name}.csv")
            free()

    for_boxes(run, body, cfg, reps, run.dev)
    return "done"


def ncu_part(runs: dict, timeout: float = 420):
    """A part that runs Nsight Compute: ``runs`` maps a name to ``(target,
    ncu arguments)``; each writes ``ncu_<name>.csv`` (its status: the note
    ``ncu_<name>``). The part's argument picks some names (``ncu=stack``)."""

    def part(run, arg: str) -> dict:
        names = arg.split(";") if arg else list(runs)
        unknown = [n for n in names if n not in runs]
        if unknown:
            raise ValueError(f"ncu={arg!r}: choose from {', '.join(runs)}")
        return {
            f"ncu_{n}": run_ncu(
                runs[n][0], run.out / f"ncu_{n}.csv", runs[n][1], timeout
            )
            for n in names
        }

    return part


def step_error(exc: BaseException, system: str, inputs, plan="", mode="eager") -> dict:
    """The step row of a step that raised: its keys and the error."""
    pos, _, graph = inputs
    precision = bench.dtype_label(pos.dtype)
    return schema.step_row(system, pos.shape[0], graph.n_edges, mode, precision, plan,
                           None, None, error=repr(exc)[:300])  # fmt: skip


def profile_table(fn, out_dir: Path, stem: str, iters: int = 3) -> None:
    """torch.profiler over ``iters`` calls (:func:`profiled`): a text table and a
    CSV of every op."""
    ka = profiled(fn, iters)[0].key_averages()
    sort = "self_cuda_time_total"
    (out_dir / f"{stem}_table.txt").write_text(ka.table(sort_by=sort, row_limit=40))
    rows = []
    for e in ka:
        self_dev = getattr(e, "self_device_time_total", None)
        self_dev = e.self_cuda_time_total if self_dev is None else self_dev
        rows.append({
            "name": e.key,
            "device_type": str(getattr(e, "device_type", "")).split(".")[-1],
            "calls_per_step": e.count / iters,
            "self_cuda_ms_per_step": self_dev / 1e3 / iters,
            "cuda_total_ms_per_step": device_us(e) / 1e3 / iters,
            "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / iters,
        })  # fmt: skip
    rows.sort(key=lambda r: -r["self_cuda_ms_per_step"])
    bench.write_csv(rows, out_dir / f"{stem}_ops.csv")
