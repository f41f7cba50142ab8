"""Chapter 6's capture: the mixing stack's backward in cohorts, against the plain stack.

Parts (``parts``, comma-separated), on the book's model (L = 2, C = 32), strict fp32,
every earlier chapter's fast path on (the library's defaults):

* ``steps`` -> steps.csv: the force step at 512 and 4096 atoms, plain and in cohorts
  (:data:`STEP_CASES`: keeping the pre-activations, or recomputing), eager and
  replayed as a CUDA graph (chapter 4): time and peak memory (the step-level target:
  at most 5 % slower);
* ``ncu`` -> ncu_layers.csv, ncu_stack.csv, ncu_recompute.csv: Nsight Compute on
  the layer kernels and on the fused stacks, forward and force backward, at each
  precision (one cohort of 65536 edges), keeping z and recomputing it on chip;
  ``ncu=layers``, ``ncu=stack`` or ``ncu=recompute`` runs one of the three.
"""

from __future__ import annotations

from .._stack_common import kernel_precision
from . import schema
from .common import book_config, ncu_part, option_steps

__all__ = ["PARTS"]


#: The stack kernels' cases, (label, options): the layer kernels in the order strict
#: fp32, TF32, 3xTF32, bf16, then the fused stacks (one kernel per tile of edges)
#: strict fp32, 3xTF32, TF32, bf16; labelled ``"layers <products>"`` or ``"stack
#: <products>"`` (the kernels' names of the products: ``ieee``, ``tf32x3``, ``tf32``,
#: ``bf16``).
FUSED = tuple(
    (f"{family} {kernel_precision(p)}", {"stack": stack, "precision": p})
    for stack, family, ps in (("layers", "layers", ("fp32", "tf32", "3xtf32", "bf16")),
                              ("fused", "stack", ("fp32", "3xtf32", "tf32", "bf16")))
    for p in ps
)  # fmt: skip
#: (label, options) cases of the ``steps`` part: the plain stack, then in cohorts
#: the linears, the cases of :data:`FUSED` keeping z, the layer kernels recomputing
#: z in the backward, and the fused stacks whose forward writes only y and whose
#: backward makes each tile's z again on chip.
STEP_CASES = (
    ("plain", {"memory": "plain", "stack": "linears"}),
    ("keep z", {"memory": "keep", "cohort_edges": 8192, "stack": "linears"}),
    ("keep z", {"memory": "keep", "cohort_edges": 65536, "stack": "linears"}),
    ("recompute", {"memory": "recompute", "cohort_edges": 8192, "stack": "linears"}),
    *((label, {"memory": "keep", **o}) for label, o in FUSED),
    ("layers tf32x3 recompute", {"memory": "recompute", "stack": "layers",
                                 "precision": "3xtf32", "cohort_edges": 16384}),
    *((f"{label} recompute", {"memory": "recompute", **o}) for label, o in FUSED
      if o["stack"] == "fused"),
)  # fmt: skip


def _steps(run, arg: str) -> str:
    """steps.csv (step schema, with ``cohort_edges``): every case of
    :data:`STEP_CASES`, eager and replayed."""
    cases = [(label, kw, {"cohort_edges": kw.get("cohort_edges", "")})
             for label, kw in STEP_CASES]  # fmt: skip
    cfg = book_config("cuda", n_gated=2)
    return option_steps(run, cases, "steps", cfg, modes=schema.MODES)


#: The ``ncu`` part (module docstring): programs of :mod:`.targets`.
_ncu = ncu_part({
    "layers": ("cohorts_layers", ["-k", "regex:_layer"]),
    "stack": ("cohorts_stack", ["-k", "regex:_fused"]),
    "recompute": ("cohorts_stack_recompute", ["-k", "regex:_fused"]),
})  # fmt: skip
PARTS = {"steps": _steps, "ncu": _ncu}
GPU_ONLY = tuple(PARTS)
