"""Chapter 6's capture: the mixing stack's backward in cohorts, against the plain stack.

Parts (``parts``, comma-separated), on the book's model (L = 2, C = 32), strict fp32,
every earlier chapter's fast path on (the library's defaults):

* ``stack`` -> stack.csv: the mixing stack alone (one layer's, forward + input
  backward) at the 512- and 4096-atom boxes' edge counts, plain, in cohorts
  (:data:`COHORTS`) and by the layer kernels (:data:`FUSED`): time (ms) and the
  peak memory above the inputs (MiB);
* ``steps`` -> steps.csv: the force step at 512 and 4096 atoms, plain and in cohorts
  (:data:`STEP_CASES`: keeping the pre-activations, or recomputing), eager and
  replayed as a CUDA graph (chapter 4): time and peak memory (the step-level target:
  at most 5 % slower);
* ``memory`` -> memory.csv: the force step's peak memory against the atom count,
  plain, keeping z and recomputing, up to the boxes given (``boxes="4,6,8"``:
  diamond repeats), and the largest box that ran (an out-of-memory is a row, not
  the end of the run, with what the allocator said: the request, what the tensors
  held and what was reserved but free; ``alloc_conf``: PYTORCH_CUDA_ALLOC_CONF;
  ``memory=stack``: only the cases whose label starts so);
* ``ncu`` -> ncu_layers.csv, ncu_stack.csv, ncu_recompute.csv: Nsight Compute on
  the layer kernels and on the fused stacks, forward and force backward, at each
  precision (one cohort of 65536 edges), keeping z and recomputing it on chip;
  ``ncu=layers``, ``ncu=stack`` or ``ncu=recompute`` runs one of the three.

The precision study (precision.csv, nve.csv, still read by the chapter) is retired
to ``book/history/06_cohorts/precision_capture.md``.
"""

from __future__ import annotations

import os
import re

import torch

from .. import bench, options
from .._stack_common import kernel_precision
from ..cohorts import COHORT_EDGES
from . import schema
from .common import book_config, free, ncu_part, option_steps

__all__ = ["PARTS"]
#: (label, cohort_edges, recompute) of the ``stack`` part (None: the plain stack).
COHORTS = (
    ("plain", None, None),
    ("keep z", 8192, False),
    ("keep z", 131072, False),
    ("recompute", 8192, True),
    ("recompute", 131072, True),
)


def _label(stack: str, precision: str) -> str:
    """A case's label: ``"layers <products>"`` or ``"stack <products>"`` (the
    kernels' names of the products: ``ieee``, ``tf32x3``, ``tf32``, ``bf16``)."""
    family = "stack" if stack == "fused" else "layers"
    return f"{family} {kernel_precision(precision)}"


#: The layer kernels' rows of the ``stack`` part, and the fused stacks' (one kernel
#: per tile of edges): (label, options), the layer kernels in the order strict fp32,
#: TF32, 3xTF32, bf16 and the fused stacks strict fp32, 3xTF32, TF32, bf16; they
#: skip the m = 0 sin part as the model does (``sin0_zero``).
FUSED = tuple(
    (_label(stack, p), {"stack": stack, "precision": p})
    for stack, ps in (("layers", ("fp32", "tf32", "3xtf32", "bf16")),
                      ("fused", ("fp32", "3xtf32", "tf32", "bf16")))
    for p in ps
)  # fmt: skip
#: The layer kernels recomputing z in the backward: (label, options, cohort_edges).
FUSED_RECOMPUTE = (
    "layers tf32x3 recompute",
    {"stack": "layers", "precision": "3xtf32"},
    16384,
)
#: The fused stacks whose forward writes only y and whose backward makes each tile's
#: z again on chip: (label, options).
STACK_RECOMPUTE = tuple((f"{label} recompute", o) for label, o in FUSED
                        if o["stack"] == "fused")  # fmt: skip


def _planes_copy(rows):
    """Copies of a (cos, sin) pair of ``(E, W, n_ang)`` rows as the views of one
    ``(n_ang, 2, E, W)`` planes tensor."""
    from ecekern._planes import planes_pair

    _, *pair = planes_pair(rows[0], *rows[0].shape)
    for a, b in zip(pair, rows, strict=True):
        a.copy_(b.detach())
    return list(pair)


