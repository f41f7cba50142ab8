"""Programs for Nsight Compute: ``python -m ecekern.captures.targets NAME``.

Each runs its work a few times to warm up, then once more inside the NVTX range
``ece`` that the capture's ``ncu --nvtx --nvtx-include ece/`` selects, at the
library's own launches.
"""

from __future__ import annotations

import sys

import torch

from .. import ECEModel, options, stack_fused, stack_layers, systems
from .._planes import planes_pair
from ..model import force_step as step
from ..model import prepare_inputs
from .edge_frame import _frames, _ops, step_tensors


def _in_range(fn, warmup: int = 2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("ece")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def copy():
    # an elementwise kernel: a same-dtype copy_ is a cudaMemcpy, which ncu cannot see
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    _in_range(lambda: torch.neg(src, out=dst))


def gemm():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    _in_range(lambda: a @ b)


def force_step(repeats: int = 4, **opts):
    """The force step on ``diamond(repeats)`` in float32 under the options ``opts``
    (default: the reference, strict fp32: chapter 1)."""
    model = ECEModel().to(device="cuda", dtype=torch.float32)
    atoms = systems.diamond(repeats)
    inputs = prepare_inputs(atoms, model.config.cutoff, torch.float32, "cuda")
    with options.use(**(opts or {"reference": True})):
        _in_range(lambda: step(model, *inputs))


def edge_frame(rep: int = 8):
    """Chapter 3's kernels at 365k edges, fp32: for the table variant, then the
    packed one, the rotation (two sides), the unrotation forward and backward, the
    rotation's backward (two sides): ``captures.edge_frame.NCU_ORDER``."""
    t = step_tensors(rep, dev="cuda")
    runs = [_ops(_frames(t, variant), t) for variant in ("table", "packed")]
    order = ("rotate_fwd", "unrotate_fwd", "unrotate_bwd", "rotate_bwd")
    _in_range(lambda: [ops[name]() for ops in runs for name in order])


def _stack_ranges(layers, x, gy, ws, bs, wo, bo, precisions, recompute=False, **kw):
    """For each precision: the stack's forward by the kernel family ``layers``
    (:mod:`ecekern.stack_layers` or :mod:`ecekern.stack_fused`), then its force
    backward from the z it kept (or, with ``recompute``, the forward that keeps no
    z and the backward that makes it again), each once in an NVTX range after a
    warm-up."""
    for p in precisions:
        if recompute:
            _in_range(lambda p=p: layers.stack_forward(*x, ws, bs, wo, bo, p,
                                                       keep=False, **kw),
                      warmup=1)  # fmt: skip
            _in_range(lambda p=p: layers.stack_recompute_backward(
                *x, *gy, ws, bs, wo, p, **kw), warmup=1)  # fmt: skip
            continue
        z = layers.stack_forward(*x, ws, bs, wo, bo, p, **kw)[2]
        _in_range(lambda p=p: layers.stack_forward(*x, ws, bs, wo, bo, p, **kw),
                  warmup=1)  # fmt: skip
        _in_range(lambda p=p, z=z: layers.stack_backward(z, *gy, ws, wo, p, **kw),
                  warmup=1)  # fmt: skip


def _randn():
    """``r(*shape, scale=1.0)``: standard normal values on the GPU, seeded."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return lambda *shape, scale=1.0: scale * torch.randn(*shape, device="cuda",
                                                          generator=g)  # fmt: skip


def _stack_weights(r, F, FO, n_ang):
    """A stack of two gated layers of width F and its output layer to FO: (weights,
    biases, output weight, output bias)."""
    ws, bs = [r(n_ang, F, F, scale=F**-0.5) for _ in range(2)], [r(F), r(F)]
    return ws, bs, r(n_ang, FO, F, scale=F**-0.5), r(FO)


def cohorts_layers(E: int = 65_536, F: int = 192, FO: int = 96, n_ang: int = 3):
    """Chapter 6's layer kernels (K = 2) on one cohort of the library's size, fp32:
    the forward, then the force backward, at each precision, the library's tiles,
    skipping the m = 0 sin part as the model does (``sin0_zero``)."""
    r = _randn()
    x = [r(E, F, n_ang) for _ in range(2)]
    gy = [r(E, FO, n_ang) for _ in range(2)]
    _stack_ranges(stack_layers, x, gy, *_stack_weights(r, F, FO, n_ang),
                  ("fp32", "tf32", "3xtf32", "bf16"), sin0_zero=True)  # fmt: skip


def cohorts_stack(E: int = 65_536, recompute: bool = False):
    """Chapter 6's fused stacks (:mod:`ecekern.stack_fused`) in its order (strict
    fp32, 3xTF32, TF32, bf16), on one cohort of the library's size, fp32, K = 2,
    the book's widths: the forward, then the force backward, on planes pairs as the
    model hands them over; with ``recompute``, the forward that writes only y and
    the backward that makes each tile's z again on chip."""
    r, (F, FO, n_ang) = _randn(), (192, 96, 3)
    P, *x = planes_pair(r(1), E, F, n_ang)
    P.copy_(r(*P.shape))
    Q, *gy = planes_pair(r(1), E, FO, n_ang)
    Q.copy_(r(*Q.shape))
    _stack_ranges(stack_fused, x, gy, *_stack_weights(r, F, FO, n_ang),
                  ("fp32", "3xtf32", "tf32", "bf16"), recompute, sin0_zero=True,
                  cohort_edges=E)  # fmt: skip


#: The programs by name; ``cohorts_stack_recompute``: :func:`cohorts_stack` with
#: ``recompute``; ``step_kernels``: chapter 7's fused geometry and radial kernels in
#: the library's 4096-atom force step (:func:`force_step` with them on).
_PROGRAMS = (cohorts_layers, cohorts_stack, copy, gemm, force_step, edge_frame)
TARGETS = {f.__name__: f for f in _PROGRAMS} | {
    "cohorts_stack_recompute": lambda: cohorts_stack(recompute=True),
    "step_kernels": lambda: force_step(8, geometry="fused", radial="fused"),
    "edge_layer_step": lambda: force_step(4, edge_layer="triton"),
}

if __name__ == "__main__":
    TARGETS[sys.argv[1]]()
