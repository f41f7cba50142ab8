"""The one import of Triton and Gluon that every chapter module shares.

Chapter modules import ``triton``, ``tl``, ``gluon``, ``gl`` and the flags from here,
never from each other, so that each chapter stands on its own over one shim:

* ``AVAILABLE``: Triton is installed (Linux wheels); elsewhere ``triton`` is a
  stand-in whose kernels are defined but never launched, and every fast path falls
  back loudly to the reference;
* ``INTERPRET``: Triton's CPU interpreter is on (``TRITON_INTERPRET=1`` before the
  kernels were decorated); CPU tensors can then run the Triton kernels;
* ``gluon``, ``gl``: Triton's Gluon dialect where this Triton is a version the Gluon
  kernels were validated on (``GLUON_VALIDATED``), else None, with ``GLUON_REASON``;
* :func:`why_not_triton`: why a Triton kernel cannot run on a device, or None;
* ``fma_dot``: ``acc + a @ b`` by IEEE fp32 FMAs in Gluon layouts (None without
  Gluon), for the strict-fp32 kernels of chapters 2 and 6;
* ``round_tf32``, ``round_bf16``: an fp32 tile rounded to TF32 or bfloat16 and kept
  in fp32 (Triton kernels: the 3xTF32 split and the interpreter's bf16 products).
"""

from __future__ import annotations

import os
import struct

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # no Triton wheels on this platform: reference paths only
    from . import _no_triton as triton

    tl = triton.language
    AVAILABLE = False

__all__ = [
    "AVAILABLE",
    "GLUON_REASON",
    "GLUON_VALIDATED",
    "INTERPRET",
    "TensorDescriptor",
    "gl",
    "gluon",
    "tl",
    "triton",
    "split_scale",
    "why_not_triton",
    "fma_dot",
    "round_bf16",
    "round_tf32",
]

#: Triton kernels run on CPU tensors only when decorated under the interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

#: Triton releases whose Gluon internals (layouts, ``warp_specialize``, the FMA dot
#: builtin) the Gluon kernels were built and tested on. Another release runs the
#: Triton kernels instead, and says so once (``GLUON_REASON``).
GLUON_VALIDATED = ("3.6",)

gluon = gl = None
GLUON_REASON: str | None = "Triton is not installed on this platform"
TensorDescriptor = None  # host-side tensor descriptors (Triton >= 3.4)
if AVAILABLE:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        pass
    version = ".".join(triton.__version__.split(".")[:2])
    if version not in GLUON_VALIDATED:
        GLUON_REASON = (
            f"Triton {triton.__version__}: the Gluon kernels are validated on "
            f"{', '.join(GLUON_VALIDATED)} only"
        )
    elif INTERPRET:
        GLUON_REASON = "Gluon does not run in Triton's CPU interpreter"
    else:
        try:
            from triton.experimental import gluon
            from triton.experimental.gluon import language as gl

            GLUON_REASON = None
        except ImportError:
            GLUON_REASON = f"Triton {triton.__version__} has no Gluon"

fma_dot = None
if gluon is not None:
    from triton.experimental.gluon.language._core import tensor as _gl_tensor
    from triton.language.core import builtin

    @builtin
    def fma_dot(a, b, acc, _semantic=None):
        """``acc + a @ b`` by IEEE fp32 FMAs in the layouts the caller chose (a and b
        ``DotOperandLayout`` of acc's ``BlockedLayout``). ``gl.dot_fma`` without the
        K >= 16 floor of ``tl.dot``'s shape check: a K of 4 keeps each rank-4 update's
        operands to a few registers."""
        prec = _semantic._str_to_dot_input_precision("ieee")
        h = _semantic.builder.create_dot(a.handle, b.handle, acc.handle, prec, 0)
        return _gl_tensor(h, acc.type)


@triton.jit
def round_tf32(x):
    """fp32 ``x`` rounded to the nearest TF32 value (10 mantissa bits, ties to
    even), kept in fp32: ``x - round_tf32(x)`` is exact."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """fp32 ``x`` rounded to the nearest bfloat16 (ties to even), kept in fp32."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


def split_scale(scale: float) -> tuple[float, float]:
    """``scale = hi + lo`` with both exact in fp32: Triton passes Python floats as fp32
    scalars, which alone would cost fp64 results 1.5e-8 relative error (seen on the
    H200); ``x * hi + x * lo`` in fp64 keeps 48 bits of the scale."""
    hi = _to_fp32(scale)  # plain Python: no tensors built on every launch
    return hi, _to_fp32(scale - hi)


def _to_fp32(x: float) -> float:
    """``x`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def why_not_triton(device_type: str) -> str | None:
    """Why a Triton kernel cannot run on ``device_type`` here, or None."""
    if not AVAILABLE:
        return "Triton is not installed on this platform"
    if device_type == "cpu" and not INTERPRET:
        return (
            "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before import)"
        )
    if device_type not in ("cpu", "cuda"):
        return f"device {device_type} is not supported"
    return None
