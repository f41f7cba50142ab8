"""Chapter 1's capture: the reference force step at the standard boxes, its profiles
and its kernels, the peers the progress table measures beside it; and the book's
progress table (``progress``, :mod:`.progress`).

Every measurement of the reference runs under ``options.use(reference=True)``: the
library's defaults take the fast paths of later chapters on CUDA.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from .. import options
from . import common, schema

__all__ = ["PARTS", "PEERS", "peer_models"]

#: The options of every measurement of the reference.
REFERENCE = {"reference": True}


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


def _progress(run, arg: str) -> dict:
    """progress.csv and stages.csv (:func:`ecekern.captures.progress.capture`);
    ``progress=SECONDS``: its time budget."""
    from . import progress

    budget = float(arg) if arg else None
    return progress.capture(
        run.out, run.reps(quick=(2, 4)), quick=run.quick, budget_s=budget
    )


_ncu = common.ncu_part({"force_step": ("force_step", None)}, timeout=180)


def _reference_row(rep: int, dtype=torch.float32, rep_ms: float = 400.0) -> dict:
    """A row of the reference's force step on ``diamond(rep)`` in ``dtype`` (TF32 as
    switched now), strict options (:data:`REFERENCE`): time and peak memory, its
    forward alone (``forward_ms``) and the graph's build time (``graph_ms_wall``)."""
    import ecekern
    from ecekern.model import prepare_inputs

    cfg, atoms = ecekern.ECEConfig(), ecekern.systems.diamond(rep)
    t0 = time.perf_counter()
    inputs = prepare_inputs(atoms, cfg.cutoff, dtype, "cuda")
    torch.cuda.synchronize()
    g_ms = (time.perf_counter() - t0) * 1e3
    model = ecekern.ECEModel(cfg).to(device="cuda", dtype=dtype)
    with options.use(**REFERENCE):
        return common.force_row("reference", model, inputs, schema.plan(REFERENCE),
                                rep_ms=rep_ms, forward=True,
                                graph_ms_wall=g_ms)  # fmt: skip


def _reference(run, arg: str) -> str:
    """force_step.csv: the reference at the standard boxes, strict fp32, fp32 +
    TF32, fp64 (:func:`_reference_row`)."""
    rows = []
    for rep in run.reps(quick=(2, 4)):
        for dtype, tf32 in ((torch.float32, False), (torch.float32, True),
                            (torch.float64, False)):  # fmt: skip
            with common.switched({}, tf32):
                rows.append(_reference_row(rep, dtype))
            schema.write(rows, run.out / "force_step.csv")
            common.free()
    return "done"


def _profiles(run, arg: str) -> str:
    """Profiles of the strict-fp32 reference's force step."""
    from ecekern.model import force_step

    def body(rep, model, inputs):
        n = inputs[0].shape[0]
        with options.use(**REFERENCE):
            step = lambda: force_step(model, *inputs)
            common.profile_table(step, run.out, f"profile_step_{n}")

    common.for_boxes(run, body, reps=run.reps(quick=(2, 4)))
    return "done"


PARTS = {"progress": _progress, "reference": _reference, "profiles": _profiles,
         "ncu": _ncu}  # fmt: skip
DEFAULT = "reference,profiles,ncu"
GPU_ONLY = tuple(PARTS)