#: What a row of stack.csv times (its ``n``: the edges).
PROBLEM = "one layer's stack, forward + input backward"


def _stack(run, arg: str) -> str:
    """stack.csv (kernel schema, with ``cohort_edges`` and ``peak_MiB``; module
    docstring)."""
    import ecekern
    from ecekern import cohorts, reference
    from ecekern.linear import equivariant_linear
    from ecekern.model import prepare_inputs

    out, reps, dev = run.out, run.reps(), run.dev
    cfg = book_config(dev, n_gated=2)
    model = ecekern.ECEModel(cfg).to(dev)
    layer = model.interactions[0]
    weights = [lin.weight for lin in layer.gated]
    biases = [lin.bias for lin in layer.gated]
    rows = []
    for rep in reps:
        *_, graph = prepare_inputs(
            ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, dev
        )
        E = graph.n_edges
        x_rows = [
            torch.randn(E, cfg.F, cfg.n_ang, device=dev, requires_grad=True)
            for _ in range(2)
        ]
        gy_rows = [torch.randn(E, layer.out.weight.shape[1], cfg.n_ang, device=dev)]
        gy_rows.append(torch.randn_like(gy_rows[0]))
        # the layer kernels get their rows as the model hands them over: planes
        # pairs (chapter 3's planes=True), the same values, no copies
        xp = [t.requires_grad_() for t in _planes_copy(x_rows)]
        gyp = _planes_copy(gy_rows)
        cases = [(*c, None) for c in COHORTS]
        cases += [(label, COHORT_EDGES, False, p) for label, p in FUSED]
        label, p, c = FUSED_RECOMPUTE
        cases.append((label, c, True, p))
        cases += [(label, COHORT_EDGES, True, p) for label, p in STACK_RECOMPUTE]
        for label, cohort, recompute, opts in cases:
            kernels, precision = (None, "fp32") if opts is None else (
                opts["stack"], opts["precision"])  # fmt: skip
            why = kernels and cohorts.why_not(
                "layers", precision, dev, None, torch.float32, cfg.F,
                layer.out.weight.shape[1], cfg.n_ang,
            )  # fmt: skip
            if why:  # the interpreter's tiny model: widths without a factor 16
                row = schema.kernel_row(label, PROBLEM, E, "float32", None, note=why)
                rows.append({**row, "cohort_edges": cohort or ""})
                schema.write(rows, out / "stack.csv", schema.KERNEL_COLUMNS)
                continue

            def fwd_bwd(cohort=cohort, recompute=recompute, kernels=kernels,
                        precision=precision):  # fmt: skip
                x, gy = (xp, gyp) if kernels else (x_rows, gy_rows)
                if cohort is None:
                    y = reference.mixing_stack(
                        *x, weights, biases, layer.out.weight, layer.out.bias,
                        equivariant_linear,
                    )  # fmt: skip
                else:
                    y = cohorts.mixing_stack(
                        *x, weights, biases, layer.out.weight, layer.out.bias,
                        equivariant_linear, cohort_edges=cohort, recompute=recompute,
                        kernels=kernels, precision=precision,
                        sin0_zero=kernels is not None,
                    )  # fmt: skip
                return torch.autograd.grad(y, x, gy)

            t = bench.time_fn(fwd_bwd) if dev == "cuda" else None
            peak = bench.peak_memory(fwd_bwd) / 2**20
            c = cohort or ""
            row = schema.kernel_row(label, PROBLEM, E, "float32", t, cohort_edges=c)
            rows.append({**row, "peak_MiB": peak})
            print(f"stack {label} {cohort} E={E}: {t.median if t else 0:.2f} ms",
                  flush=True)  # fmt: skip
            schema.write(rows, out / "stack.csv", schema.KERNEL_COLUMNS)
            free()
    return "done"


