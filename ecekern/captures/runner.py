"""``python -m ecekern.captures CHAPTER [CHAPTER ...] --out DIR [--quick] [--parts P]``.

The one runner of every chapter's capture. It writes ``DIR/<chapter>/`` (CSVs,
profiler tables, ncu metrics, ``manifest.json``) and packs everything as
``DIR/captures.tar.gz``: copy it back and unpack it into ``book/captures``.

A chapter is a module of :data:`CHAPTERS` with ``PARTS``, ``{name: part}`` in the
order they run, each ``part(run: Run, arg: str) -> note`` (``arg``: what followed
``name=`` in ``--parts``); optionally ``DEFAULT`` (the parts run without
``--parts``, all of them otherwise), ``GPU_ONLY`` (parts skipped, and said so,
without a GPU) and ``notes(run) -> dict`` (the manifest's notes before any part
runs). A part's note goes into the manifest under its name (a dict note is merged
into the manifest); a part that raises is ``"failed: ..."`` there, the rest still
run, and the manifest's status is ``"partial"`` (the command's exit status 1).
``--parts`` runs some parts and merges their notes into the chapter's existing
manifest (:func:`merge_part_run`). A run stopped by SIGTERM (a ``timeout``)
still writes what it has: its manifest says ``"interrupted"`` and the rows written
so far travel in the archive.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CHAPTERS", "Interrupted", "Run", "main", "merge_part_run", "parse_parts",
           "run_chapter"]  # fmt: skip

#: The chapters by slug: the module (of this package) that captures each.
CHAPTERS = {"methodology": "methodology", "01_reference": "progress",
            "02_linear": "linear", "03_edge_frame": "edge_frame",
            "04_graph_step": "graph_step", "05_zonal": "zonal",
            "06_cohorts": "cohorts", "07_step": "step",
            "08_edge_layer": "edge_layer", "A_train": "train"}  # fmt: skip


@dataclass
class Run:
    """What a part is given: the output folder, ``quick`` (small sizes, a smoke
    test), whether Nsight Compute runs, the device (``cuda``; ``cpu`` is a smoke
    test in Triton's interpreter), ``boxes`` (``--boxes``, diamond repeats, or None)
    and the manifest's notes so far (``info``: a part may read an earlier part's)."""

    out: Path
    quick: bool = False
    ncu: bool = True
    dev: str = "cuda"
    boxes: str | None = None
    info: dict = field(default_factory=dict)

    def reps(self, full=(4, 8), quick=(4,), cpu=(1,)) -> list[int]:
        """The diamond repeats to measure: ``cpu`` without a GPU, else ``--boxes``
        where given, ``quick`` with ``--quick``, ``full`` otherwise (512 and 4096
        atoms)."""
        if self.dev != "cuda":
            return list(cpu)
        if self.boxes:
            return [int(b) for b in self.boxes.split(",")]
        return list(quick if self.quick else full)

    def timing(self, rep_ms: float, min_reps: int) -> dict:
        """:func:`~.common.force_row`'s timing arguments: these on a GPU, one timed
        call in Triton's interpreter (a smoke test)."""
        cuda = self.dev == "cuda"
        return dict(rep_ms=rep_ms if cuda else 1.0, min_reps=min_reps if cuda else 1)


def parse_parts(parts: str, known) -> dict[str, str]:
    """``"a,b=arg,c"`` as ``{"a": "", "b": "arg", "c": ""}``; a name that is not one
    of ``known`` is an error (a typo would otherwise measure nothing)."""
    todo = dict(p.partition("=")[::2] for p in parts.split(","))
    unknown = sorted(set(todo) - set(known))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}: choose from {', '.join(known)}")
    return todo


def chapter_module(name: str):
    """The module of chapter ``name`` (a slug of :data:`CHAPTERS`)."""
    if name not in CHAPTERS:
        raise ValueError(f"unknown chapter {name!r}: choose from {sorted(CHAPTERS)}")
    return importlib.import_module(f"{__package__}.{CHAPTERS[name]}")


