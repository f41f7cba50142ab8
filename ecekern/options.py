"""Switches for the fast paths, and loud fallbacks.

On CUDA the defaults take every validated fast path; on the CPU the reference runs.
One typed object, :class:`Options`, says which implementation each stage uses. The
process-wide value comes from the defaults, overridden by environment variables
``ECEKERN_<FIELD>`` (``ECEKERN_REFERENCE=1``, ``ECEKERN_LINEAR=dense``), and can be
changed for a block of code with :func:`use`. A bad value is a ValueError naming the
variable when ``ecekern`` is imported; an ``ECEKERN_`` name that nothing reads (a
misspelt option) is a warning there; ``ECEKERN_COHORTS`` empty or ``auto`` is the
default (on for CUDA tensors)::

    with ecekern.options.use(reference=True):   # the einsum reference everywhere
        energy, forces = ecekern.energy_and_forces(model, atoms)

A fast path that cannot serve a call never fails silently: :func:`fallback` warns once
per reason (:class:`FallbackWarning`) and the reference runs instead; a fast kernel
that hands a call to a slower one says so once too (:class:`SlowerKernelWarning`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
import warnings
from dataclasses import dataclass, fields

import torch

__all__ = [
    "FallbackWarning",
    "Options",
    "SlowerKernelWarning",
    "current",
    "fallback",
    "warn_unused_cohort_options",
    "set_options",
    "slower",
    "use",
]

LINEAR_PATHS = ("auto", "einsum", "dense", "triton")
ZONAL_PATHS = ("auto", "reference", "fused")
EDGE_FRAME_PATHS = ("auto", "reference", "table", "packed")
COHORT_FUSED = (
    "auto",
    "off",
    "ieee",
    "tf32",
    "tf32x3",
    "bf16",
    "ieee-stack",
    "tf32x3-stack",
    "tf32-stack",
    "bf16-stack",
)


@dataclass(frozen=True)
class Options:
    """Which implementation each stage of the model uses.

    Attributes:
        reference: run the einsum reference in every stage, whatever the others say.
        linear: EquivariantLinear (chapter 2): ``"auto"`` (the measured choice: fast
            paths on CUDA, the einsum elsewhere), ``"einsum"``, ``"dense"`` or
            ``"triton"``.
        zonal: the geometric initial embedding's zonal scatter (chapter 5):
            ``"auto"`` (fused on CUDA, the reference elsewhere), ``"reference"`` or
            ``"fused"`` (on the CPU through Triton's interpreter).
        edge_frame: rotate/select, unrotate and the aggregation (chapter 3):
            ``"auto"`` (``"packed"`` on CUDA, the reference elsewhere),
            ``"reference"``, ``"table"`` (the kernels reading D through the (l, m)
            tables) or ``"packed"`` (reading the tiles packed once per step).
        cohorts: the mixing stack in cohorts of edges (chapter 6,
            :func:`ecekern.cohorts.mixing_stack`): its backward keeps the stack's
            pre-activations instead of every activation. None (auto): on for CUDA
            tensors, where it was measured (a third less peak memory at 4096 atoms,
            the step no slower); True or False everywhere.
        cohort_edges: the cohort size (edges) when ``cohorts`` is on, a positive int.
        cohort_recompute: with ``cohorts``, recompute the stack's forward in the
            backward (the least memory: chapter 6; with a fused stack its
            forward writes only y and one backward kernel makes each tile's z
            again on chip); False keeps the pre-activations, and a force step's
            backward runs no linear twice.
            Either way the model keeps none of the stack's input: a backward that
            reads it makes it again by the rotation. For the largest systems, also
            set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before CUDA
            starts (the caching allocator's free blocks then hold the largest
            tensors).
        cohort_fused: with ``cohorts``, the stack's forward and force backward by
            the layer kernels (:func:`ecekern.cohorts.layers.stack_forward`,
            :func:`~ecekern.cohorts.layers.stack_backward`; with
            ``cohort_recompute``,
            :func:`~ecekern.cohorts.layers.stack_recompute_backward`) at a
            precision: ``"ieee"`` (strict fp32), ``"tf32x3"`` (fp32-accurate tensor
            cores), ``"tf32"`` or ``"bf16"``, or ``"ieee-stack"``,
            ``"tf32x3-stack"``, ``"tf32-stack"``, ``"bf16-stack"``: the whole stack
            in one kernel per tile of edges (:mod:`ecekern.cohorts.fused`, at that
            precision; where it cannot serve, the layer kernels at that precision,
            with a warning); ``"off"`` runs the
            EquivariantLinears; ``"auto"`` (the default) is ``"tf32x3"`` for
            float32 on CUDA (chapter 6: fp32-accurate, and the fastest
            fp32-accurate stack) and ``"off"`` otherwise.
    """

    reference: bool = False
    linear: str = "auto"
    zonal: str = "auto"
    edge_frame: str = "auto"
    cohorts: bool | None = None
    cohort_edges: int = 65536
    cohort_recompute: bool = False
    cohort_fused: str = "auto"

    def __post_init__(self):
        for name in ("reference", "cohorts", "cohort_recompute"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (
                name == "cohorts" and value is None
            ):
                raise TypeError(f"option {name} must be a bool, got {value!r}")
        c = self.cohort_edges
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise TypeError(f"cohort_edges must be a positive int, got {c!r}")
        if c < 1:
            raise ValueError(f"cohort_edges must be a positive int, got {c!r}")
        object.__setattr__(self, "cohort_edges", int(c))  # np.int64 and the like
        if self.cohort_fused not in COHORT_FUSED:
            raise ValueError(
                f"cohort_fused must be one of {COHORT_FUSED}, got {self.cohort_fused!r}"
            )
        if self.linear not in LINEAR_PATHS:
            raise ValueError(
                f"linear must be one of {LINEAR_PATHS}, got {self.linear!r}"
            )
        if self.zonal not in ZONAL_PATHS:
            raise ValueError(f"zonal must be one of {ZONAL_PATHS}, got {self.zonal!r}")
        if self.edge_frame not in EDGE_FRAME_PATHS:
            raise ValueError(
                f"edge_frame must be one of {EDGE_FRAME_PATHS}, got {self.edge_frame!r}"
            )


def _parse_bool(name: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "on", "yes"):
        return True
    if t in ("0", "false", "off", "no", ""):
        return False
    raise ValueError(f"environment variable {name}={text!r} is not a boolean")


def _parse_int(name: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(
            f"environment variable {name}={text!r} is not an integer"
        ) from None


def _from_environment(base: Options) -> Options:
    changes = {}
    for f in fields(Options):
        name = "ECEKERN_" + f.name.upper()
        if name in os.environ:
            raw = os.environ[name]
            if f.type in (bool, "bool"):
                changes[f.name] = _parse_bool(name, raw)
            elif f.type in ("bool | None",):  # "auto" (or empty) or a boolean
                auto = raw.strip().lower() in ("auto", "")
                changes[f.name] = None if auto else _parse_bool(name, raw)
            elif f.type in (int, "int"):
                changes[f.name] = _parse_int(name, raw)
            else:
                changes[f.name] = raw.strip()
    try:
        return dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as exc:
        names = ", ".join(f"ECEKERN_{k.upper()}" for k in changes)
        raise ValueError(f"environment variable(s) {names}: {exc}") from None


#: ECEKERN_ variables read elsewhere: the captures' provenance and launches, and the
#: zonal op's registration.
_OTHER_VARIABLES = ("COMMIT", "CAPTURES", "CAPTURE_LINEAR", "CAPTURE_ZONAL", "ZONAL_OP")


def _unknown_variables(environ) -> list[str]:
    """``ECEKERN_*`` names in ``environ`` that nothing reads (a misspelt option)."""
    known = {f.name.upper() for f in fields(Options)} | set(_OTHER_VARIABLES)
    return sorted(k for k in environ if k.startswith("ECEKERN_") and k[8:] not in known)


_unknown = _unknown_variables(os.environ)
if _unknown:
    warnings.warn(
        f"unknown environment variable(s) {', '.join(_unknown)}"
        f" ignored; the options are ECEKERN_ + one of "
        f"{[f.name.upper() for f in fields(Options)]}",
        UserWarning,
        stacklevel=2,
    )
_current = _from_environment(Options())


def current() -> Options:
    """The options in force now."""
    return _current


def linear_path() -> str:
    """The EquivariantLinear path the options ask for (``"einsum"`` under
    ``reference``)."""
    return "einsum" if _current.reference else _current.linear


def zonal_fused(device_type: str) -> bool:
    """Whether the zonal scatter takes the fused op for tensors on ``device_type``."""
    if _current.reference:
        return False
    if _current.zonal == "auto":
        return device_type == "cuda"
    return _current.zonal == "fused"


def edge_frame_path(device_type: str) -> str:
    """``reference``, ``table`` or ``packed``: the edge-frame ops' path for tensors on
    ``device_type`` (before the kernels' own checks)."""
    if _current.reference:
        return "reference"
    if _current.edge_frame == "auto":
        return "packed" if device_type == "cuda" else "reference"
    return _current.edge_frame


def cohorts_on(device_type: str = "cuda") -> bool:
    """Whether the model's mixing stack runs in cohorts for tensors on
    ``device_type`` (never under ``reference``; ``None`` means on CUDA)."""
    if _current.reference:
        return False
    if _current.cohorts is None:
        return device_type == "cuda"
    return _current.cohorts


def warn_unused_cohort_options(device_type: str) -> None:
    """Say once that cohort options were set for a stack that runs without cohorts
    (on the CPU ``cohorts`` is off unless set): they would change nothing."""
    base, now = Options(), _current
    unused = [f"{n}={getattr(now, n)!r}" for n in ("cohort_edges", "cohort_recompute")
              if getattr(now, n) != getattr(base, n)]  # fmt: skip
    if now.cohort_fused not in ("auto", "off"):
        unused.append(f"cohort_fused={now.cohort_fused!r}")
    if unused:
        why = "reference=True" if now.reference else f"cohorts off for {device_type}"
        _once(
            f"unused cohort options {unused} {why}",
            f"ecekern: {', '.join(unused)} ignored: {why} (set cohorts=True to use "
            "them)",
            UserWarning,
        )


def cohort_precision(device_type: str, dtype) -> str | None:
    """The layer kernels' precision for a mixing stack on ``device_type`` and
    ``dtype`` rows, or None for the EquivariantLinears (``"auto"``: ``"tf32x3"``
    for float32 on CUDA)."""
    fused = _current.cohort_fused
    if fused == "auto":
        auto = device_type == "cuda" and dtype == torch.float32
        return "tf32x3" if auto else None
    return None if fused == "off" else fused


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
    """A fast path could not serve a call and another path ran instead: the
    reference, or the one the message names (the fused stack's fallback is the
    layer kernels)."""


class SlowerKernelWarning(UserWarning):
    """A fast kernel could not serve a call and a slower fast kernel ran instead."""


_warned: set[str] = set()


def _once(key: str, message: str, category) -> None:
    if key not in _warned:
        warnings.warn(message, category, stacklevel=4)
        _warned.add(key)  # after: a warning turned into an error is raised again


def fallback(op: str, reason: str, to: str = "the reference path") -> None:
    """Announce, once per ``(op, reason)``, that ``op`` falls back to ``to``."""
    _once(
        f"{op}: {reason}",
        f"ecekern: {op} falls back to {to} ({reason})",
        FallbackWarning,
    )


def slower(op: str, note: str) -> None:
    """Announce, once per ``(op, note)``, that ``op`` runs a slower kernel than its
    fastest (``note`` says which and why)."""
    _once(
        f"{op}: {note}",
        f"ecekern: {op} runs a slower kernel ({note})",
        SlowerKernelWarning,
    )


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were announced (tests use this)."""
    _warned.clear()
