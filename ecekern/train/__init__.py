"""Training an :class:`~ecekern.ECEModel` on labelled structures (energies, forces
and stresses): the data (:mod:`ecekern.train.data`), the loss and the loop
(:mod:`ecekern.train.loop`), and ``python -m ecekern.train DATA --out model.pt``.

::

    from ecekern import ECEConfig, ECEModel, train
    samples = train.read("data.extxyz")
    tr, va, te = train.split(samples)
    model = train.fit(ECEModel(ECEConfig(species=(6,))), tr, va, out="model.pt")
    print(train.evaluate(model, te, by_family=True))
"""

from __future__ import annotations

import random

from .data import (
    Batch,
    Sample,
    batch_graphs,
    collate,
    fit_reference_energies,
    from_atoms,
    read,
)
from .loop import TrainConfig, evaluate, fit, init_scale, loss, predict

__all__ = [
    "Batch",
    "Sample",
    "TrainConfig",
    "batch_graphs",
    "collate",
    "evaluate",
    "fit",
    "fit_reference_energies",
    "from_atoms",
    "init_scale",
    "loss",
    "predict",
    "read",
    "split",
]


def split(samples: list[Sample], val: float = 0.1, test: float = 0.1, seed: int = 0):
    """``(train, val, test)``: by each sample's ``split`` label where every sample
    has one (``"train"``, ``"val"``, ``"test"``), else a seeded random split with
    the fractions ``val`` and ``test``."""
    if samples and all(s.split for s in samples):
        bad = {s.split for s in samples} - {"train", "val", "test"}
        if bad:
            raise ValueError(f"unknown split labels {sorted(bad)}")
        return tuple([s for s in samples if s.split == k]
                     for k in ("train", "val", "test"))  # fmt: skip
    if not (0 <= val < 1 and 0 <= test < 1 and val + test < 1):
        raise ValueError("val and test must be fractions with val + test < 1")
    order = list(samples)
    random.Random(seed).shuffle(order)
    n_val, n_test = round(val * len(order)), round(test * len(order))
    return (order[n_val + n_test :], order[:n_val], order[n_val : n_val + n_test])
