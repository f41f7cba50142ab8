"""``python -m ecekern.captures CHAPTER [CHAPTER ...] --out DIR [--quick] [--parts P]``.

Runs each chapter's capture on the GPU, writes ``DIR/<chapter>/`` (CSVs, profiler
tables, ncu metrics, ``manifest.json``) and packs everything as
``DIR/captures.tar.gz``: copy it back and unpack it into ``book/captures``. The
chapters are those of :data:`ecekern.captures.chapters.REGISTRY`; ``--parts`` picks
some of a chapter's parts (``01_reference --parts progress``: the progress table), and
its notes are merged into the chapter's existing manifest (:func:`merge_part_run`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tarfile
import time
import traceback
from pathlib import Path

from . import chapters


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
    ap.add_argument("chapters", nargs="+", choices=sorted(chapters.REGISTRY))
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    ap.add_argument("--no-ncu", action="store_true")
    ap.add_argument(
        "--parts",
        default=None,
        help="the chapter's parts, comma-separated (e.g. 01_reference: progress)",
    )
    ap.add_argument("--boxes", default=None, help="chapter-1 diamond repeats, e.g. 4,8")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("captures need a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    failed = []
    # a run stopped by `timeout` (SIGTERM) still writes what it has: the manifest
    # says "interrupted", and the rows written so far travel in the archive
    signal.signal(signal.SIGTERM, _interrupt)
    for name in args.chapters:
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        try:
            kw = {k: v for k, v in (("parts", args.parts), ("boxes", args.boxes)) if v}
            info = chapters.REGISTRY[name](
                d, quick=args.quick, ncu=not args.no_ncu, **kw
            )
            status = "ok"
        except Interrupted:
            info, status = {}, "interrupted"
            failed.append(name)
        except Exception:
            traceback.print_exc()
            info, status = {}, "failed"
            failed.append(name)
        from ..bench import provenance

        manifest = {
            "chapter": name,
            "status": status,
            "quick": args.quick,
            "seconds": round(time.time() - t0, 1),
            "provenance": provenance(
                command="python -m ecekern.captures " + " ".join(argv or sys.argv[1:])
            ),
            "files": sorted(p.name for p in d.iterdir() if p.name != "manifest.json"),
            **info,
        }
        if args.parts:
            manifest = merge_part_run(d / "manifest.json", manifest, args.parts)
        (d / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"[captures] {name}: {status} in {manifest['seconds']} s", flush=True)
    with tarfile.open(out / "captures.tar.gz", "w:gz") as tar:
        for name in args.chapters:
            tar.add(out / name, arcname=name)
    return 1 if failed else 0


class Interrupted(BaseException):
    """SIGTERM arrived during a capture. Not an ``Exception``: the sweeps catch those
    per cell (an out-of-resources launch is a row, not the end of the run), and a
    stop request must end the run."""


def _interrupt(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second TERM ends the process
    raise Interrupted(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
