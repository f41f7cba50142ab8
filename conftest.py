"""Root conftest: Triton's interpreter on machines without a GPU (TOOLING.md: the
variable is read when ``@triton.jit`` runs, so it is set before ecekern is imported)."""

import os

import pytest

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # a fast path that falls back in a test is a failure (after the variable above)
    config.addinivalue_line("filterwarnings", "error::ecekern.options.FallbackWarning")


def pytest_collection_modifyitems(config, items):
    if _has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings():
    """Every test starts with no fallback announced: a warning is issued once per
    reason and process, so a test that expects one (``pytest.warns``), or the rule
    above that turns one into an error, must not depend on which test ran first."""
    from ecekern import options

    options.reset_fallback_warnings()


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for one test, restored after it. The files of
    the reference maths use it (``pytestmark``); set at import, the default leaked
    into every test file collected after them."""
    import torch

    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(saved)


def float_args_off_the_gpu(kernel, arg_names, constexprs, args, kwargs) -> str | None:
    """What a compiled launch would change: the non-constexpr Python float
    arguments of a launch that are not float32 numbers, named, or None. A compiled
    kernel receives a Python float as a float32 scalar; Triton's interpreter keeps
    it a float64 number, so float64 results on the GPU would differ from the
    interpreter's by up to 6e-8 relative. (A constexpr float is a literal: float64
    in float64 arithmetic on both.)"""
    given = dict(zip(arg_names, args)) | dict(kwargs)
    bad = [
        f"{name}={value!r}"
        for name, value in given.items()
        if isinstance(value, float) and name not in constexprs and not _is_fp32(value)
    ]
    if not bad:
        return None
    return (
        f"{kernel} gets {', '.join(bad)}: a compiled kernel receives a Python float "
        "as float32, the interpreter as float64; pass *split_scale(x) (two float32 "
        "parts, ecekern._triton) and compute x_hi + x_lo in the kernel"
    )


def _is_fp32(x: float) -> bool:
    """Whether x is a float32 number (NaN and infinities are)."""
    from ecekern._triton import _to_fp32  # imported after the environment is set

    try:
        return x != x or _to_fp32(x) == x
    except OverflowError:  # finite, past float32's range
        return False


@pytest.fixture(autouse=True, scope="session")
def _float_args_as_on_the_gpu():
    """In Triton's interpreter, every kernel launch with a Python float argument
    that a compiled kernel would round to float32 fails
    (:func:`float_args_off_the_gpu`): the float64 tests would pass on the CPU and
    miss by 1e-8 on the GPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def checked(self, *args, **kwargs):
        why = float_args_off_the_gpu(
            self.fn.__name__, self.arg_names, self.constexprs, args, kwargs
        )
        if why:
            raise TypeError(why)
        return launch(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.GridExecutor, "__call__", checked)
        yield
