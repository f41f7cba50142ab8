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
