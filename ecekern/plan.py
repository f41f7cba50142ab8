"""The step plan: which implementation serves each stage, decided once.

A :class:`StepPlan` is resolved from what a force step's kernels depend on: the
device (type and compute capability), the dtype, torch's TF32 switch, the model's
shapes (L, M, C, K) and the options in force (:mod:`ecekern.options`). It names one
implementation per stage and the reason for every fallback, and it is cached: the
same inputs give the same object, so a step pays a dictionary look-up for it.

The model's forward runs the plan's stages as a straight pipeline, and every op
takes its implementation as an argument; no op reads the options. ``repr(plan)``
says what runs::

    >>> ecekern.plan_for(model, "cuda", torch.float32)
    StepPlan(cuda sm_90, float32, TF32 off)
      geometry    reference
      radial      reference
      zonal       fused
      edge_frame  packed
      stack       layers, 3xtf32
      memory      keep, cohorts of 65536 edges
      linear      auto
      fallbacks   none

Rules. ``"auto"`` resolves to the measured choice (CUDA: every validated fast path;
CPU: the reference). A stage whose fast path cannot serve (no Triton, not sm_90, a
degree or width the kernels do not take) falls back: to the reference, or from the
fused stack to the layer kernels, or from the layer kernels to the linears; each
fallback is in ``plan.fallbacks`` and is announced once (a
:class:`~ecekern.options.FallbackWarning`) by :meth:`StepPlan.announce`. Requests that
cannot be combined (the linears in 3xTF32, the layer kernels without cohorts) are a
ValueError here; requests that change nothing are announced once as a warning.

Status: resolves every stage of the model; pure Python, no device work.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import cohorts, edge_frame, edge_layer, options, zonal
from ._triton import why_not_triton
from .linear.triton_modes import MAX_N_ANG
from .step import geometry as step_geometry
from .step import radial as step_radial

__all__ = ["Shapes", "StepPlan", "plan_for", "resolve"]

log = logging.getLogger(__name__)

#: The stack implementations that run kernels inside cohorts.
KERNEL_STACKS = ("layers", "fused")

#: Why a step that ``torch.compile`` traces runs the stack as its linears with plain
#: autograd: the stack kernels give the input gradient only (a force step's), a
#: compiled backward computes every parameter gradient the graph can reach, and the
#: cohorts are a memory plan for eager autograd; inductor compiles the linears'
#: einsums and plans their memory itself. The replayed step
#: (:class:`~ecekern.GraphStep`) is the library's fast path.
COMPILED_STACK = cohorts.COMPILED


class Shapes(NamedTuple):
    """The model shapes a plan depends on: L, M, C and K (gated layers)."""

    lmax: int
    mmax: int
    channels: int
    n_gated: int
    #: the radial MLP's widths ``(n_rbf, H1, H2, O)`` (empty: the fused kernel's
    #: width checks are skipped)
    radial: tuple = ()

    @property
    def n_ang(self) -> int:
        return self.mmax + 1

    @property
    def F(self) -> int:
        return 2 * self.channels * (self.lmax + 1)

    @property
    def F_out(self) -> int:
        return self.channels * (self.lmax + 1)


@dataclass(frozen=True)
class StepPlan:
    """One resolved choice per stage (see the module docstring).

    Attributes:
        device, capability, dtype, tf32: what it was resolved for.
        precision: the stack's products: ``"fp64"``, ``"fp32"``, ``"3xtf32"``,
            ``"tf32"`` or ``"bf16"`` (what runs, after any fallback).
        zonal: ``"reference"`` or ``"fused"``.
        edge_frame: ``"reference"``, ``"table"`` or ``"packed"``.
        stack: ``"linears"``, ``"layers"`` or ``"fused"``.
        memory: ``"plain"``, ``"keep"`` or ``"recompute"``.
        cohort_edges: edges a cohort (with ``memory`` keep or recompute).
        linear: the EquivariantLinears' path (``"auto"``, ``"einsum"``,
            ``"dense"``, ``"triton"``), where the stack runs them.
        geometry: ``"reference"`` or ``"fused"`` (chapter 7; fused writes the
            packed frame tiles, so only beside ``edge_frame`` packed).
        radial: ``"reference"`` or ``"fused"`` (chapter 7), the kernel in
            ``radial_precision``.
        edge_layer: ``"off"`` or ``"triton"`` (chapter 8: rotate, stack, unrotate
            and aggregate in one kernel per edge tile, the stack in ``precision``;
            ``stack``, ``memory`` and ``edge_frame``'s two ops then idle).
        fallbacks: ``(stage, reason, what runs instead)`` for each fast path that
            could not serve.
        notes: requests that change nothing here.
        options: the options it was resolved from.
    """

    device: str
    capability: tuple | None
    dtype: torch.dtype
    tf32: bool
    precision: str
    zonal: str
    edge_frame: str
    stack: str
    memory: str
    cohort_edges: int
    linear: str
    geometry: str = "reference"
    radial: str = "reference"
    edge_layer: str = "off"
    fallbacks: tuple = ()
    notes: tuple = ()
    options: options.Options = options.Options()

    @property
    def cohorts(self) -> bool:
        """Whether the stack runs in cohorts (``memory`` keep or recompute)."""
        return self.memory != "plain"

    @property
    def kernels(self) -> str | None:
        """``"layers"`` or ``"fused"`` where the stack runs kernels, else None."""
        return self.stack if self.stack in KERNEL_STACKS else None

    @property
    def radial_precision(self) -> str:
        """The fused radial kernel's products: the stack's precision (float64 and
        strict fp32: ``"fp32"``; bf16, which the kernel lacks: ``"tf32"``)."""
        return {"fp64": "fp32", "bf16": "tf32"}.get(self.precision, self.precision)

    @property
    def planes(self) -> bool:
        """Whether the rotation hands the stack planes (the layer kernels' layout)."""
        return self.kernels is not None and self.edge_frame != "reference"

    def announce(self) -> None:
        """Say each fallback and inert request once (per process and reason)."""
        for stage, reason, to in self.fallbacks:
            options.fallback(stage, reason, to)
        for what, why in self.notes:
            options.inert(what, why)

    def __repr__(self) -> str:
        dev = self.device
        if self.capability is not None:
            dev += f" sm_{self.capability[0]}{self.capability[1]}"
        dtype = str(self.dtype).removeprefix("torch.")
        head = f"StepPlan({dev}, {dtype}, TF32 {'on' if self.tf32 else 'off'})"
        memory = self.memory
        if self.cohorts:
            memory += f", cohorts of {self.cohort_edges} edges"
        rows = [
            ("geometry", self.geometry),
            ("radial", self.radial),
            ("zonal", self.zonal),
            ("edge_frame", self.edge_frame),
            ("stack", f"{self.stack}, {self.precision}"),
            ("memory", memory),
            ("linear", self.linear if self.stack == "linears" else "(not used)"),
        ]
        if self.edge_layer != "off":
            rows.append(("edge_layer", f"{self.edge_layer}, {self.precision} (runs "
                         "the stack)"))  # fmt: skip
        falls = [f"{s}: {r} -> {t}" for s, r, t in self.fallbacks] or ["none"]
        rows += [("fallbacks", falls[0])] + [("", f) for f in falls[1:]]
        rows += [("ignored", f"{w}: {y}") for w, y in self.notes]
        return "\n".join([head, *(f"  {k:<11} {v}" for k, v in rows)])

    def derivatives(self) -> list[tuple[str, str, str, str]]:
        """``(stage, implementation, forces, training)`` per stage: what computes the
        force step's backward (``create_graph=False``: MD) and a training step's
        (forces with ``create_graph=True``, then the loss's backward through them,
        the mixed second derivative). ``"kernels"``: the stage's own kernels;
        ``"PyTorch"``: a differentiable composition of torch ops (the reference's,
        or the stack as its linears). Every fast path serves training so; none
        falls back."""

        def by(fast: bool) -> str:
            return "kernels" if fast else "PyTorch"

        linear = {"triton": "kernels", "auto": "the linears' auto path"}.get(
            self.linear, "PyTorch"
        )
        stack = linear if self.stack == "linears" else "PyTorch (the stack's linears)"
        return [
            ("geometry", self.geometry, by(self.geometry == "fused"), "PyTorch"),
            ("radial", self.radial, by(self.radial == "fused"), "PyTorch"),
            ("zonal", self.zonal, by(self.zonal == "fused"), by(self.zonal == "fused")),
            ("edge_frame", self.edge_frame, by(self.edge_frame != "reference"),
             "PyTorch"),
            ("stack", f"{self.stack}, {self.precision}",
             "kernels" if self.kernels else linear, stack),
            ("edge_layer", self.edge_layer, by(self.edge_layer != "off"),
             "PyTorch (the layer recomputed)" if self.edge_layer != "off" else "-"),
        ]  # fmt: skip

    def describe(self) -> str:
        """One line, for captures and logs: ``stack=layers,precision=3xtf32,...``."""
        return ",".join(
            f"{k}={getattr(self, k)}"
            for k in (
                "geometry",
                "radial",
                "zonal",
                "edge_frame",
                "stack",
                "precision",
                "memory",
                "linear",
                "edge_layer",
            )  # fmt: skip
        )


# --------------------------------------------------------------------------------------
# resolution
# --------------------------------------------------------------------------------------
def _native(device_type: str, dtype: torch.dtype, tf32: bool) -> str:
    """The precision of the linears (and of the reference): the dtype's, with TF32
    for float32 matmuls on CUDA when torch's switch is on."""
    if dtype == torch.float64:
        return "fp64"
    return "tf32" if device_type == "cuda" and tf32 else "fp32"


def stack_precision(precision: str) -> str:
    """The kernels' name for a precision (float64 rows run the strict path)."""
    return "fp32" if precision == "fp64" else precision


@functools.lru_cache(maxsize=256)
def resolve(device_type, capability, dtype, tf32, shapes: Shapes, opts,
            compiling: bool = False) -> StepPlan:  # fmt: skip
    """The plan for plain values (:func:`~ecekern.plan_for` gathers them): a device
    type and capability, a dtype, the TF32 switch, :class:`~ecekern.plan.Shapes`,
    :class:`~ecekern.options.Options`, and whether ``torch.compile`` is tracing the
    step (then the stack is the linears, without cohorts: ``COMPILED_STACK``).
    Cached; each new plan is logged once (logger ``ecekern.plan``, level INFO)."""
    plan = _resolve(device_type, capability, dtype, tf32, shapes, opts, compiling)
    log.info("ecekern step plan:\n%r", plan)
    return plan


def _resolve(device_type, capability, dtype, tf32, shapes: Shapes, opts,
             compiling: bool = False) -> StepPlan:  # fmt: skip
    fall: list[tuple[str, str, str]] = []
    notes: list[tuple[str, str]] = []
    native = _native(device_type, dtype, tf32)
    cuda = device_type == "cuda"
    L = shapes.lmax
    base = dict(device=device_type, capability=capability, dtype=dtype, tf32=tf32,
                options=opts)  # fmt: skip
    if opts.reference:
        for name, value in opts.changed().items():
            if name != "reference":
                notes.append((f"{name}={value!r}", "reference=True runs the einsum "
                              "reference in every stage"))  # fmt: skip
        return StepPlan(precision=native, zonal="reference", edge_frame="reference",
                        stack="linears", memory="plain",
                        cohort_edges=cohorts.COHORT_EDGES, linear="einsum",
                        notes=tuple(notes), **base)  # fmt: skip

    # zonal scatter (chapter 5)
    z = opts.zonal if opts.zonal != "auto" else ("fused" if cuda else "reference")
    if z == "fused":
        why = zonal.why_not(device_type, L)
        if why:
            fall.append(("zonal_scatter", why, "the reference path"))
            z = "reference"

    # edge frames (chapter 3)
    ef = opts.edge_frame
    if ef == "auto":
        ef = "packed" if cuda else "reference"
    if ef != "reference":
        why = edge_frame.why_not(device_type, L, dtype)
        if why:
            fall.append(("edge_frame", why, "the reference path"))
            ef = "reference"

    # the mixing stack (chapters 2 and 6): implementation, precision, memory
    precision, stack, memory = opts.precision, opts.stack, opts.memory
    if dtype == torch.float64 and precision != "auto":
        notes.append((f"precision={precision!r}", "a float64 model computes in "
                      "float64"))  # fmt: skip
        precision = "auto"
    if stack == "auto":
        wants_kernels = precision not in ("auto", native) or (
            cuda and dtype == torch.float32
        )
        stack = "layers" if wants_kernels and memory != "plain" else "linears"
    if stack in KERNEL_STACKS and memory == "plain":
        raise ValueError(
            f"stack={stack!r} runs inside cohorts: memory='plain' cannot serve it "
            "(use memory='keep' or 'recompute', or stack='linears')"
        )
    if stack == "linears" and precision not in ("auto", native) and not compiling:
        raise ValueError(
            f"precision={precision!r} with stack='linears': the EquivariantLinears "
            f"compute in {native} here ({dtype}, torch's TF32 switch "
            f"{'on' if tf32 else 'off'}); {precision!r} needs stack='layers' or "
            "'fused'"
        )
    if stack in KERNEL_STACKS:
        prec = precision if precision != "auto" else (
            "3xtf32" if dtype == torch.float32 else "fp64"
        )  # fmt: skip
        if compiling:
            fall.append((f"mixing stack [{stack}]", COMPILED_STACK,
                         f"the EquivariantLinears in {native}"))  # fmt: skip
            stack, prec = "linears", native
        if stack == "fused":
            why = cohorts.why_not("fused", stack_precision(prec), device_type,
                                  capability, dtype, shapes.F, shapes.F_out,
                                  shapes.n_ang)  # fmt: skip
            if why:
                fall.append(("mixing stack [fused]", why,
                             f"the layer kernels in {prec}"))  # fmt: skip
                stack = "layers"
        if stack == "layers":
            why = cohorts.why_not("layers", stack_precision(prec), device_type,
                                  capability, dtype, shapes.F, shapes.F_out,
                                  shapes.n_ang)  # fmt: skip
            if why:
                fall.append(("mixing stack [layers]", why, "the EquivariantLinears"))
                stack, prec = "linears", native
        precision = prec
    else:
        precision = native
    if memory == "auto":
        memory = "keep" if cuda or stack in KERNEL_STACKS else "plain"
    if compiling and memory != "plain":
        if opts.memory != "auto":
            fall.append((f"cohorts [{memory}]", COMPILED_STACK, "plain autograd"))
        memory = "plain"
    cohort_edges = opts.cohort_edges
    if cohort_edges == "auto":
        cohort_edges = cohorts.COHORT_EDGES
    elif memory == "plain":
        notes.append((f"cohort_edges={cohort_edges}", "memory='plain' runs no "
                      "cohorts"))  # fmt: skip

    # the EquivariantLinears (chapter 2), where the stack runs them
    linear = opts.linear
    if linear != "auto" and stack != "linears":
        notes.append((f"linear={linear!r}", f"stack={stack!r} runs no "
                      "EquivariantLinear"))  # fmt: skip
    if linear == "triton":
        why = why_not_triton(device_type)
        if why is None and shapes.n_ang > MAX_N_ANG:
            why = f"n_ang = {shapes.n_ang} > {MAX_N_ANG}"
        if why:
            if stack == "linears":
                fall.append(("equivariant_linear[triton]", why, "the reference path"))
            linear = "einsum"

    # the geometry and the radial stage (chapter 7)
    # "auto" is the reference for both until a GPU run validates the fused kernels
    # (their float64 and compiled paths were fixed after the last one): asked for,
    # they run
    geo = opts.geometry
    if geo == "auto":
        geo = "reference"
    if geo == "fused":
        why = step_geometry.why_not(device_type, L, shapes.mmax, dtype)
        if why is None and ef != "packed":
            why = (f"edge_frame={ef!r} reads D, which the fused geometry never forms "
                   "(it writes the packed tiles)")  # fmt: skip
        if why:
            fall.append(("geometry [fused]", why, "the reference composition"))
            geo = "reference"
    rad = opts.radial
    if rad == "auto":
        rad = "reference"
    if rad == "fused":
        rprec = {"fp64": "fp32", "bf16": "tf32"}.get(precision, precision)
        why = step_radial.why_not(device_type, dtype, shapes.radial or (8, 16, 16, 16),
                                  rprec)  # fmt: skip
        if why:
            fall.append(("radial [fused]", why, "the reference composition"))
            rad = "reference"
    # the fused edge layer (chapter 8): "auto" is off until a GPU run measures it
    el = "off" if opts.edge_layer == "auto" else opts.edge_layer
    if el == "triton":
        why = edge_layer.why_not(device_type, dtype, shapes.F)
        if why is None and compiling:
            why = "torch.compile traces the step (the layer is no torch.library op)"
        if why:
            fall.append(("edge_layer [triton]", why, "the stages apart"))
            el = "off"
    return StepPlan(precision=precision, zonal=z, edge_frame=ef, stack=stack,
                    memory=memory, cohort_edges=cohort_edges, linear=linear,
                    geometry=geo, radial=rad, edge_layer=el, fallbacks=tuple(fall),
                    notes=tuple(notes), **base)  # fmt: skip


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple | None:
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def shapes_of(config) -> Shapes:
    """The :class:`Shapes` of an :class:`~ecekern.ECEConfig`."""
    n_radial = config.lmax * config.channels + config.n_interactions * config.F
    widths = (config.n_rbf, config.radial_hidden, config.radial_hidden, n_radial)
    return Shapes(config.lmax, config.M, config.channels, config.n_gated, widths)


def plan_for(model, device=None, dtype=None, opts=None) -> StepPlan:
    """The :class:`StepPlan` of a force step of ``model`` (an
    :class:`~ecekern.ECEModel`, a ``torch.compile``d one, or an
    :class:`~ecekern.ECEConfig`) on ``device`` in ``dtype`` (default: where the
    model's parameters are), with the options in force (or ``opts``) and torch's
    TF32 switch as it is now. Cached; raises a ValueError for requests that cannot
    be combined."""
    config = getattr(model, "config", None)
    if config is None:
        inner = getattr(model, "_orig_mod", None)
        config = getattr(inner, "config", model)
    if device is None or dtype is None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError("plan_for(config, ...) needs device and dtype")
        p = next(model.parameters())
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    opts = options.current() if opts is None else opts
    if not isinstance(opts, options.Options):
        raise TypeError(f"opts must be an ecekern.options.Options, got {opts!r:.60}")
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    return resolve(device.type, _capability(device), dtype, tf32,
                   shapes_of(config), opts,
                   torch.compiler.is_compiling())  # fmt: skip


def replace(plan: StepPlan, **changes) -> StepPlan:
    """A copy of ``plan`` with some fields changed (tests and captures)."""
    return dataclasses.replace(plan, **changes)
