"""Localise the Triton EquivariantLinear's GPU failures: ``python -m
ecekern.captures.diagnose``.

For each configuration that failed on the H200 (and one that passed), and for two
software-pipelining depths, prints the relative error of every output separately
(y_cos, y_sin, dx_cos, dx_sin, dW, db) against float64 einsum on the same inputs.
Each depth runs in its own process (``ECEKERN_TRITON_STAGES`` is read at import).
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = [  # (dtype, tf32, B, K, O, n_ang): failed, failed, failed, passed
    ("float32", False, 4099, 192, 192, 3),
    ("float32", True, 4099, 192, 192, 3),
    ("float64", False, 33, 48, 9, 5),
    ("float64", False, 37, 20, 35, 3),
]


def _one_process() -> None:
    import torch

    from ecekern import linear, reference

    names = ["y_cos", "y_sin", "dx_cos", "dx_sin", "dW", "db"]
    for dt, tf32, B, K, O, n_ang in CASES:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        g = torch.Generator(device="cuda").manual_seed(0)
        x64 = [
            torch.randn(B, K, n_ang, device="cuda", dtype=torch.float64, generator=g)
            for _ in range(2)
        ]
        w64 = torch.randn(n_ang, O, K, device="cuda", dtype=torch.float64, generator=g)
        b64 = torch.randn(O, device="cuda", dtype=torch.float64, generator=g)
        args64 = [t.requires_grad_() for t in (*x64, w64, b64)]
        dtype = getattr(torch, dt)
        args = [t.detach().to(dtype).requires_grad_() for t in args64]
        y64 = reference.equivariant_linear(*args64)
        gy = [torch.randn_like(t) for t in y64]
        ref = list(y64) + list(torch.autograd.grad(y64, args64, gy))
        y = linear._EquivariantLinearFn.apply(*args)
        got = list(y) + list(torch.autograd.grad(y, args, [t.to(dtype) for t in gy]))
        errs = [float((a.double() - r).norm() / r.norm()) for a, r in zip(got, ref)]
        print(
            f"stages={linear.STAGES} {dt}{'+tf32' if tf32 else ''} "
            f"B={B} K={K} O={O} n_ang={n_ang}: "
            + " ".join(f"{n}={e:.1e}" for n, e in zip(names, errs)),
            flush=True,
        )


def main() -> int:
    if os.environ.get("_ECEKERN_DIAGNOSE_CHILD"):
        _one_process()
        return 0
    rc = 0
    for stages in ("1", "3"):
        env = dict(
            os.environ, ECEKERN_TRITON_STAGES=stages, _ECEKERN_DIAGNOSE_CHILD="1"
        )
        rc |= subprocess.run(
            [sys.executable, "-m", "ecekern.captures.diagnose"], env=env
        ).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
