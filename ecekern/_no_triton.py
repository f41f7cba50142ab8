"""Stand-in for Triton where it has no wheels (macOS, Windows).

``import ecekern`` then still works: the kernel functions are defined but never
launched, and every fast path falls back loudly to the reference ("Triton is not
installed"). Only what the kernel modules touch at import time is provided.
"""

from __future__ import annotations

import types

AVAILABLE = False


def jit(fn=None, **kwargs):
    """``@triton.jit`` without Triton: the plain function, never launched."""
    return fn if fn is not None else (lambda f: f)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class _Constexpr:
    """``tl.constexpr``: an annotation, or a module-level compile-time value."""

    def __init__(self, value=None):
        self.value = value


language = types.SimpleNamespace(
    constexpr=_Constexpr, float32="fp32", float64="fp64", int64="i64", int32="i32"
)