def run_chapter(name: str, out: Path, quick: bool = False, ncu: bool = True,
                parts: str | None = None, boxes: str | None = None,
                dev: str | None = None) -> dict:  # fmt: skip
    """Run chapter ``name``'s parts (``parts``, comma-separated, or its default)
    into ``out``; returns the manifest's notes (module docstring)."""
    from .common import device, free

    mod = chapter_module(name)
    todo = parse_parts(parts or getattr(mod, "DEFAULT", ",".join(mod.PARTS)), mod.PARTS)
    run = Run(Path(out), quick, ncu, dev or device(), boxes, {"parts": sorted(todo)})
    if hasattr(mod, "notes"):
        run.info |= mod.notes(run)
    for part, fn in mod.PARTS.items():
        if part not in todo:
            continue
        if part in getattr(mod, "GPU_ONLY", ()) and run.dev != "cuda":
            run.info[part] = "skipped: no GPU"
            continue
        if part == "ncu" and not ncu:
            run.info[part] = "skipped: --no-ncu"
            continue
        try:
            note = fn(run, todo[part])
        except Exception as exc:
            traceback.print_exc()
            note = f"failed: {exc!r}"[:500]
        if isinstance(note, dict) and note:
            run.info |= note
        else:
            run.info[part] = note or "done"
        free()
    return run.info


def merge_part_run(path: Path, run: dict, parts: str) -> dict:
    """A run of some parts (``--parts``) into the chapter's existing manifest: the
    earlier runs' notes stay, this run's notes replace theirs key by key, and the run
    (its parts, status, seconds and provenance) is appended to ``runs``. Without an
    earlier manifest the run's own is returned."""
    if not path.exists():
        return run
    old = json.loads(path.read_text())
    fixed = ("chapter", "status", "quick", "seconds", "provenance", "files", "runs")
    notes = {k: v for k, v in run.items() if k not in fixed}
    merged = {**old, **notes}
    merged["files"] = sorted(set(old.get("files", [])) | set(run["files"]))
    entry = {k: run[k] for k in ("status", "seconds", "provenance")}
    merged["runs"] = [*old.get("runs", []), {"parts": parts, **entry}]
    return merged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ecekern.captures")
    ap.add_argument("chapters", nargs="+", choices=sorted(CHAPTERS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    ap.add_argument("--no-ncu", action="store_true")
    ap.add_argument("--parts", default=None, help="the chapter's parts, comma-"
                    "separated (e.g. 01_reference: progress)")  # fmt: skip
    ap.add_argument("--boxes", default=None, help="diamond repeats, e.g. 4,8")
    ap.add_argument("--cpu", action="store_true", help="no GPU (a smoke test)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("captures need a CUDA GPU (--cpu: a smoke test)", file=sys.stderr)
        return 2
    out = Path(args.out)
    command = "python -m ecekern.captures " + " ".join(argv or sys.argv[1:])
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        statuses = [_capture(name, out / name, args, command) for name in args.chapters]
    finally:
        signal.signal(signal.SIGTERM, previous)
    with tarfile.open(out / "captures.tar.gz", "w:gz") as tar:
        for name in args.chapters:
            tar.add(out / name, arcname=name)
    return 0 if all(st == "ok" for st in statuses) else 1


def _capture(name: str, d: Path, args, command: str) -> str:
    """One chapter of :func:`main` into ``d``, its manifest written; its status."""
    from ..bench import provenance

    d.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        info = run_chapter(name, d, args.quick, not args.no_ncu, args.parts, args.boxes)
        broken = [p for p in info["parts"] if str(info.get(p)).startswith("fail")]
        status = "partial" if broken else "ok"
    except Interrupted:
        info, status = {}, "interrupted"
    except Exception:
        traceback.print_exc()
        info, status = {}, "failed"
    manifest = {
        "chapter": name, "status": status, "quick": args.quick,
        "seconds": round(time.time() - t0, 1),
        "provenance": provenance(command=command),
        "files": sorted(p.name for p in d.iterdir() if p.name != "manifest.json"),
        **info,
    }  # fmt: skip
    if args.parts:
        manifest = merge_part_run(d / "manifest.json", manifest, args.parts)
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"[captures] {name}: {status} in {manifest['seconds']} s", flush=True)
    return status


class Interrupted(BaseException):
    """SIGTERM arrived during a capture. Not an ``Exception``: the sweeps catch those
    per cell (an out-of-resources launch is a row, not the end of the run), and a
    stop request must end the run."""


def _interrupt(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second TERM ends the process
    raise Interrupted(f"signal {signum}")
