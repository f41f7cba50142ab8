"""Saving and loading an :class:`~ecekern.ECEModel`: checkpoints and state dicts.

A checkpoint (:meth:`ECEModel.save <ecekern.ECEModel.save>`) is one
``torch.save`` file of plain containers, read back with ``torch.load(...,
weights_only=True)`` (no code runs on load)::

    {"format": "ecekern.ECEModel", "version": FORMAT_VERSION,
     "config": ECEConfig.to_dict(), "dtype": "float32" | "float64",
     "state_dict": model.state_dict() (tensors on the CPU), "metadata": {...}}

The model's ``state_dict()`` carries its config too, under ``"_extra_state"``
(``nn.Module.get_extra_state``): ``load_state_dict`` of a state dict from a model of
another config raises a ValueError naming the fields that differ, before any
parameter is copied. ``seed`` is left out of the comparison (it only draws the
initial parameters, which the state dict replaces). A state dict without the entry
(written before configs were stored) loads as before, by the shapes alone, with a
:class:`UserWarning`.
"""

from __future__ import annotations

import math
import os
import pickle
import warnings
from pathlib import Path

import torch

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Persistent",
    "config_differences",
    "load",
    "save",
]

#: The ``"format"`` entry of every ecekern checkpoint.
FORMAT = "ecekern.ECEModel"
#: The checkpoint layout this version writes and reads.
FORMAT_VERSION = 1
#: The parameters' dtypes a checkpoint may hold, by name.
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def config_differences(saved: dict, config) -> list[str]:
    """``"name saved (checkpoint) vs current (model)"`` for every field of the
    ``ECEConfig`` ``config`` that the config dict ``saved`` sets otherwise (floats to
    a relative 1e-9; ``seed`` is never compared; fields ``saved`` lacks take their
    defaults). An unknown field is a ValueError."""
    from .model import ECEConfig

    other = ECEConfig.from_dict(saved)
    out = []
    for name, mine in config.to_dict().items():
        theirs = getattr(other, name)
        if name == "seed":
            continue
        if isinstance(mine, float) and isinstance(theirs, float):
            same = math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=0.0)
        else:
            same = mine == theirs
        if not same:
            out.append(f"{name} {theirs!r} (checkpoint) vs {mine!r} (model)")
    return out


def check_state(model, state) -> None:
    """The ``"_extra_state"`` of a state dict against ``model.config``."""
    if not (isinstance(state, dict) and isinstance(state.get("config"), dict)):
        raise ValueError(
            f"the state dict's _extra_state is not an ecekern config ({state!r:.80})"
        )
    diff = config_differences(state["config"], model.config)
    if diff:
        raise ValueError(
            "config differs: " + "; ".join(diff) + ". Build the model with the "
            "checkpoint's config (ECEModel.load reads it from a checkpoint file)"
        )


def warn_no_config(prefix: str) -> None:
    warnings.warn(
        f"the state dict has no {prefix}_extra_state (the ecekern config of the model "
        "that saved it): it was loaded by the tensors' shapes alone, so a model of "
        "another species order, cutoff or avg_num_neighbors would go unnoticed; save "
        "it again to store the config",
        UserWarning,
        stacklevel=5,
    )


def _check_plain(obj, where: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"metadata keys must be str or int, got {k!r} {where}")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(
            f"metadata{where} is a {type(obj).__name__!r} object: a checkpoint holds "
            "only dicts, lists, tuples, str, int, float, bool, None and tensors (what "
            "torch.load(weights_only=True) reads back)"
        )


def save(model, path, metadata: dict | None = None) -> None:
    """Write ``model`` (an ECEModel) to ``path`` (module docstring);
    ``metadata``: a dict of plain values (None: ``model.metadata``)."""
    metadata = model.metadata if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    _check_plain(metadata, "")
    dtype = next(model.parameters()).dtype
    name = {v: k for k, v in _DTYPES.items()}.get(dtype)
    if name is None:
        raise TypeError(
            f"the model is {dtype}; a checkpoint holds float32 or float64 models: "
            "call model.float() or model.double() first"
        )
    state = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
             for k, v in model.state_dict().items()}  # fmt: skip
    write_whole(
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "config": model.config.to_dict(),
            "dtype": name,
            "state_dict": state,
            "metadata": metadata,
        },
        path,
    )


