"""Captures: what a GPU run measured, stored in ``book/captures/<chapter>/``.

A capture folder holds benchmark CSVs (step timings and kernel timings in the
schemas of :mod:`.schema`, provenance on every row), ``torch.profiler`` tables,
Nsight Compute metric CSVs and a ``manifest.json``. One command regenerates a
chapter's captures on a GPU and packs them as one archive (:mod:`.runner`)::

    python -m ecekern.captures methodology 01_reference --out /tmp/caps

The notebooks read captures through :func:`load` and plot them; they never type a
measured number by hand.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

__all__ = ["PROGRESS_PEERS", "PROGRESS_ROWS", "Capture", "capture_root", "load",
           "markdown_table", "ncu_kernels", "progress_order",
           "progress_rows"]  # fmt: skip


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


def _row(r: dict) -> dict:
    out = {k: _num(v) for k, v in r.items()}
    if str(r.get("provenance", "")).startswith("{"):
        out["provenance"] = json.loads(r["provenance"])
    return out


class Capture:
    """One chapter's capture folder."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / "manifest.json").is_file():
            raise FileNotFoundError(f"no capture manifest in {self.path}")
        self.manifest = json.loads((self.path / "manifest.json").read_text())

    def csv(self, name: str) -> list[dict]:
        """Rows of ``<name>.csv`` as dicts, numbers converted; a ``provenance``
        column (JSON, :func:`.schema.provenance`) as a dict."""
        with (self.path / f"{name}.csv").open(newline="") as fh:
            return [_row(r) for r in csv.DictReader(fh)]

    def text(self, name: str) -> str:
        return (self.path / name).read_text()

    def files(self) -> list[str]:
        return sorted(p.name for p in self.path.iterdir())

    def __repr__(self) -> str:
        return f"Capture({self.path.name!r}, {len(self.files())} files)"


def load(chapter: str, root: str | os.PathLike | None = None) -> Capture:
    """The capture of ``chapter`` (e.g. ``"01_reference"``)."""
    return Capture(Path(root) if root else capture_root() / chapter)


