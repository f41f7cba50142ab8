"""Localise the Triton EquivariantLinear kernel's GPU failures: ``python -m
ecekern.captures.diagnose``.

For each case that once failed on the H200 (and one that passed) and for each launch
of :data:`LAUNCHES` (software-pipelining depths, the next K step prefetched, one
store of all modes, W by descriptor), prints the relative error of every output
separately (y_cos, y_sin, dx_cos, dx_sin, dW, db) against float64 einsum on the same
inputs, and the forward time at E = 47k, F = 192, n_ang = 3 in fp32, TF32 and bf16.
The kernel is called at each launch directly (``triton_modes.triton_fwd``: the
forward, and the input backward with W^T as w); dW is the library's GEMM
(``dense.bwd_w_gemm``), db a sum. One process; nothing global is changed.
"""

from __future__ import annotations

import sys

CASES = [  # (dtype, tf32, B, K, O, n_ang): failed, failed, failed, passed
    ("float32", False, 4099, 192, 192, 3),
    ("float32", True, 4099, 192, 192, 3),
    ("float64", False, 33, 48, 9, 5),
    ("float64", False, 37, 20, 35, 3),
]


def launches() -> dict:
    """Name -> ``TritonLaunch``: one and three stages of the plain strided loads,
    then the library's TF32 and 16-bit launches."""
    from ecekern.linear.plan import LAUNCH
    from ecekern.linear.triton_modes import TritonLaunch

    return {
        "stages=1": TritonLaunch(stages=1),
        "stages=3": TritonLaunch(stages=3),
        "tf32 launch": LAUNCH["tf32"],
        "16bit launch": LAUNCH["16bit"],
    }


def _outputs(x_cos, x_sin, w, b, g_cos, g_sin, launch, tf32):
    """y_cos, y_sin, dx_cos, dx_sin, dW, db by the kernel at ``launch``."""
    from ecekern.linear.dense import bwd_w_gemm
    from ecekern.linear.triton_modes import triton_fwd

    w_t = w.transpose(1, 2)  # the input backward: g against W^T, a view
    return [
        triton_fwd(x_cos, w, b, launch, tf32),
        triton_fwd(x_sin, w, None, launch, tf32),
        triton_fwd(g_cos, w_t, None, launch, tf32),
        triton_fwd(g_sin, w_t, None, launch, tf32),
        bwd_w_gemm(g_cos, g_sin, x_cos, x_sin),
        g_cos[:, :, 0].sum(0),
    ]


def main() -> int:
    import torch

    from ecekern import bench, reference
    from ecekern.linear.triton_modes import triton_fwd

    names = ["y_cos", "y_sin", "dx_cos", "dx_sin", "dW", "db"]
    for lname, launch in launches().items():
        for dt, tf32, B, K, O, n_ang in CASES:
            bench.set_tf32(tf32)
            g = torch.Generator(device="cuda").manual_seed(0)

            def randn(*shape, g=g):
                return torch.randn(
                    *shape, device="cuda", dtype=torch.float64, generator=g
                )

            x64 = [randn(B, K, n_ang) for _ in range(2)]
            w64, b64 = randn(n_ang, O, K), randn(O)
            args64 = [t.requires_grad_() for t in (*x64, w64, b64)]
            y64 = reference.equivariant_linear(*args64)
            gy = [torch.randn_like(t) for t in y64]
            ref = list(y64) + list(torch.autograd.grad(y64, args64, gy))
            dtype = getattr(torch, dt)
            a = [t.detach().to(dtype) for t in (*args64, *gy)]
            got = _outputs(*a, launch, tf32)
            errs = [float((o.double() - r).norm() / r.norm()) for o, r in zip(got, ref)]
            print(
                f"{lname} {dt}{'+tf32' if tf32 else ''} B={B} K={K} O={O} "
                f"n_ang={n_ang}: "
                + " ".join(f"{n}={e:.1e}" for n, e in zip(names, errs)),
                flush=True,
            )
        x = torch.randn(47_000, 192, 3, device="cuda")
        w = torch.randn(3, 192, 192, device="cuda") / 192**0.5
        b = torch.randn(192, device="cuda")
        for dt, tf32 in (("float32", False), ("float32", True), ("bfloat16", False)):
            bench.set_tf32(tf32)
            a = [t.to(getattr(torch, dt)) for t in (x, w, b)]
            t = bench.time_fn(
                lambda a=a, tf32=tf32, ln=launch: triton_fwd(*a, ln, tf32)
            )
            print(
                f"{lname} {dt}{'+tf32' if tf32 else ''} E=47000 F=192 n_ang=3 "
                f"forward (one of cos/sin) {t.median:.4f} ms",
                flush=True,
            )
        bench.set_tf32(False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
