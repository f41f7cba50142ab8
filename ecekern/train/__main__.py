"""``python -m ecekern.train DATA [DATA ...] --out model.pt [options]``.

Reads the labelled structures (any ASE-readable file: extxyz with energy, forces and
stress), splits them (by ``atoms.info["split"]`` where every structure has one,
else at random), trains an :class:`~ecekern.ECEModel` (a new one from the model
options, or ``--init``'s checkpoint, whose config is kept) and writes the best EMA
model to ``--out`` with its config, the training options and the validation and
test metrics per family. ``--log`` writes one JSON line per epoch. ``--state FILE``
makes the run resumable: killed (a time limit, a lost machine), the same command
continues it from FILE and ends with the model of one uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .. import ECEConfig, ECEModel, bench
from . import TrainConfig, evaluate, fit, read, split


def _args(argv):
    p = argparse.ArgumentParser(
        prog="python -m ecekern.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("data", nargs="+", help="ASE-readable files of labelled structures")
    p.add_argument("--out", required=True, help="the checkpoint to write")
    p.add_argument("--log", help="a JSON-lines file of per-epoch metrics")
    p.add_argument("--init", help="start from this checkpoint (its config is kept)")
    p.add_argument("--state", help="the resumable training state, written each "
                   "epoch; if the file exists, training continues from it (run "
                   "the same command again)")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--val", type=float, default=0.1, help="fraction, unlabelled data")
    p.add_argument("--test", type=float, default=0.1, help="fraction, unlabelled data")
    t = TrainConfig()
    for name in ("epochs", "batch_size", "lr", "weight_decay", "warmup_steps",
                 "energy_weight", "force_weight", "stress_weight", "ema_decay",
                 "patience", "seed"):  # fmt: skip
        v = getattr(t, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(v), default=v)
    p.add_argument("--max-seconds", type=float, help="stop after the epoch past this")
    c = ECEConfig()
    for name in ("lmax", "channels", "n_interactions", "n_gated", "cutoff",
                 "avg_num_neighbors"):  # fmt: skip
        p.add_argument("--" + name.replace("_", "-"), type=type(getattr(c, name)))
    p.add_argument("--mmax", type=int)
    p.add_argument("--species", help="atomic numbers, e.g. 6 or 1,6,8 (default: "
                   "the elements of the data)")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    samples = read(a.data)
    train, val, test = split(samples, a.val, a.test, a.seed)
    if not train or not val:
        raise SystemExit("need training and validation structures: check --val")
    model_fields = ("lmax", "mmax", "channels", "n_interactions", "n_gated",
                    "cutoff", "avg_num_neighbors", "species")  # fmt: skip
    given = {k: getattr(a, k) for k in model_fields if getattr(a, k) is not None}
    if "species" in given:
        given["species"] = tuple(int(z) for z in given["species"].split(","))
    dtype = getattr(torch, a.dtype)
    if a.init:
        model = ECEModel.load(a.init)
        clash = {k: v for k, v in given.items()
                 if getattr(model.config, k) != v}  # fmt: skip
        if clash:
            raise SystemExit(
                f"--init's checkpoint has another config: {clash} vs "
                f"{ {k: getattr(model.config, k) for k in clash} }"
            )
    else:
        given.setdefault(
            "species",
            tuple(sorted({int(z) for s in samples for z in s.numbers.tolist()})),
        )
        model = ECEModel(ECEConfig(**given))
    model = model.to(device=a.device, dtype=dtype)
    names = ("epochs", "batch_size", "lr", "weight_decay", "warmup_steps",
             "energy_weight", "force_weight", "stress_weight", "ema_decay",
             "patience", "seed", "max_seconds")  # fmt: skip
    cfg = TrainConfig(**{k: getattr(a, k) for k in names})
    print(f"{len(train)} training, {len(val)} validation, {len(test)} test "
          f"structures; {model.config}", file=sys.stderr)  # fmt: skip
    best = fit(model, train, val, cfg, out=a.out, log=a.log, init=a.init is None,
               state=a.state)  # fmt: skip
    meta = dict(best.metadata)
    meta["val_metrics"] = evaluate(best, val, cfg.batch_size, by_family=True)
    if test:
        meta["test_metrics"] = evaluate(best, test, cfg.batch_size, by_family=True)
    meta["data"] = [str(d) for d in a.data]
    meta["log"] = a.log
    meta["provenance"] = {k: str(v) for k, v in bench.provenance(dtype).items()}
    best.to("cpu").save(a.out, metadata=meta)
    print(json.dumps({k: meta[k] for k in ("val_metrics", "test_metrics")
                      if k in meta}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