#: (label, options) cases of the ``steps`` and ``memory`` parts.
STEP_CASES = (
    ("plain", {"memory": "plain", "stack": "linears"}),
    ("keep z", {"memory": "keep", "cohort_edges": 8192, "stack": "linears"}),
    ("keep z", {"memory": "keep", "cohort_edges": 65536, "stack": "linears"}),
    ("recompute", {"memory": "recompute", "cohort_edges": 8192, "stack": "linears"}),
    *((label, {"memory": "keep", **o}) for label, o in FUSED),
    (FUSED_RECOMPUTE[0], {"memory": "recompute", **FUSED_RECOMPUTE[1],
                          "cohort_edges": FUSED_RECOMPUTE[2]}),
    *((label, {"memory": "recompute", **o}) for label, o in STACK_RECOMPUTE),
)  # fmt: skip
#: The ``memory`` part's cases, from :data:`STEP_CASES`.
MEMORY_CASES = (
    "plain",
    "keep z",
    "recompute",
    "layers tf32x3",
    FUSED_RECOMPUTE[0],
    "stack tf32x3 recompute",
)


def _steps(run, arg: str) -> str:
    """steps.csv (step schema, with ``cohort_edges``): every case of
    :data:`STEP_CASES`, eager and replayed."""
    cases = [(label, kw, {"cohort_edges": kw.get("cohort_edges", "")})
             for label, kw in STEP_CASES]  # fmt: skip
    cfg = book_config("cuda", n_gated=2)
    return option_steps(run, cases, "steps", cfg, modes=schema.MODES)


def _memory(run, only: str) -> dict:
    """memory.csv (module docstring); ``only``: the cases whose label starts so
    (``memory=stack``)."""
    import ecekern
    from ecekern.model import force_step, prepare_inputs

    boxes, out = run.reps(full=(4, 8, 12, 16), quick=(4, 8)), run.out
    cfg = book_config("cuda", n_gated=2)
    model = ecekern.ECEModel(cfg).to("cuda")
    rows, largest = [], {}
    cases = {label: kw for label, kw in reversed(STEP_CASES)}  # keep z: 8192
    todo = [label for label in MEMORY_CASES if label.startswith(only or "")]
    for label, kw in ((label, cases[label]) for label in todo):
        for rep in boxes:
            row = {"stack": label, "repeats": rep}
            try:
                inputs = prepare_inputs(
                    ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, "cuda"
                )
                row |= {"n_atoms": inputs[0].shape[0], "n_edges": inputs[2].n_edges}
                with options.use(**kw):
                    peak = bench.peak_memory(lambda: force_step(model, *inputs))
                row["peak_MiB"] = peak / 2**20
                largest[label] = row["n_atoms"]
            except torch.cuda.OutOfMemoryError as e:
                row["peak_MiB"] = "out of memory"
                row["oom_detail"] = _oom_detail(str(e))
            inputs = None
            free()
            alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            rows.append({**row, "alloc_conf": alloc, **bench.provenance(torch.float32)})
            print(f"memory {label} repeats={rep}: {row['peak_MiB']}",
                  flush=True)  # fmt: skip
            bench.write_csv(rows, out / "memory.csv")
            if row["peak_MiB"] == "out of memory":
                break
    return {"memory": {"largest box (atoms)": largest}}


def _oom_detail(message: str) -> str:
    """What the allocator said when it ran out: the request, what PyTorch's tensors
    held, and what it had reserved but not handed out (fragmentation)."""
    pats = (
        ("tried", r"Tried to allocate ([\d.]+ [KMG]iB)"),
        ("allocated", r"([\d.]+ [KMG]iB) is allocated by PyTorch"),
        ("reserved unallocated", r"([\d.]+ [KMG]iB) is reserved by PyTorch but"),
    )
    found = ((k, re.search(p, message)) for k, p in pats)
    return "; ".join(f"{k} {m.group(1)}" for k, m in found if m) or message[:120]


#: Nsight Compute on the layer kernels, forward and force backward, at each
#: precision (:func:`ecekern.captures.targets.cohorts_layers`), and on the fused
#: stacks, keeping z and recomputing it (``cohorts_stack``,
#: ``cohorts_stack_recompute``); ``ncu=layers``, ``stack`` or ``recompute``: one.
_ncu = ncu_part({
    "layers": ("cohorts_layers", ["-k", "regex:_layer"]),
    "stack": ("cohorts_stack", ["-k", "regex:_fused"]),
    "recompute": ("cohorts_stack_recompute", ["-k", "regex:_fused"]),
})  # fmt: skip
PARTS = {
    "stack": _stack,
    "steps": _steps,
    "memory": _memory,
    "ncu": _ncu,
}
GPU_ONLY = ("steps", "memory", "ncu")
