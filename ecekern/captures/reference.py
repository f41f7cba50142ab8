"""Chapter 1's capture: the reference force step, by stage, against size, beside the
peers; and the book's progress table (``progress``, :mod:`.progress`).

Every measurement of the reference runs under ``options.use(reference=True)``: the
library's defaults take the fast paths of later chapters on CUDA.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from .. import bench, options
from .common import force_row, free, parse_parts, print_row, profile_table, run_ncu

__all__ = ["PEERS", "capture", "peer_models"]

PARTS = ("reference", "profiles", "peers", "ncu", "scaling", "progress")
DEFAULT_PARTS = "reference,profiles,peers,ncu,scaling"


def _e3nn(cfg, dev: str):
    from ..peers import E3nnConvModel

    return E3nnConvModel(cfg)


def _cueq(cfg, dev: str):
    """cuEquivariance's convolution; on CUDA only with its CUDA kernels: without
    ``cuequivariance_ops_torch`` cuet falls back to its naive PyTorch path, which is
    not the peer a user of cuEquivariance runs."""
    if importlib.util.find_spec("cuequivariance_torch") is None:
        raise ImportError("cuequivariance_torch is not installed")
    if dev == "cuda":
        try:
            import cuequivariance_ops_torch  # noqa: F401
        except Exception as exc:
            raise ImportError(
                f"cuequivariance_ops_torch (its CUDA kernels) does not load: {exc!r}"
            ) from exc
    from ..peers import CueqConvModel

    return CueqConvModel(cfg)


#: The peers of the same width and degree, by their row label (built lazily: each
#: needs its own package).
PEERS = {
    "e3nn TP conv (NequIP-style)": _e3nn,
    "cuEquivariance TP conv (NequIP-style)": _cueq,
}


def peer_models(cfg, dtype: torch.dtype, info: dict, tag: str, dev: str = "cuda"):
    """``(label, model)`` of each peer on ``dev`` in ``dtype``; a peer that cannot be
    built (its package missing, say) is recorded in ``info`` under ``tag`` and
    skipped."""
    for label, build in PEERS.items():
        try:
            model = build(cfg, dev).to(device=dev, dtype=dtype)
        except Exception as exc:
            info[f"{label}: {tag}"] = f"skipped: {exc!r}"[:500]
            continue
        yield label, model


def _boxes(boxes: str | None, quick: bool) -> list[int]:
    return (
        [int(b) for b in boxes.split(",")] if boxes else ([2, 4] if quick else [4, 8])
    )


def capture(
    out: Path,
    quick: bool = False,
    ncu: bool = True,
    parts: str = DEFAULT_PARTS,
    boxes: str | None = None,
) -> dict:
    """Chapter 1: the reference force step, by stage, against size, and the peers.

    ``parts`` (comma-separated) selects what to run; each part writes its own files:
    ``reference`` -> force_step.csv, ``profiles`` -> profile_*, ``peers`` ->
    peers.csv, ``ncu`` -> ncu_force_step.csv, ``scaling`` -> scaling.csv,
    ``progress`` (or ``progress=SECONDS``, its time budget) -> progress.csv and
    stages.csv (:func:`ecekern.captures.progress.capture`). ``boxes``: diamond
    repeats, e.g. ``4,8``.
    """
    todo = parse_parts(parts, PARTS)
    info: dict = {"parts": sorted(todo)}
    reps = _boxes(boxes, quick)
    if "progress" in todo:
        from . import progress

        budget = float(todo["progress"]) if todo["progress"] else None
        info |= progress.capture(out, reps, quick=quick, budget_s=budget)
    if "reference" in todo:
        _reference(out, reps)
    if "profiles" in todo:
        _profiles(out, reps)
    if "peers" in todo:
        _peers(out, reps, info)
    if ncu and "ncu" in todo:
        info["ncu_force_step"] = run_ncu(
            "force_step", out / "ncu_force_step.csv", timeout=180
        )
    if "scaling" in todo:
        _scaling(out, quick, info)
    return info


def _inputs(rep: int, dtype: torch.dtype):
    import ecekern
    from ecekern.model import prepare_inputs

    cfg = ecekern.ECEConfig()
    atoms = ecekern.systems.diamond(rep)
    return cfg, prepare_inputs(atoms, cfg.cutoff, dtype, "cuda")


def _reference(out: Path, boxes: list[int]) -> None:
    """The reference at the standard boxes: strict fp32, fp32 + TF32, fp64."""
    import ecekern
    from ecekern.model import prepare_inputs

    rows = []
    for rep in boxes:
        for dtype, tf32 in [
            (torch.float32, False),
            (torch.float32, True),
            (torch.float64, False),
        ]:
            bench.set_tf32(tf32)
            try:
                cfg, atoms = ecekern.ECEConfig(), ecekern.systems.diamond(rep)
                t0 = time.perf_counter()
                inputs = prepare_inputs(atoms, cfg.cutoff, dtype, "cuda")
                torch.cuda.synchronize()
                g_ms = (time.perf_counter() - t0) * 1e3
                model = ecekern.ECEModel(cfg).to(device="cuda", dtype=dtype)
                with options.use(reference=True):
                    row = force_row(
                        "reference", model, inputs, dtype, {"graph_ms_wall": g_ms}
                    )
                rows.append(row)
                print_row(row)
                bench.write_csv(rows, out / "force_step.csv")
            finally:
                bench.set_tf32(False)
                model = inputs = None
                free()


def _profiles(out: Path, boxes: list[int]) -> None:
    """Profiles of the strict-fp32 reference: the force step and the forward."""
    import ecekern
    from ecekern.model import force_step

    for rep in boxes:
        cfg, inputs = _inputs(rep, torch.float32)
        model = ecekern.ECEModel(cfg).to(device="cuda", dtype=torch.float32)
        n = inputs[0].shape[0]
        with options.use(reference=True):
            profile_table(
                lambda m=model, i=inputs: force_step(m, *i), out, f"profile_step_{n}"
            )
            with torch.no_grad():
                profile_table(
                    lambda m=model, i=inputs: m(*i), out, f"profile_forward_{n}"
                )
        model = inputs = None
        free()


def _peers(out: Path, boxes: list[int], info: dict) -> None:
    """The peers at the same width and degree, strict fp32: the reference under
    ``torch.compile`` (a fresh compile per box: static shapes, as a user with one
    system has), e3nn's and cuEquivariance's tensor-product convolutions."""
    import ecekern
    from ecekern.model import force_step

    rows = []
    for rep in boxes:
        cfg, inputs = _inputs(rep, torch.float32)
        model = ecekern.ECEModel(cfg).to(device="cuda", dtype=torch.float32)
        try:
            with options.use(reference=True):
                torch._dynamo.reset()
                compiled = torch.compile(model)
                t0 = time.perf_counter()
                force_step(compiled, *inputs)
                torch.cuda.synchronize()
                extra = {"compile_s": time.perf_counter() - t0}
                name = "reference + torch.compile"
                rows.append(force_row(name, compiled, inputs, torch.float32, extra))
            print_row(rows[-1])
            bench.write_csv(rows, out / "peers.csv")
        except Exception as exc:
            info[f"compile_{rep}"] = f"failed: {exc!r}"[:500]
        model = compiled = None
        free()
        for name, peer in peer_models(cfg, torch.float32, info, f"box {rep}"):
            try:
                rows.append(force_row(name, peer, inputs, torch.float32))
                print_row(rows[-1])
                bench.write_csv(rows, out / "peers.csv")
            except Exception as exc:
                info[f"{name}: box {rep}"] = f"failed: {exc!r}"[:500]
            peer = None
            free()
        inputs = None
        free()
    bench.write_csv(rows, out / "peers.csv")


def _scaling(out: Path, quick: bool, info: dict) -> None:
    """Time and peak memory against system size, strict fp32, until memory runs
    out or the time budget is spent."""
    import ecekern

    rows = []
    reps = [2, 3, 4] if quick else [2, 3, 4, 5, 6, 8, 10, 12, 14, 16]
    t_start = time.time()
    for rep in reps:
        if time.time() - t_start > 240:
            info["scaling_stopped"] = f"time budget reached before {8 * rep**3} atoms"
            break
        try:
            cfg, inputs = _inputs(rep, torch.float32)
            model = ecekern.ECEModel(cfg).to(device="cuda", dtype=torch.float32)
            with options.use(reference=True):
                row = force_row(
                    "reference",
                    model,
                    inputs,
                    torch.float32,
                    rep_ms=200.0 if rep < 10 else 50.0,
                )
            rows.append(row)
            bench.write_csv(rows, out / "scaling.csv")
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
            free()
    bench.write_csv(rows, out / "scaling.csv")