def write_whole(obj, path) -> None:
    """``torch.save(obj, path)``, written to ``path.part`` and renamed: a process
    killed while writing (a time limit, a lost machine) leaves the previous file
    whole. A file object is written directly."""
    if not isinstance(path, str | os.PathLike):
        torch.save(obj, path)
        return
    torch.save(obj, f"{os.fspath(path)}.part")
    os.replace(f"{os.fspath(path)}.part", path)


def load(cls, path, map_location=None):
    """The ``cls`` (ECEModel) saved at ``path``, on ``map_location`` (None: the
    CPU), in the saved dtype, with ``metadata`` restored."""
    name = str(path) if isinstance(path, (str, Path)) else type(path).__name__
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        raise ValueError(
            f"{name} is not an ecekern checkpoint (torch.load(weights_only=True) "
            f"failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}); "
            "write one with ECEModel.save"
        ) from err
    if not (isinstance(data, dict) and data.get("format") == FORMAT):
        hint = (
            " (it looks like a bare state_dict: ECEModel(config).load_state_dict(...) "
            "reads it)"
            if isinstance(data, dict)
            and any(isinstance(v, torch.Tensor) for v in data.values())  # fmt: skip
            else ""
        )
        raise ValueError(
            f"{name} is not an ecekern checkpoint (no format {FORMAT!r} entry){hint}; "
            "write one with ECEModel.save"
        )
    version = data.get("version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{name} is an ecekern checkpoint of format version {version!r}; this "
            f"ecekern reads version {FORMAT_VERSION} (use the ecekern that wrote it)"
        )
    missing = {"config", "dtype", "state_dict"} - set(data)
    if missing or data["dtype"] not in _DTYPES:
        raise ValueError(
            f"{name} is a damaged ecekern checkpoint (missing {sorted(missing)} or "
            f"an unknown dtype {data.get('dtype')!r})"
        )
    from .model import ECEConfig

    model = cls(ECEConfig.from_dict(data["config"])).to(_DTYPES[data["dtype"]])
    model.load_state_dict(data["state_dict"])
    model.metadata = dict(data.get("metadata") or {})
    if map_location is not None:
        model.to(torch.device(map_location))
    return model


class Persistent:
    """What :class:`~ecekern.ECEModel` inherits for its files: :meth:`save`,
    :meth:`load`, the ``metadata`` dict and the config in its state dict."""

    @property
    def metadata(self) -> dict:
        """Plain values saved with the model (metrics, provenance): :meth:`save`
        writes them, :meth:`load` restores them; ``{}`` until set."""
        return self.__dict__.setdefault("_metadata", {})

    @metadata.setter
    def metadata(self, value: dict) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"metadata must be a dict, got {type(value).__name__}")
        self.__dict__["_metadata"] = value

    def save(self, path, metadata: dict | None = None) -> None:
        """Write a checkpoint to ``path`` (a file name or a file object; the module
        docstring). ``metadata``: a dict of plain values (str, numbers, lists,
        dicts, tensors) to store with it; None: ``self.metadata``."""
        save(self, path, metadata)

    @classmethod
    def load(cls, path, map_location=None):
        """The model saved at ``path`` by :meth:`save`: its config, its dtype, its
        parameters and ``metadata``, on ``map_location`` (None: the CPU). A file that
        is not an ecekern checkpoint, or of an unknown format version, is a
        ValueError."""
        return load(cls, path, map_location)

    def get_extra_state(self) -> dict:
        """``{"config": config.to_dict()}``, under ``"_extra_state"`` in the state
        dict."""
        return {"config": self.config.to_dict()}

    def set_extra_state(self, state) -> None:
        """A ValueError naming the fields where ``state``'s config differs."""
        check_state(self, state)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "_extra_state"
        if key in state_dict:  # before any parameter is copied
            check_state(self, state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args)
        if key not in state_dict:  # older state dicts: by shapes, with a warning
            missing = args[2]  # (local_metadata, strict, missing_keys, ...)
            if key in missing:
                missing.remove(key)
            warn_no_config(prefix)
