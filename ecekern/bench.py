"""The benchmark harness: event timings, peak memory, rooflines and provenance.

Timing follows METHOD.md: warm-up excluded, the L2 cache flushed before every timed
call, device events around the region, the median and the 10th/90th percentiles of
many repetitions (``triton.testing.do_bench`` on CUDA). On a CPU the same function
uses ``time.perf_counter`` so notebooks and tests can exercise it anywhere; such rows
say ``cpu`` in the device column and are never mixed with GPU captures.

Every row written by :func:`write_csv` carries its provenance: device, driver, torch,
triton, the ecekern commit, the dtype (``float32+tf32`` when TF32 is on), the date and
the command.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CEILINGS_H200",
    "Timing",
    "dtype_label",
    "floor_ms",
    "peak_memory",
    "provenance",
    "set_tf32",
    "time_fn",
    "write_csv",
]

#: Our measured H200 ceilings (book/captures/methodology): filled in by
#: ``ceilings()`` from the capture when present; these are the fallbacks.
CEILINGS_H200 = {
    "copy_GBps": 4300.0,
    "fp32_TFLOPs": 60.0,
    "tf32_TFLOPs": 400.0,
    "bf16_TFLOPs": 790.0,
}


@dataclass(frozen=True)
class Timing:
    """Milliseconds: median and the 10th and 90th percentiles over ``n`` runs."""

    median: float
    p10: float
    p90: float
    n: int

    @classmethod
    def of(cls, times: list[float]) -> Timing:
        """The median and the 10th and 90th percentiles of ``times`` (ms)."""
        return cls(
            statistics.median(times),
            _quantile(times, 0.1),
            _quantile(times, 0.9),
            len(times),
        )


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_fn(
    fn,
    warmup_ms: float = 50.0,
    rep_ms: float = 300.0,
    device=None,
    min_reps: int = 5,
) -> Timing:
    """Time ``fn()``: warm-up excluded, L2 flushed (CUDA), median and p10/p90 in ms.

    Runs for ``rep_ms`` or at least ``min_reps`` timed calls, whichever is longer (a
    slow call would otherwise be timed once or twice: no median worth the name).
    """
    device = (
        torch.device(device)
        if device is not None
        else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        )
    )
    if device.type == "cuda":
        from triton.testing import do_bench

        # do_bench sizes its repetitions from a short estimate: give it room for
        # min_reps calls of the estimated length
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est_ms = (time.perf_counter() - t0) * 1e3
        rep = max(rep_ms, min_reps * est_ms * 1.2)
        times = do_bench(fn, warmup=warmup_ms, rep=rep, return_mode="all")
    else:
        t_end = time.perf_counter() + warmup_ms / 1e3
        fn()
        while time.perf_counter() < t_end:
            fn()
        times, t_end = [], time.perf_counter() + rep_ms / 1e3
        while time.perf_counter() < t_end or len(times) < min_reps:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing.of(times)


def time_graph(fn, rep_ms: float = 100.0, min_reps: int = 20) -> Timing | None:
    """The GPU time of ``fn()`` without the host's launch cost: ``fn`` is captured
    once into a CUDA graph and the replays are timed like :func:`time_fn` (L2 flushed
    between them). A short op called from Python can take longer to launch than to
    run; this is the time to hold against its DRAM floor. None without a GPU or when
    ``fn`` cannot be captured. Give it only what can be captured (no host syncs, no
    host-to-device copies): a failed capture can leave the CUDA context unusable.
    """
    if not torch.cuda.is_available():
        return None
    try:
        graph, _ = cuda_graph(fn)
    except Exception as exc:  # e.g. a host sync inside fn
        print(f"time_graph: not capturable ({exc!r:.200})", flush=True)
        return None
    return time_fn(graph.replay, rep_ms=rep_ms, min_reps=min_reps)


def time_back_to_back(
    fns, rounds: int = 10, rep_ms: float = 100.0, min_reps: int = 10
) -> Timing | None:
    """The GPU time per call of calls that follow each other on the stream, the way
    they do inside a model: ``rounds`` passes over ``fns`` are captured into one CUDA
    graph, each replay is timed by events and divided by its number of calls. There
    is no L2 flush; give ``fns`` calls on separate inputs that together do not fit in
    L2, so that each call still reads from DRAM. The graph's own launch is spread
    over all its calls, which is what :func:`time_graph` (one call per replay, L2
    flushed before each) cannot do. None without a GPU or when a call cannot be
    captured.
    """
    if not torch.cuda.is_available():
        return None

    def all_calls():
        for _ in range(rounds):
            for fn in fns:
                fn()

    try:
        graph, _ = cuda_graph(all_calls, warmup=1)
    except Exception as exc:
        print(f"time_back_to_back: not capturable ({exc!r:.200})", flush=True)
        return None
    n_calls = rounds * len(fns)
    graph.replay()
    torch.cuda.synchronize()
    times, t_end = [], time.perf_counter() + rep_ms / 1e3
    while time.perf_counter() < t_end or len(times) < min_reps:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n_calls)
    return Timing.of(times)


def cuda_graph(fn, warmup: int = 3):
    """``fn`` captured once into a CUDA graph, after ``warmup`` calls on a side
    stream (compilation and allocations stay out of the capture). Returns the graph
    and what ``fn`` returned during the capture: the tensors each replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def peak_memory(fn) -> float:
    """Peak CUDA memory allocated while ``fn()`` runs, in bytes (NaN on a CPU)."""
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - base)


def set_tf32(enabled: bool) -> None:
    """The one process-wide TF32 switch of the benchmark and capture commands."""
    torch.backends.cuda.matmul.allow_tf32 = bool(enabled)
    torch.backends.cudnn.allow_tf32 = bool(enabled)


def dtype_label(dtype: torch.dtype) -> str:
    """``float32+tf32`` when TF32 is on for a float32 run; warns for float64 + TF32."""
    name = str(dtype).replace("torch.", "")
    if torch.backends.cuda.matmul.allow_tf32:
        if dtype == torch.float64:
            warnings.warn(
                "TF32 is on but the dtype is float64: TF32 does not apply", stacklevel=2
            )
        elif dtype == torch.float32:
            return name + "+tf32"
    return name


def floor_ms(
    bytes_moved: float,
    flops: float = 0.0,
    bandwidth_GBps: float | None = None,
    flops_TF: float | None = None,
) -> float:
    """The roofline floor: ``max(bytes / bandwidth, flops / rate)`` in ms."""
    bw = bandwidth_GBps or CEILINGS_H200["copy_GBps"]
    t_mem = bytes_moved / (bw * 1e9) * 1e3
    t_flop = flops / (flops_TF * 1e12) * 1e3 if flops_TF else 0.0
    return max(t_mem, t_flop)


def _git_commit() -> str:
    if os.environ.get("ECEKERN_COMMIT"):
        return os.environ["ECEKERN_COMMIT"]
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return "none"


def provenance(dtype: torch.dtype | None = None, command: str | None = None) -> dict:
    """Where a number came from: device, driver, versions, commit, dtype, date and
    command."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "driver": _driver() if cuda else "none",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": _git_commit(),
        "dtype": dtype_label(dtype) if dtype is not None else "",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command if command is not None else _command_line(),
    }


def _command_line() -> str:
    """The command that runs this process (``python -m pkg`` for a module run)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = (
        f"python -m {spec.name.removesuffix('.__main__')}"
        if spec
        else Path(sys.argv[0]).name
    )
    return " ".join([head, *sys.argv[1:]])


def write_csv(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write rows (dicts with the same keys, in order) as CSV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})
    return path
