"""Which implementation each stage may use, and loud fallbacks.

One typed, frozen object, :class:`Options`, holds the requests: one field per stage
(``linear``, ``zonal``, ``edge_frame``, ``stack``, ``memory``, ``geometry``,
``radial``, ``edge_layer``), one ``precision`` axis for the mixing stack's products, and
``reference``, the one switch to the einsum reference everywhere. Every field's
default is ``"auto"`` (the measured choice: every validated fast path on CUDA, the
reference on the CPU). The options do not choose kernels themselves: the step
plan (:func:`ecekern.plan.plan_for`) reads them once per (device, dtype, TF32,
shapes, options), resolves ``"auto"``, checks what can serve, and hands each op its
implementation as an argument.

The options in force come from three layers, the later winning:

1. the defaults;
2. environment variables ``ECEKERN_<FIELD>`` (``ECEKERN_REFERENCE=1``,
   ``ECEKERN_STACK=linears``), read when a plan is made: overrides for experiments;
3. :func:`use` (a block) and :func:`set_options` (from here on), held in a
   :class:`contextvars.ContextVar`, so each thread and each asyncio task sees its
   own: a ``use`` block in one thread never changes another's kernels.

::

    with ecekern.options.use(reference=True):   # the einsum reference everywhere
        energy, forces = ecekern.energy_and_forces(model, atoms)
    with ecekern.options.use(stack="fused", precision="3xtf32"):
        ...                                      # the fused Gluon stack (sm_90)

A bad value is a ValueError (an ``ECEKERN_`` variable's names the variable, also at
import); an ``ECEKERN_`` name that nothing reads (a misspelt option) is a warning at
import. Requests that cannot be combined are errors when the plan is made; requests
that change nothing (``precision`` for a float64 model, say) warn once.

A fast path that cannot serve a call never fails silently: :func:`fallback` warns
once per reason (:class:`FallbackWarning`) and another path runs; a fast kernel that
hands a call to a slower one says so once too (:class:`SlowerKernelWarning`).
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
import os
import warnings
from dataclasses import dataclass, fields
from typing import Literal

__all__ = [
    "FallbackWarning",
    "Options",
    "SlowerKernelWarning",
    "current",
    "fallback",
    "inert",
    "reset",
    "reset_fallback_warnings",
    "set_options",
    "slower",
    "use",
]

#: The values each field takes; the first is the default.
CHOICES = {
    "precision": ("auto", "fp32", "3xtf32", "tf32", "bf16"),
    "linear": ("auto", "einsum", "dense", "triton"),
    "zonal": ("auto", "reference", "fused"),
    "edge_frame": ("auto", "reference", "table", "packed"),
    "stack": ("auto", "linears", "layers", "fused"),
    "memory": ("auto", "plain", "keep", "recompute"),
    "geometry": ("auto", "reference", "fused"),
    "radial": ("auto", "reference", "fused"),
    "edge_layer": ("auto", "off", "triton"),
}


@dataclass(frozen=True)
class Options:
    """The requested implementation of each stage; ``"auto"`` everywhere by default.

    Attributes:
        reference: the einsum reference in every stage (the other fields must then
            be ``"auto"``, else a warning says they are ignored).
        precision: the mixing stack's products for float32 models: ``"fp32"``
            (strict, FMA units), ``"3xtf32"`` (fp32-accurate tensor cores),
            ``"tf32"`` or ``"bf16"`` (fast, less accurate: chapter 6's precision
            study). ``"auto"``: ``"3xtf32"`` where the stack runs kernels (CUDA),
            what the linears do elsewhere. Float64 models compute in float64.
        linear: the EquivariantLinears (chapter 2), where the stack runs them:
            ``"einsum"``, ``"dense"`` (block-diagonal GEMM), ``"triton"`` (per-mode
            kernels), ``"auto"`` (chapter 2's measured choice per device, dtype and
            TF32).
        zonal: the initial embedding's zonal scatter (chapter 5): ``"reference"``
            or ``"fused"``; ``"auto"``: fused on CUDA.
        edge_frame: rotate/select and unrotate + aggregate (chapter 3):
            ``"reference"``, ``"table"`` (kernels reading D through tables) or
            ``"packed"`` (kernels reading tiles packed once per step); ``"auto"``:
            packed on CUDA.
        stack: the mixing stack's implementation (chapter 6): ``"linears"`` (the
            EquivariantLinears and the gates in PyTorch), ``"layers"`` (one Triton
            kernel per layer, gate and residual in its epilogue) or ``"fused"``
            (the whole stack in one Gluon kernel per tile of edges, sm_90 and the
            book's widths; elsewhere the layer kernels, loudly); ``"auto"``:
            layers for float32 on CUDA, linears elsewhere.
        memory: the stack's memory strategy (chapter 6): ``"plain"`` (autograd
            keeps every activation), ``"keep"`` (the backward in cohorts of
            edges from the kept pre-activations) or ``"recompute"`` (only the
            input kept; the backward recomputes, for the largest systems, with
            ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` set before CUDA
            starts); ``"auto"``: keep on CUDA or with kernels, plain elsewhere.
        cohort_edges: edges a cohort (a positive int), or ``"auto"``
            (:data:`ecekern.cohorts.COHORT_EDGES`).
        geometry: edge vectors, lengths, envelope and the packed frame tiles
            (chapter 7): ``"reference"`` (PyTorch, D formed) or ``"fused"`` (one
            kernel per edge tile, D never formed; needs ``edge_frame`` packed);
            ``"auto"``: the reference (the fused kernels await their GPU
            validation).
        radial: the radial basis and MLP (chapter 7): ``"reference"`` or
            ``"fused"`` (one kernel per edge tile, in the stack's precision where
            the kernel has it); ``"auto"``: the reference (as ``geometry``).
        edge_layer: rotate, stack, unrotate and aggregate of each interaction layer
            in one kernel per edge tile (chapter 8): ``"off"`` (the stages apart)
            or ``"triton"`` (the Triton kernels, forward and force backward; the
            stack in ``precision``); ``"auto"``: off (not yet measured on a GPU).
    """

    reference: bool = False
    precision: Literal["auto", "fp32", "3xtf32", "tf32", "bf16"] = "auto"
    linear: Literal["auto", "einsum", "dense", "triton"] = "auto"
    zonal: Literal["auto", "reference", "fused"] = "auto"
    edge_frame: Literal["auto", "reference", "table", "packed"] = "auto"
    stack: Literal["auto", "linears", "layers", "fused"] = "auto"
    memory: Literal["auto", "plain", "keep", "recompute"] = "auto"
    cohort_edges: int | Literal["auto"] = "auto"
    geometry: Literal["auto", "reference", "fused"] = "auto"
    radial: Literal["auto", "reference", "fused"] = "auto"
    edge_layer: Literal["auto", "off", "triton"] = "auto"

    def __post_init__(self):
        if not isinstance(self.reference, bool):
            raise TypeError(f"option reference must be a bool, got {self.reference!r}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        c = self.cohort_edges
        if c != "auto":
            if isinstance(c, bool) or not isinstance(c, numbers.Integral):
                raise TypeError(
                    f"cohort_edges must be a positive int or 'auto', got {c!r}"
                )
            if c < 1:
                raise ValueError(
                    f"cohort_edges must be a positive int or 'auto', got {c!r}"
                )
            object.__setattr__(self, "cohort_edges", int(c))  # np.int64 and the like

    def changed(self) -> dict:
        """The fields that differ from the defaults."""
        base = Options()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        }


# --------------------------------------------------------------------------------------
# environment overrides
# --------------------------------------------------------------------------------------
def _parse(name: str, field: str, text: str):
    t = text.strip()
    if field == "reference":
        low = t.lower()
        if low in ("1", "true", "on", "yes"):
            return True
        if low in ("0", "false", "off", "no", ""):
            return False
        raise ValueError(f"environment variable {name}={text!r} is not a boolean")
    if field == "cohort_edges" and t.lower() != "auto":
        try:
            return int(t)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={text!r} is not an integer or 'auto'"
            ) from None
    return t.lower() if t.lower() == "auto" else t


def _environment(environ) -> dict:
    """The options that ``ECEKERN_<FIELD>`` variables set (validated)."""
    changes = {}
    for f in fields(Options):
        name = "ECEKERN_" + f.name.upper()
        if name in environ:
            changes[f.name] = _parse(name, f.name, environ[name])
    try:
        Options(**changes)
    except (TypeError, ValueError) as exc:
        names = ", ".join(f"ECEKERN_{k.upper()}" for k in changes)
        raise ValueError(f"environment variable(s) {names}: {exc}") from None
    return changes


#: ECEKERN_ variables read elsewhere: the captures' provenance and folder, and the
#: ops' registration (ecekern._autograd).
_OTHER_VARIABLES = ("COMMIT", "CAPTURES", "OP")


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
_environment(os.environ)  # a bad value is an error at import

_ENV_NAMES = tuple("ECEKERN_" + f.name.upper() for f in fields(Options))
_env_cache: tuple = ((), {})


def _env_changes() -> dict:
    """The environment's options now (parsed again only when a variable changed)."""
    global _env_cache
    key = tuple((n, os.environ[n]) for n in _ENV_NAMES if n in os.environ)
    if key != _env_cache[0]:
        _env_cache = (key, _environment(dict(key)))
    return _env_cache[1]


# --------------------------------------------------------------------------------------
# the options in force: per thread and task
# --------------------------------------------------------------------------------------
#: The changes made by use() / set_options() in this context, over the environment.
_changes: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "ecekern_options", default=None
)


def current() -> Options:
    """The options in force in this thread or task: the defaults, then the
    ``ECEKERN_`` environment, then :func:`use` and :func:`set_options`."""
    env, mine = _env_changes(), _changes.get() or {}
    if not env and not mine:
        return _DEFAULT
    return Options(**{**env, **mine})


_DEFAULT = Options()


def set_options(**changes) -> Options:
    """Change the options of this thread or task from here on (a notebook's top
    level); returns the previous value. Other threads are not affected."""
    previous = current()
    Options(**{**previous.changed(), **changes})  # validate before setting
    _changes.set({**(_changes.get() or {}), **changes})
    return previous


def reset() -> None:
    """Drop this thread's (or task's) :func:`set_options` changes: back to the
    defaults and the environment."""
    _changes.set(None)


@contextlib.contextmanager
def use(**changes):
    """Run a block with some options changed, in this thread or task only; yields
    the options in force inside. Fields: see :class:`Options`."""
    Options(**{**current().changed(), **changes})  # validate before entering
    token = _changes.set({**(_changes.get() or {}), **changes})
    try:
        yield current()
    finally:
        _changes.reset(token)


# --------------------------------------------------------------------------------------
# loud fallbacks
# --------------------------------------------------------------------------------------
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


def inert(what: str, why: str) -> None:
    """Announce, once per ``(what, why)``, that a requested option changes
    nothing here."""
    _once(f"inert {what}: {why}", f"ecekern: {what} ignored: {why}", UserWarning)


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were announced (tests use this)."""
    _warned.clear()
