"""The captures' two CSV schemas: step timings and kernel timings.

A step row (:data:`STEP_COLUMNS`) is one step of the model on one system:

* ``system``: the row's label, what ran (``"reference"``, ``"+ ch2 linear"``,
  ``"dense"``, ``"keep z"``, a peer's name);
* ``n_atoms``, ``n_edges``: the system and its graph;
* ``mode``: ``eager``, or ``replay`` (the step as a CUDA graph, chapter 4);
* ``precision``: ``float32``, ``float32+tf32``, ``float64`` (``bench.dtype_label``);
* ``plan``: the implementation choices of the row, ``key=value`` joined by commas
  (the options it ran under, ``"linear=dense,zonal=reference"``, or the paths they
  resolved to); empty: the library's defaults, or a peer;
* ``ms``, ``p10``, ``p90``: the step time's median and 10th and 90th percentiles;
* ``peak_MiB``: the step's peak memory (a replay: that of its capture, which the
  graph's pool keeps);
* ``reps``: timed repetitions;
* ``provenance``: where the number came from, a JSON object (device, driver, torch,
  triton, commit, date, command).

A kernel row (:data:`KERNEL_COLUMNS`) is one kernel or op on one problem: ``kernel``,
``problem`` (its shape, as words), ``n`` (its size: elements, edges, rows),
``precision``, ``ms``, ``p10``, ``p90``, ``bytes`` and ``flops`` (what it must move
and compute), ``GBps`` and ``TFLOPs`` (those over the median), ``provenance``.

A chapter's own descriptive columns (``variant``, ``kind``, ``forward_ms``, an
``error``) go between the schema's and ``provenance``. A row that failed has its
keys, an ``error`` and empty measurements.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

__all__ = ["KERNEL_COLUMNS", "MODES", "STEP_COLUMNS", "check", "kernel_row", "plan",
           "provenance", "step_row", "write"]  # fmt: skip

STEP_COLUMNS = (
    "system", "n_atoms", "n_edges", "mode", "precision", "plan",
    "ms", "p10", "p90", "peak_MiB", "reps", "provenance",
)  # fmt: skip
KERNEL_COLUMNS = (
    "kernel", "problem", "n", "precision", "ms", "p10", "p90",
    "bytes", "flops", "GBps", "TFLOPs", "provenance",
)  # fmt: skip
MODES = ("eager", "replay")


def plan(choices: dict) -> str:
    """``{"linear": "dense", "zonal": "reference"}`` as
    ``"linear=dense,zonal=reference"`` (in the dict's order; ``{}`` is ``""``)."""
    return ",".join(f"{k}={v}" for k, v in choices.items())


def provenance(command: str | None = None) -> str:
    """:func:`ecekern.bench.provenance` as one JSON column, without the dtype (the
    row's ``precision`` says it)."""
    from .. import bench

    prov = bench.provenance(command=command)
    prov.pop("dtype")
    return json.dumps(prov)


def step_row(system, n_atoms, n_edges, mode, precision, plan_, t, peak_bytes, **extra):
    """A step row: ``t`` a :class:`~ecekern.bench.Timing` (None: not timed),
    ``peak_bytes`` the peak memory (None: not measured); ``extra``: the chapter's
    own columns."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    return {
        "system": system, "n_atoms": n_atoms, "n_edges": n_edges, "mode": mode,
        "precision": precision, "plan": plan_,
        "ms": t.median if t else "", "p10": t.p10 if t else "",
        "p90": t.p90 if t else "", "reps": t.n if t else "",
        "peak_MiB": "" if peak_bytes is None else peak_bytes / 2**20,
        **extra, "provenance": provenance(),
    }  # fmt: skip


def kernel_row(kernel, problem, n, precision, t, nbytes=None, flops=None, **extra):
    """A kernel row: ``t`` a :class:`~ecekern.bench.Timing` (None: not timed);
    GB/s and TFLOP/s over its median where ``nbytes`` and ``flops`` are given."""

    def rate(x, scale):
        return "" if x is None or t is None else x / t.median / scale

    return {
        "kernel": kernel, "problem": problem, "n": n, "precision": precision,
        "ms": t.median if t else "", "p10": t.p10 if t else "",
        "p90": t.p90 if t else "", "bytes": "" if nbytes is None else nbytes,
        "flops": "" if flops is None else flops,
        "GBps": rate(nbytes, 1e6), "TFLOPs": rate(flops, 1e9),
        **extra, "provenance": provenance(),
    }  # fmt: skip


def check(rows: list[dict], columns: tuple[str, ...] = STEP_COLUMNS) -> None:
    """Raise ``ValueError`` where a row lacks one of ``columns`` or a step row's
    ``mode`` is not one of :data:`MODES`."""
    for i, r in enumerate(rows):
        missing = [c for c in columns if c not in r]
        if missing:
            raise ValueError(f"row {i} ({r.get(columns[0])!r}) lacks {missing}")
        if "mode" in columns and r["mode"] not in MODES:
            raise ValueError(f"row {i}: mode {r['mode']!r}, not one of {MODES}")


def write(rows: list[dict], path: str | os.PathLike, columns=STEP_COLUMNS) -> Path:
    """Write ``rows`` (checked, :func:`check`) as CSV: the schema's columns in its
    order, the rows' own columns, then ``provenance``."""
    check(rows, columns)
    extra = [k for r in rows for k in r if k not in columns]
    keys = [*columns[:-1], *dict.fromkeys(extra), columns[-1]]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in keys} for r in rows)
    return path
