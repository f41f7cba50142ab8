"""Chapter 8's capture: the fused edge layer in the whole step.

* ``steps`` -> steps.csv (step schema, replayed): the force step at 512 and 4096
  atoms (``--boxes``), chapter 6's layer kernels against ``edge_layer="triton"``
  in each precision;
* ``ncu`` -> ncu_edge_layer.csv: Nsight Compute over one force step of 512 atoms
  with the fused layer (its forward and backward kernels among the step's).
"""

from __future__ import annotations

from .. import ECEConfig
from .common import ncu_part, option_steps

__all__ = ["PARTS"]

#: The stack's precisions, the library's default first.
PRECISIONS = ("3xtf32", "tf32", "fp32", "bf16")
CASES = [
    (f"{label} {p}", {"precision": p, **opts}, {})
    for p in PRECISIONS
    for label, opts in (
        ("layer kernels", {"stack": "layers"}),
        ("edge layer", {"edge_layer": "triton"}),
    )  # fmt: skip
]


def _steps(run, arg: str) -> str:
    if run.dev == "cuda":
        return option_steps(run, CASES, "steps", modes=("replay",))
    # the smoke test: the widths the layer kernels take (multiples of 16), L = 1
    cfg = ECEConfig(lmax=1, channels=8, cutoff=2.0, radial_hidden=8,
                    readout_hidden=8)  # fmt: skip
    return option_steps(run, CASES[:2], "steps", cfg)


PARTS = {"steps": _steps, "ncu": ncu_part({"edge_layer": ("edge_layer_step", None)})}
GPU_ONLY = ("ncu",)
