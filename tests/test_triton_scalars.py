"""Python floats handed to Triton kernels: ``split_scale``, and the root conftest's
rule that a launch in the interpreter fails where a compiled kernel would round a
float argument to float32 (the interpreter keeps it float64)."""

import math
import struct

import pytest
import torch

from ecekern._triton import INTERPRET, split_scale, tl, triton


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.mark.parametrize(
    "x", [0.3, 1 / 7, math.pi, math.sqrt(2 / 4.5), 1e-3, 5.0, -0.3, 0.0, 123456.789]
)
def test_split_scale_is_two_float32_parts(x):
    hi, lo = split_scale(x)
    assert hi == _fp32(x) and lo == _fp32(lo)
    assert abs(x - (hi + lo)) <= 2.0**-48 * abs(x)
    if _fp32(x) == x:
        assert lo == 0.0


@triton.jit
def _scaled(x, out, s_hi, s_lo, S: tl.constexpr):
    v = tl.load(x)
    tl.store(out, v * s_hi + v * s_lo)
    tl.store(out + 1, v * S)


needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="the rule guards the interpreter's launches"
)


@needs_interpreter
def test_a_float64_scalar_argument_fails_in_the_interpreter():
    x = torch.tensor([1.0], dtype=torch.float64)
    out = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"_scaled gets s_hi=0\.3.*split_scale"):
        _scaled[(1,)](x, out, 0.3, 0.0, S=0.3)
    with pytest.raises(TypeError, match=r"s_lo=0\.1"):  # a keyword argument too
        _scaled[(1,)](x, out, 0.5, s_lo=0.1, S=0.3)


@needs_interpreter
def test_float32_parts_and_constexpr_floats_launch():
    """The parts carry the scale to 48 bits in float64; a constexpr float is a
    float64 literal (no rule)."""
    x = torch.tensor([0.7], dtype=torch.float64)
    out = torch.zeros(2, dtype=torch.float64)
    _scaled[(1,)](x, out, *split_scale(0.3), S=0.3)
    assert abs(out[0].item() - 0.7 * 0.3) <= 2.0**-47 * 0.21
    assert out[1].item() == 0.7 * 0.3