def markdown_table(rows: list[dict], columns: dict[str, str],
                   fmt: dict | None = None) -> str:  # fmt: skip
    """A Markdown table of ``rows``: ``columns`` maps keys to headers, ``fmt`` keys to
    format strings (``"{:.2f}"``); a value the capture lacks (None, say a row of an
    interrupted run) is "not captured"."""
    fmt = fmt or {}
    head = "| " + " | ".join(columns.values()) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"

    def cell(r, k):
        v = r.get(k)
        return "not captured" if v is None else fmt.get(k, "{}").format(v)

    body = ["| " + " | ".join(cell(r, k) for k in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


#: The progress table's peers: what a user would reach for instead of this library.
PROGRESS_PEERS = ("reference + torch.compile", "e3nn TP conv (NequIP-style)",
                  "cuEquivariance TP conv (NequIP-style)")  # fmt: skip
#: The rows of chapter 1's progress table (``progress.csv``), in the table's order:
#: our force step after each chapter, the library's defaults, and the peers.
PROGRESS_ROWS = (
    "reference", "+ ch2 linear", "+ ch3 edge_frame", "+ ch4 graph_step",
    "+ ch5 zonal", "+ ch6 cohorts", "+ ch6 fused strict fp32 stack",
    "+ ch6 3xTF32 stack", "+ ch6 fused 3xTF32 stack", "+ ch6 TF32 stack",
    "+ ch6 fused TF32 stack", "+ ch6 bf16 stack", "+ ch6 fused bf16 stack",
    "+ ch7 step", "library defaults", *PROGRESS_PEERS,
    "library defaults + torch.compile",
)  # fmt: skip


def progress_order(r: dict) -> tuple:
    """A progress.csv row's place in the table: by size, strict fp32 first, then in
    :data:`PROGRESS_ROWS`' order (a label it lacks last), replay before eager."""
    known = r["system"] in PROGRESS_ROWS
    i = PROGRESS_ROWS.index(r["system"]) if known else len(PROGRESS_ROWS)
    return (r["n_atoms"], r["precision"] != "float32", i, r["mode"] != "replay")


def progress_rows(root: str | os.PathLike | None = None) -> list[dict]:
    """The progress table: the force step (energy + forces) after each chapter, the
    library's defaults and the peers, at 512 and 4096 atoms, strict fp32 and TF32,
    replayed and eager, from chapter 1's ``progress.csv`` (one run of every row, step
    schema), in :func:`progress_order`; failed rows left out.

    Each row: ``system`` (and ``chapter``), ``n_atoms``, ``n_edges``, ``dtype`` (the
    row's ``precision``), ``mode``, ``step_ms``, ``peak_MiB``, ``flop`` and
    ``flop_source`` (a run without them: ours by :func:`ecekern.flops.step_flops` of
    the run's config, a peer's None), ``device``, ``commit``; ``vs_reference``, the
    reference's time over this row's at the same size and precision, in
    ``reference_mode``: this row's mode where the reference ran in it, else eager;
    ``vs_fastest_peer``, the fastest peer's in the same mode (None: none)."""
    from ..config import ECEConfig
    from ..flops import step_flops

    cap = load("01_reference", Path(root) / "01_reference" if root else None)
    cfg = ECEConfig.from_dict(cap.manifest.get("progress_config", {}))
    rows = []
    for r in sorted(cap.csv("progress"), key=progress_order):
        if r.get("error") or r["ms"] in ("", None):
            continue
        flop, source = r.get("flop"), r.get("flop_source") or None
        if flop in ("", None) and "NequIP" not in r["system"]:  # ours, a run without
            flop, source = step_flops(cfg, r["n_atoms"], r["n_edges"])["total"], "model"
        rows.append(
            {"system": r["system"], "chapter": r["system"], "n_atoms": r["n_atoms"],
             "n_edges": r["n_edges"], "dtype": r["precision"], "mode": r["mode"],
             "step_ms": r["ms"], "peak_MiB": r["peak_MiB"],
             "flop": flop if flop != "" else None, "flop_source": source,
             "device": r["provenance"]["device"], "commit": r["provenance"]["commit"]}
        )  # fmt: skip
    for r in rows:
        same = [
            x for x in rows if (x["n_atoms"], x["dtype"]) == (r["n_atoms"], r["dtype"])
        ]
        ref = {x["mode"]: x["step_ms"] for x in same if x["system"] == "reference"}
        r["reference_mode"] = r["mode"] if r["mode"] in ref else "eager"
        t = ref.get(r["reference_mode"])
        r["vs_reference"] = t / r["step_ms"] if t else None
        peers = [x["step_ms"] for x in same if x["system"] in PROGRESS_PEERS
                 and x["mode"] == r["mode"]]  # fmt: skip
        r["vs_fastest_peer"] = min(peers) / r["step_ms"] if peers else None
    return rows


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
#: conflicts and wavefronts, instructions issued and FMA instructions executed,
#: registers per thread.
NCU_COUNTS = {
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "smem_ld_conflicts",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": "smem_st_conflicts",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "smem_ld_wavefronts",
    "smsp__inst_executed.sum": "instructions",
    "smsp__inst_executed_pipe_fma.sum": "fma_instructions",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1tex_pct",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "ld_sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "ld_requests",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": "st_sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum": "st_requests",
    "launch__registers_per_thread": "registers",
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
    to_ms_or_MB = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3,
                   "ms": 1.0, "msecond": 1.0, "byte": 1e-6, "Kbyte": 1e-3,
                   "Mbyte": 1.0, "Gbyte": 1e3}  # fmt: skip

    def mb(r, key, unit="byte"):  # a time (unit "ns") in ms
        return _ncu_float(r[key]) * to_ms_or_MB.get(units.get(key, unit), 1e-6)

    out = []
    for r in data:
        t = mb(r, "gpu__time_duration.sum", "ns")
        k = {"kernel": r.get("Kernel Name", ""), "time_ms": t}
        for key, short in NCU_COLUMNS.items():
            if key in r and short.endswith("_pct"):
                k[short] = _ncu_float(r[key])
        dram = ("dram__bytes_read.sum", "dram__bytes_write.sum")
        k["dram_MB"] = sum(mb(r, key) for key in dram if key in r)
        if "lts__t_bytes.sum" in r:
            k["l2_MB"] = mb(r, "lts__t_bytes.sum")
        k |= {
            short: _ncu_float(r[key]) for key, short in NCU_COUNTS.items() if key in r
        }
        stall = "smsp__average_warps_issue_stalled_"
        for key in (key for key in r if key.startswith(stall)):
            reason = key.removeprefix(stall).removesuffix("_per_issue_active.ratio")
            k["stall_" + reason] = _ncu_float(r[key])
        out.append(k)
    return out


def chapter_opening(system: str, stages: tuple[str, ...],
                    root: str | os.PathLike | None = None) -> str:  # fmt: skip
    """The opening of a chapter, as Markdown from the one-run progress capture: the
    chapter's row of the progress table (``system``, both sizes, strict fp32 and TF32,
    each mode run, against the reference, in the mode :func:`progress_rows` says, and
    the fastest peer in the same mode), then its stages' share of the
    reference's 4096-atom force step, forward and backward (``stages.csv``)."""
    rows = [r for r in progress_rows(root) if r["system"] == system]
    for r in rows:
        mixed = f" (vs the {r['reference_mode']} reference)"
        r["vs_ref"] = f"{r['vs_reference']:.2f}" + (
            mixed if r["mode"] != r["reference_mode"] else "")  # fmt: skip
        p = r["vs_fastest_peer"]
        word = "replayed" if r["mode"] == "replay" else r["mode"]
        r["vs_peer"] = f"{p:.2f}" if p else f"peers not measured {word} yet"
    cols = {"n_atoms": "atoms", "dtype": "precision", "mode": "mode",
            "step_ms": "force step (ms)", "vs_ref": "x vs reference",
            "vs_peer": "x vs fastest peer, same mode"}  # fmt: skip
    table = markdown_table(rows, cols, {"step_ms": "{:.1f}"})
    if not stages:
        return table
    cap = load("01_reference", Path(root) / "01_reference" if root else None)
    st = [r for r in cap.csv("stages") if r["system"] == "reference"]
    mine = [r for r in st if r["stage"] in stages]
    fwd, bwd, f, b = (sum(r[k] for r in rs) for rs in (st, mine)
                      for k in ("forward_ms", "backward_ms"))  # fmt: skip
    n = st[0]["n_atoms"]
    names = ", ".join(f"`{s}`" for s in stages)
    card = str(st[0].get("device", "")).removeprefix("NVIDIA ").split(" ")[0]
    share = (
        f"In the reference's {n}-atom force step (strict fp32, eager, {card}) "
        f"{'the stages ' + names + ' take' if len(stages) > 1 else names + ' takes'} "
        f"{f:.1f} ms of the forward's {fwd:.1f} ms ({100 * f / fwd:.0f} %) and "
        f"{b:.1f} ms of the backward's {bwd:.1f} ms ({100 * b / bwd:.0f} %)."
    )
    return table + "\n\n" + share
