"""Trained models that ship with ecekern.

``ecekern.pretrained(name)`` returns a ready :class:`~ecekern.ECEModel`, loaded from
a checkpoint in this package (:meth:`~ecekern.ECEModel.save`'s format: config,
dtype, parameters and metadata). The metadata holds what the model was trained on
and how (``dataset``, ``train_config``), its validation and held-out test metrics
per structure family (``test_metrics``) and the provenance of the run.

``carbon-gfn1``: the book's architecture (C = 32, L = M = 2, two interaction
layers, cutoff 5 Å, carbon only), trained with ``python -m ecekern.train`` on the
shipped GFN1-xTB carbon set (``ecekern/data/carbon_gfn1.extxyz.xz``: diamond,
graphite, graphene, amorphous and liquid carbon). It knows carbon near those
structures and densities only; it is a teaching model, not a general potential.
"""

from __future__ import annotations

from importlib import resources

import torch

MODELS = {
    "carbon-gfn1": (
        "carbon_gfn1.pt",
        "carbon (diamond, graphite, graphene, amorphous, liquid), GFN1-xTB labels",
    ),
}


def available() -> dict[str, str]:
    """The names :func:`pretrained` accepts, each with what it was trained on."""
    return {name: what for name, (_, what) in MODELS.items()}


def pretrained(name: str = "carbon-gfn1", device=None, dtype=None):
    """The shipped model ``name`` (:func:`available` lists them), in eval mode, on
    ``device`` (None: the CPU) and in ``dtype`` (None: as saved, float32).

    Unknown names are a ValueError; a missing weights file (a stripped install)
    is a FileNotFoundError saying which file."""
    from ..model import ECEModel

    if name not in MODELS:
        raise ValueError(
            f"no pretrained model {name!r}; ecekern ships {sorted(MODELS)}"
        )
    ref = resources.files(__name__).joinpath(MODELS[name][0])
    if not ref.is_file():
        raise FileNotFoundError(
            f"the weights of {name!r} ({ref}) are not in this installation of "
            "ecekern; reinstall it from the repository"
        )
    with resources.as_file(ref) as path:
        model = ECEModel.load(path)
    if dtype is not None:
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or float64, got {dtype}")
        model.to(dtype)
    if device is not None:
        model.to(torch.device(device))
    return model.eval()
