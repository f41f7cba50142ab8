"""Which implementation serves a call: resolved once per (device, dtype, TF32, shape,
layout) and cached, the way cuEquivariance picks its method at construction.

Two decisions, each a cached function of plain values:

* :func:`path_for`: the path, ``"einsum"`` (the reference), ``"dense"`` (block-diagonal
  GEMM) or ``"triton"`` (a per-mode kernel), from the requested path (``"auto"`` is the
  measured choice of chapter 2);
* :func:`kernel_for`: on the ``"triton"`` path, the kernel: ``"fma"`` (Gluon, FMA units,
  strict fp32), ``"tc"`` (Gluon, tensor cores, bf16) or ``"triton"`` (every other case).

``auto`` on CUDA, from chapter 2's captures: strict fp32 at n_ang = 3 takes the Gluon
FMA kernel (its force step is the fastest); bf16 at n_ang = 3 takes the tensor-core
kernel where it serves the shape and the operands; TF32 and bf16 otherwise take the
dense GEMM up to n_ang = 5, where it was faster than the einsum; everything else (and
every other device) takes the einsum.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._triton import GLUON_REASON, why_not_triton
from . import gluon_tc
from .triton_modes import MAX_N_ANG, TritonLaunch

__all__ = ["LAUNCH", "Key", "Plan", "auto_path", "kernel_for", "path_for"]

PATHS = ("auto", "einsum", "dense", "triton")

#: The Triton kernel's launch per precision (chapter 2's launch sweep).
LAUNCH = {
    "fp64": TritonLaunch(block_b=32, block_k=16, block_o=32, warps=4, stages=1),
    "fp32": TritonLaunch(block_b=64, block_k=32, block_o=64, warps=4, stages=2),
    "tf32": TritonLaunch(prefetch=True, store3=True, w_desc=True, join=True),
    "16bit": TritonLaunch(prefetch=True, w_desc=True),
}
#: (precision, largest n_ang) where ``auto`` takes the dense GEMM on CUDA.
AUTO_DENSE = {"bf16": 5, "tf32": 5}


def precision_key(dtype: torch.dtype, tf32: bool) -> str:
    """``fp64``, ``fp32``, ``tf32``, ``bf16`` or ``fp16``."""
    if dtype == torch.float32:
        return "tf32" if tf32 else "fp32"
    return {torch.float64: "fp64", torch.bfloat16: "bf16"}.get(dtype, "fp16")


@dataclass(frozen=True)
class Plan:
    """One resolved choice: the path, the kernel on the triton path, and ``note``:
    why a faster choice was not taken (said once), or, with ``fallback``, why the
    requested path cannot serve the call at all (the reference runs, loudly)."""

    path: str
    kernel: str = ""
    note: str | None = None
    fallback: bool = False


class Key(NamedTuple):
    """What a plan depends on: device, dtype, TF32, the shape (n_ang, K inputs, O
    outputs) and the layout: whether x's rows are contiguous (the FMA kernel's loads)
    and whether x and w are contiguous and 16-byte aligned (the tensor-core kernel's
    TMA)."""

    device_type: str
    dtype: torch.dtype
    tf32: bool
    n_ang: int
    K: int
    O: int
    rows_contiguous: bool
    tc_operands: bool


@functools.cache
def kernel_for(key: Key) -> Plan:
    """The kernel of the triton path for a call with this key."""
    device_type, dtype, tf32, n_ang, K, O, rows_contiguous, tc_operands = key
    if device_type != "cuda":
        return Plan("triton", "triton")
    if dtype == torch.float32 and not tf32 and n_ang == 3:
        if GLUON_REASON is not None:
            return Plan("triton", "triton", f"Gluon FMA kernel: {GLUON_REASON}")
        if not rows_contiguous:
            return Plan("triton", "triton", "Gluon FMA kernel: x's rows not contiguous")
        return Plan("triton", "fma")
    if dtype == torch.bfloat16 and n_ang == 3:
        reason = gluon_tc.shape_reason(dtype, n_ang, K, O, device_type)
        if reason is None and not tc_operands:
            reason = "x or w not contiguous and 16-byte aligned"
        if reason is None:
            return Plan("triton", "tc")
        return Plan("triton", "triton", f"Gluon tensor-core kernel: {reason}")
    return Plan("triton", "triton")


@functools.cache
def path_for(requested: str, key: Key) -> Plan:
    """The path for a call (``requested`` one of ``PATHS``), with the kernel when it
    is the triton path."""
    device_type, dtype, tf32, n_ang, K, O = key[:6]
    if requested == "einsum" or requested == "dense":
        return Plan(requested)
    if requested == "triton":
        reason = why_not_triton(device_type)
        if reason is None and n_ang > MAX_N_ANG:
            reason = f"n_ang = {n_ang} > {MAX_N_ANG}"
        if reason is not None:
            return Plan("einsum", note=reason, fallback=True)
        return kernel_for(key)
    path = auto_path(device_type, dtype, n_ang, tf32, K, O)
    if path != "triton":
        return Plan(path)
    plan = kernel_for(key)
    if plan.kernel == "triton":
        # auto takes the triton path for its Gluon kernels only: the Triton kernel
        # was slower than the einsum in strict fp32 and than the GEMM in bf16
        return Plan("einsum" if dtype == torch.float32 else "dense", note=plan.note)
    return plan


def auto_path(
    device_type: str,
    dtype: torch.dtype,
    n_ang: int,
    tf32: bool,
    K: int | None = None,
    O: int | None = None,
) -> str:
    """The path ``"auto"`` takes for a call before its layout is known: ``"dense"``,
    ``"triton"`` or ``"einsum"``. In bf16 the triton path needs K and O (the
    tensor-core kernel's shape); without them it is not taken."""
    if device_type != "cuda":
        return "einsum"
    key = precision_key(dtype, tf32)
    if key == "fp32" and n_ang == 3:
        return "triton"
    if (
        key == "bf16"
        and n_ang == 3
        and K is not None
        and O is not None
        and gluon_tc.shape_reason(dtype, n_ang, K, O, device_type) is None
    ):
        return "triton"
    return "dense" if n_ang <= AUTO_DENSE.get(key, 0) else "einsum"
