"""Switches for the fast paths, and loud fallbacks.

One typed object, :class:`Options`, says which optimisation each stage uses. The
process-wide value comes from the defaults below, overridden by environment variables
``ECEKERN_<FIELD>`` (for experiments: ``ECEKERN_FUSED_SCATTER=1``), and can be changed
for a block of code with :func:`use`::

    with ecekern.options.use(linear="dense"):
        energy, forces = ecekern.energy_and_forces(model, atoms)

A fast path that cannot serve a call (unsupported device, dtype, shape, or not built
yet) never fails silently: :func:`fallback` warns once per reason and the reference
path runs instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from dataclasses import dataclass, fields

__all__ = ["FallbackWarning", "Options", "current", "fallback", "set_options", "use"]

LINEAR_PATHS = ("auto", "einsum", "dense", "triton")


@dataclass(frozen=True)
class Options:
    """Which implementation each stage of the model uses.

    Attributes:
        linear: EquivariantLinear path (chapter 2): ``"auto"``, ``"einsum"``,
            ``"dense"`` or ``"triton"``.
        packed_d: fused edge-frame kernels reading pre-packed D (chapter 3).
        sync_free_unpack: integer-index unpack, no host syncs (chapter 4).
        fused_scatter: the fused zonal scatter for the GIE (chapter 5).
        edge_cohorts: cohort-wise backward of the mixing stack (chapter 6).
        interpret: run Triton kernels in Triton's CPU interpreter for CPU tensors.
    """

    linear: str = "einsum"
    packed_d: bool = False
    sync_free_unpack: bool = False
    fused_scatter: bool = False
    edge_cohorts: bool = False
    interpret: bool = False

    def __post_init__(self):
        if self.linear not in LINEAR_PATHS:
            raise ValueError(
                f"linear must be one of {LINEAR_PATHS}, got {self.linear!r}"
            )
        for f in fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"option {f.name} must be a bool")


def _parse_bool(name: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "on", "yes"):
        return True
    if t in ("0", "false", "off", "no", ""):
        return False
    raise ValueError(f"environment variable {name}={text!r} is not a boolean")


def _from_environment(base: Options) -> Options:
    changes = {}
    for f in fields(Options):
        name = "ECEKERN_" + f.name.upper()
        if name in os.environ:
            raw = os.environ[name]
            changes[f.name] = (
                raw.strip() if f.name == "linear" else _parse_bool(name, raw)
            )
    return dataclasses.replace(base, **changes)


_current = _from_environment(Options())


def current() -> Options:
    """The options in force now."""
    return _current


def set_options(**changes) -> Options:
    """Change the process-wide options; returns the previous value."""
    global _current
    previous = _current
    _current = dataclasses.replace(_current, **changes)
    return previous


@contextlib.contextmanager
def use(**changes):
    """Run a block of code with some options changed."""
    global _current
    previous = set_options(**changes)
    try:
        yield _current
    finally:
        _current = previous


class FallbackWarning(UserWarning):
    """A fast path could not serve a call and the reference path ran instead."""


_warned: set[str] = set()


def fallback(op: str, reason: str) -> None:
    """Announce, once per ``(op, reason)``, that ``op`` falls back to the reference."""
    key = f"{op}: {reason}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"ecekern: {op} falls back to the reference path ({reason})",
            FallbackWarning,
            stacklevel=3,
        )


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were announced (tests use this)."""
    _warned.clear()
