"""Captures: what a GPU run measured, stored in ``book/captures/<chapter>/``.

A capture folder holds benchmark CSVs (one schema, provenance on every row),
``torch.profiler`` tables, Nsight Compute metric CSVs and a ``manifest.json``. One
command regenerates a chapter's captures on a GPU and packs them as one archive::

    python -m ecekern.captures methodology 01_einsum_reference --out /tmp/caps

The notebooks read captures through :func:`load` and plot them; they never type a
measured number by hand.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

__all__ = ["Capture", "capture_root", "load"]


def capture_root() -> Path:
    """``$ECEKERN_CAPTURES`` if set, else ``book/captures`` of this checkout."""
    env = os.environ.get("ECEKERN_CAPTURES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "book" / "captures"


def _num(v: str):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f


class Capture:
    """One chapter's capture folder."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / "manifest.json").is_file():
            raise FileNotFoundError(f"no capture manifest in {self.path}")
        self.manifest = json.loads((self.path / "manifest.json").read_text())

    def csv(self, name: str) -> list[dict]:
        """Rows of ``<name>.csv`` as dicts, numbers converted."""
        with (self.path / f"{name}.csv").open(newline="") as fh:
            return [{k: _num(v) for k, v in row.items()} for row in csv.DictReader(fh)]

    def text(self, name: str) -> str:
        return (self.path / name).read_text()

    def files(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir())

    def __repr__(self) -> str:
        return f"Capture({self.path.name!r}, {len(self.files())} files)"


def load(chapter: str, root: str | os.PathLike | None = None) -> Capture:
    """The capture of ``chapter`` (e.g. ``"01_einsum_reference"``)."""
    return Capture(Path(root) if root else capture_root() / chapter)


def markdown_table(
    rows: list[dict], columns: dict[str, str], fmt: dict | None = None
) -> str:
    """A Markdown table of ``rows``: ``columns`` maps keys to headers, ``fmt`` keys to
    format strings (``"{:.2f}"``)."""
    fmt = fmt or {}
    head = "| " + " | ".join(columns.values()) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(fmt.get(k, "{}").format(r[k]) for k in columns) + " |"
        for r in rows
    ]
    return "\n".join([head, sep, *body])


def progress_rows(root: str | os.PathLike | None = None) -> list[dict]:
    """The progress table: the force step (energy + forces) after each chapter and
    for the peers, at 512 and 4096 atoms, from the chapters' captures: strict fp32,
    and where a chapter's win is on the tensor cores, its TF32 row beside the
    reference's TF32 row (``dtype`` says which)."""
    base = Path(root) if root else capture_root()
    rows = []
    ref = load("01_einsum_reference", base / "01_einsum_reference")
    peers = ref.csv("peers") if "peers.csv" in ref.files() else []
    keys = (
        "n_atoms",
        "n_edges",
        "dtype",
        "step_ms",
        "peak_mem_MiB",
        "device",
        "commit",
    )
    for r in ref.csv("force_step") + peers:
        if r["dtype"] != "float32":
            continue
        label = {"reference": "1. einsum reference"}.get(
            r["model"], "peer: " + r["model"]
        )
        rows.append({"chapter": label, **{k: r[k] for k in keys}})
    p2 = base / "02_block_diagonal_gemm"
    if (p2 / "model_steps.csv").exists():
        labels = {
            ("dense", "float32"): "2. dense block-diagonal GEMM",
            ("triton", "float32"): "2. Triton path, Gluon FMA forward (auto)",
            ("einsum", "float32+tf32"): "1. einsum reference",
            ("dense", "float32+tf32"): "2. dense block-diagonal GEMM (auto)",
        }
        for r in load("02_block_diagonal_gemm", p2).csv("model_steps"):
            label = labels.get((r["path"], r["dtype"]))
            if label:
                rows.append({"chapter": label, **{k: r[k] for k in keys}})
    p5 = base / "05_fused_scatter"
    if (p5 / "model_steps.csv").exists():
        for r in load("05_fused_scatter", p5).csv("model_steps"):
            if r["kind"] == "force step" and r["scatter"] == "fused":
                label = "5. fused zonal scatter (on the reference)"
                rows.append({"chapter": label, **{k: r[k] for k in keys}})
    return sorted(
        rows,
        key=lambda r: (
            r["n_atoms"],
            r["dtype"] != "float32",
            not r["chapter"][0].isdigit(),
        ),
    )


NCU_COLUMNS = {
    "gpu__time_duration.sum": "time",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_pct",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": (
        "tensor_pct"
    ),
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "fma_pct",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
}
#: Counters kept as plain numbers (where a capture has them): shared-memory bank
#: conflicts and wavefronts, instructions issued and FMA instructions executed.
NCU_COUNTS = {
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "smem_ld_conflicts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": "smem_st_conflicts",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "smem_ld_wavefronts",
    "smsp__inst_executed.sum": "instructions",
    "smsp__inst_executed_pipe_fma.sum": "fma_instructions",
}


def _ncu_float(text: str) -> float:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return float("nan")


def ncu_kernels(capture: Capture, name: str) -> list[dict]:
    """The kernels of an Nsight Compute raw CSV page (``ncu --csv --page raw``).

    Returns one dict per kernel: ``kernel`` (name), ``time_ms``, ``dram_pct``,
    ``sm_pct``, ``occupancy_pct``, ``dram_MB`` (read + written), where captured
    ``l2_MB`` (all L2 traffic), ``l2_pct``, ``tensor_pct`` and ``fma_pct`` (pipe
    activity), the counters of ``NCU_COUNTS`` that were captured, and one
    ``stall_<reason>`` per stall-reason metric present (warps stalled per issued
    instruction). Units are read from the page's second row.
    """
    with (capture.path / f"{name}.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    units, data = rows[0], rows[1:]
    scale_t = {
        "ns": 1e-6,
        "us": 1e-3,
        "usecond": 1e-3,
        "nsecond": 1e-6,
        "ms": 1.0,
        "msecond": 1.0,
    }
    scale_b = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
    out = []
    for r in data:
        t_key = "gpu__time_duration.sum"
        k = {
            "kernel": r.get("Kernel Name", ""),
            "time_ms": _ncu_float(r[t_key]) * scale_t.get(units.get(t_key, "ns"), 1e-6),
        }
        for key, short in NCU_COLUMNS.items():
            if key in r and short.endswith("_pct"):
                k[short] = _ncu_float(r[key])
        k["dram_MB"] = sum(
            _ncu_float(r[key]) * scale_b.get(units.get(key, "byte"), 1e-6)
            for key in ("dram__bytes_read.sum", "dram__bytes_write.sum")
            if key in r
        )
        if "lts__t_bytes.sum" in r:
            key = "lts__t_bytes.sum"
            k["l2_MB"] = _ncu_float(r[key]) * scale_b.get(units.get(key, "byte"), 1e-6)
        for key, short in NCU_COUNTS.items():
            if key in r:
                k[short] = _ncu_float(r[key])
        for key in r:
            if key.startswith("smsp__average_warps_issue_stalled_"):
                reason = key.removeprefix("smsp__average_warps_issue_stalled_")
                k["stall_" + reason.removesuffix("_per_issue_active.ratio")] = (
                    _ncu_float(r[key])
                )
        out.append(k)
    return out
