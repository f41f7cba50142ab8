"""Chapter 1's capture: the book's progress table (``progress``, :mod:`.progress`;
the reference, each chapter's switch, the library's defaults and the peers of
:data:`PEERS`) and Nsight Compute on the reference's 512-atom force step (``ncu``,
the default run). The reference's own measurements are settled:
``book/history/01_reference/reference_capture.md``.
"""

from __future__ import annotations

import importlib.util

import torch

from . import common

__all__ = ["PARTS", "PEERS", "peer_models"]


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


PARTS = {"progress": _progress, "ncu": _ncu}
DEFAULT = "ncu"
GPU_ONLY = tuple(PARTS)
