"""Localise the Triton EquivariantLinear's GPU failures: ``python -m
ecekern.captures.diagnose``.

For each configuration that failed on the H200 (and one that passed), for two
software-pipelining depths and for both ways of getting at the modes (split from one
contiguous tile in registers, or one strided load per mode), prints the relative error
of every output separately (y_cos, y_sin, dx_cos, dx_sin, dW, db) against float64
einsum on the same inputs, and the forward time at E = 47k, F = 192, n_ang = 3 in
fp32, TF32 and bf16. Each variant runs in its own process (``ECEKERN_TRITON_STAGES``
and ``ECEKERN_TRITON_SPLIT`` are read at import).
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
            f"stages={linear.STAGES} split={linear.SPLIT} "
            f"{dt}{'+tf32' if tf32 else ''} B={B} K={K} O={O} n_ang={n_ang}: "
            + " ".join(f"{n}={e:.1e}" for n, e in zip(names, errs)),
            flush=True,
        )
    from ecekern import bench

    x = [torch.randn(47_000, 192, 3, device="cuda") for _ in range(2)]
    w = torch.randn(3, 192, 192, device="cuda") / 192**0.5
    b = torch.randn(192, device="cuda")
    for dt, tf32 in (("float32", False), ("float32", True), ("bfloat16", False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = [t.to(getattr(torch, dt)) for t in (*x, w, b)]
        t = bench.time_fn(lambda a=a: linear._EquivariantLinearFn.apply(*a))
        print(
            f"stages={linear.STAGES} split={linear.SPLIT} {dt}{'+tf32' if tf32 else ''}"
            f" E=47000 F=192 n_ang=3 forward {t.median:.4f} ms",
            flush=True,
        )


def main() -> int:
    if os.environ.get("_ECEKERN_DIAGNOSE_CHILD"):
        _one_process()
        return 0
    rc = 0
    for stages, split in (("1", "1"), ("3", "1"), ("1", "0"), ("3", "0")):
        env = dict(
            os.environ,
            ECEKERN_TRITON_STAGES=stages,
            ECEKERN_TRITON_SPLIT=split,
            _ECEKERN_DIAGNOSE_CHILD="1",
        )
        rc |= subprocess.run(
            [sys.executable, "-m", "ecekern.captures.diagnose"], env=env
        ).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
