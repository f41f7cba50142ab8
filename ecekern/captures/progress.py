"""Chapter 1's capture: the book's cumulative progress table in one run
(``progress``), and Nsight Compute on the reference's 512-atom force step (``ncu``);
both run by default. The reference's own measurements are settled:
``book/history/01_reference/reference_capture.md``.

At 512 and 4096 atoms (``diamond(4)``, ``diamond(8)``), strict fp32 and fp32 + TF32,
each row's force step replayed as a CUDA graph (chapter 4, the library's MD path)
and eager (:data:`~ecekern.captures.schema.MODES`): the reference; each chapter's
switch on top of every earlier one's (:data:`CHAPTER_SWITCHES`; chapter 4's is the
replay itself); chapter 6's stacks at each precision (:data:`CH6_STACKS`,
alternatives, not steps); ``library defaults`` (``options.use()``); the peers
(e3nn's and cuEquivariance's convolutions, replayed through
:func:`ecekern.peers.graphed_force_step`; a peer that cannot be built or captured
says why in the manifest); and, while the time budget lasts, the reference and the
defaults under ``torch.compile`` (one compile per box and precision, both modes).

Each row (step schema, :mod:`.schema`, ``plan`` the step plan the options resolved
to) has ``flop``, the FLOP per force step, and its ``flop_source``: ours
:func:`ecekern.flops.step_flops`, a peer's counted op by op in one eager step
(:func:`ecekern.flops.counted_flops`; cuEquivariance's kernels are invisible to the
counter, so it takes e3nn's count: the same tensor products). ``progress.csv`` is
rewritten after every row, in the table's order; ``stages.csv`` holds the largest
box's forward and backward time by stage, reference and defaults (:mod:`.stages`).
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from pathlib import Path

import torch

from .. import ECEConfig, bench, linear, options
from ..flops import counted_flops, step_flops
from ..model import force_step, unwrap
from ..peers import CueqConvModel, E3nnConvModel
from . import common, progress_order, schema
from .common import compile_model, for_boxes, force_row, free, step_error, switched
from .schema import MODES
from .stages import stage_rows

__all__ = ["OURS", "PARTS", "PEERS", "capture", "peer_models"]

#: Each chapter's switches, in order: a row runs with its own and every earlier one's.
CHAPTER_SWITCHES = (
    ("+ ch2 linear", dict(linear="auto", edge_frame="reference", zonal="reference",
                          stack="linears", memory="plain")),
    ("+ ch3 edge_frame", dict(edge_frame="packed")),
    ("+ ch4 graph_step", {}),  # the replay itself: eager, the same as + ch3
    ("+ ch5 zonal", dict(zonal="fused")),
    ("+ ch6 cohorts", dict(memory="keep")),
)  # fmt: skip
#: Chapter 6's stack by the layer kernels, each precision on top of every chapter.
CH6_STACKS = (
    ("+ ch6 fused strict fp32 stack", dict(stack="fused", precision="fp32")),
    ("+ ch6 3xTF32 stack", dict(stack="layers", precision="3xtf32")),
    ("+ ch6 fused 3xTF32 stack", dict(stack="fused", precision="3xtf32")),
    ("+ ch6 TF32 stack", dict(stack="layers", precision="tf32")),
    ("+ ch6 fused TF32 stack", dict(stack="fused", precision="tf32")),
    ("+ ch6 bf16 stack", dict(stack="layers", precision="bf16")),
    ("+ ch6 fused bf16 stack", dict(stack="fused", precision="bf16")),
)
#: Our rows: label -> the options they run under (``{}``: the library's defaults);
#: a chapter's row runs under the union of its switches and every earlier chapter's
#: (a later switch overrides an earlier one).
_CHAPTERS = dict(zip(
    (label for label, _ in CHAPTER_SWITCHES),
    itertools.accumulate((s for _, s in CHAPTER_SWITCHES), lambda a, b: {**a, **b}),
))  # fmt: skip
OURS = {
    "reference": {"reference": True},
    **_CHAPTERS,
    **{label: {**_CHAPTERS["+ ch6 cohorts"], **stack} for label, stack in CH6_STACKS},
    # chapter 7: the fused geometry and radial stages on chapter 6's default stack
    "+ ch7 step": {
        **_CHAPTERS["+ ch6 cohorts"],
        **dict(CH6_STACKS)["+ ch6 3xTF32 stack"],
        "geometry": "fused",
        "radial": "fused",
    },
    "library defaults": {},
}
#: The compiled rows: label -> the options their model is compiled and run under.
COMPILED = {
    "reference + torch.compile": {"reference": True},
    "library defaults + torch.compile": {},
}
#: Seconds the part may take, compiles included, unless told otherwise.
BUDGET_S = 330.0


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
    return CueqConvModel(cfg)


#: The peers of the same width and degree, by their row label (built lazily: each
#: needs its own package).
PEERS = {"e3nn TP conv (NequIP-style)": lambda cfg, dev: E3nnConvModel(cfg),
         "cuEquivariance TP conv (NequIP-style)": _cueq}  # fmt: skip


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


def _paths(model, inputs) -> str:
    """The step plan of this model's step under the current options
    (:meth:`~ecekern.plan.StepPlan.describe`), with the EquivariantLinears' kernel
    where the stack runs them; ``""`` for a peer."""
    try:
        m = unwrap(model)
    except TypeError:
        return ""
    pos = inputs[0]
    plan = m.plan(pos.device, pos.dtype)
    text = plan.describe()
    if plan.stack == "linears" and m.config.n_gated:
        w = m.interactions[0].gated[0].weight
        n_ang, _, F = w.shape
        x = torch.empty(1, F, n_ang, device=pos.device, dtype=pos.dtype)
        p = linear.plan_of(x, w, plan.linear)
        kernel = p.path + (f"/{p.kernel}" if p.kernel else "")
        text = text.replace(f"linear={plan.linear}", f"linear={kernel}")
    return text


def _row(add, label, model, inputs, rep_ms, info, plan="", mode="eager", **extra):
    """Time one row's force step and ``add`` its row; a failure is a row with its
    error (and a line in the manifest)."""
    try:
        row = force_row(label, model, inputs, plan, mode, rep_ms, **extra)
    except Exception as exc:
        n, precision = inputs[0].shape[0], bench.dtype_label(inputs[0].dtype)
        key = f"progress: {label}, {n} atoms, {precision}, {mode}"
        info[key] = f"failed: {exc!r}"[:500]
        row = step_error(exc, label, inputs, plan, mode) | extra
    add(row)


def _peer_flop(peers, inputs, info) -> dict:
    """``{label: (flop, flop_source)}`` of each peer (module docstring)."""
    out = {}
    for label, peer in peers:
        e3nn = [v for k, v in out.items() if k.startswith("e3nn")]
        try:
            if label.startswith("cuEquivariance"):  # invisible to the counter
                if not e3nn:
                    raise LookupError("no e3nn count to take for its tensor products")
                out[label] = (e3nn[0][0], "e3nn's count (the same tensor products)")
            else:
                step = lambda: force_step(peer, *inputs)  # noqa: E731
                out[label] = (counted_flops(step), "counted")
        except Exception as exc:
            info[f"flop: {label}"] = f"failed: {exc!r}"[:300]
    return out


def capture(out: Path, boxes: list[int], budget_s: float | None = None,
            dev: str = "cuda", config=None) -> dict:  # fmt: skip
    """Write progress.csv and stages.csv (module docstring); returns the manifest's
    notes: what failed or was skipped, and the options of the defaults rows.
    ``config``: the model's ``ECEConfig`` (the book's by default). ``dev="cpu"`` is a
    smoke test (the tests': a tiny model and box, no compiles with ``budget_s=0``)."""
    t_start = time.time()
    budget = budget_s if budget_s is not None else BUDGET_S
    info: dict = {"progress_budget_s": budget}
    rows: list[dict] = []
    stages: list[dict] = []

    def add(row: dict) -> None:  # progress.csv, in the table's order after every row
        rows.append(row)
        rows.sort(key=progress_order)
        schema.write(rows, out / "progress.csv")

    cfg = config if config is not None else ECEConfig()
    info["progress_config"] = cfg.to_dict()
    defaults = options.current()
    if defaults != options.Options():
        info["library_defaults_note"] = f"the environment changed them: {defaults}"
    precisions = (False, True)

    def eager(rep, model, inputs):  # ours and the peers, both precisions and modes
        n, n_edges = inputs[0].shape[0], inputs[2].n_edges
        rep_ms = 100.0 if n <= 512 else 0.0  # at least 5 runs either way
        peers = list(peer_models(cfg, torch.float32, info, f"{n} atoms", dev))
        ours = dict(flop=step_flops(cfg, n, n_edges)["total"], flop_source="model")
        peer_flop = _peer_flop(peers, inputs, info)
        for tf32, mode in itertools.product(precisions, MODES):
            for label, opts in OURS.items():
                with switched(opts, tf32) as now:
                    if label == "library defaults":
                        info["library_defaults"] = repr(now)
                    plan = _paths(model, inputs)
                    _row(add, label, model, inputs, rep_ms, info, plan, mode, **ours)
                free()
            for label, peer in peers:
                flop = dict(zip(("flop", "flop_source"), peer_flop.get(label, ())))
                with switched({}, tf32):
                    _row(add, label, peer, inputs, rep_ms, info, "", mode, **flop)
                free()
        if rep != boxes[-1]:
            return
        for label in ("reference", "library defaults"):  # by stage, strict fp32
            with options.use(**OURS[label]):
                step = lambda: force_step(model, *inputs)
                try:
                    stages.extend(stage_rows(label, step, n, dev))
                except Exception as exc:
                    info[f"stages: {label}"] = f"failed: {exc!r}"[:500]
            bench.write_csv(stages, out / "stages.csv")
            free()

    last_compile = [90.0]  # seconds: the reference's first compile on the H200

    def compiled(rep, model, inputs):  # while the budget lasts
        n, tf32 = inputs[0].shape[0], torch.backends.cuda.matmul.allow_tf32
        flop = step_flops(cfg, n, inputs[2].n_edges)["total"]
        for label, opts in COMPILED.items():
            key = f"progress: {label}, {n} atoms, {'tf32' if tf32 else 'fp32'}"
            left = budget - (time.time() - t_start)
            if left < 1.3 * last_compile[0] + 10:
                info[key] = f"skipped: {left:.0f} s of the time budget left"
                continue
            try:
                with options.use(**opts):
                    c, last_compile[0] = compile_model(model, inputs, dev)
                    for mode in MODES:
                        _row(add, label, c, inputs, 100.0 if n <= 512 else 0.0, info,
                             _paths(model, inputs), mode, compile_s=last_compile[0],
                             flop=flop, flop_source="model")  # fmt: skip
            except Exception as exc:
                info[key] = f"failed: {exc!r}"[:500]
                add(step_error(exc, label, inputs))
            finally:
                c = None
                torch._dynamo.reset()
                free()

    for_boxes(None, eager, cfg, boxes, dev)
    for tf32 in precisions:  # strict fp32 first
        with switched({}, tf32):
            for_boxes(None, compiled, cfg, boxes, dev)
    info["progress_seconds"] = round(time.time() - t_start, 1)
    return info


def _progress(run, arg: str) -> dict:
    """progress.csv and stages.csv (:func:`capture`); ``progress=SECONDS``: its time
    budget."""
    budget = float(arg) if arg else None
    return capture(run.out, run.reps(quick=(2, 4)), budget_s=budget)


_ncu = common.ncu_part({"force_step": ("force_step", None)}, timeout=180)
PARTS = {"progress": _progress, "ncu": _ncu}
GPU_ONLY = tuple(PARTS)
