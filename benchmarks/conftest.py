"""pytest-benchmark suite: per-op rows (test_ops.py) and end to end rows (test_end_to_end.py).

Run with `pytest benchmarks/` (not part of the default test suite, whose testpaths is tests/).
Inputs come from `bertfast.tools.workloads`, the builders the tests use; every row is checked against
the reference before it is timed. Options:
  --bertfast-config NAME   random-weight shape for the op rows (bert-base | minilm | tiny; default bert-base)
  --bertfast-model DIR     checkpoint for the end to end rows (default: the embedded MiniLM;
                           --bertfast-e2e-config NAME uses random weights instead)
  --bertfast-dtypes LIST   comma list of fp32, bf16, fp16 (default fp32,bf16)
"""

from __future__ import annotations

import pytest

from bertfast.tools.bench.providers import DTYPES
from bertfast.tools.bench.source import load_source
from bertfast.tools import workloads


def pytest_addoption(parser):
    group = parser.getgroup("bertfast benchmarks")
    group.addoption("--bertfast-config", default="bert-base", choices=tuple(workloads.CONFIGS),
                    help="random-weight config of the per-op rows")
    group.addoption("--bertfast-model", default=None, help="model directory of the end to end rows")
    group.addoption("--bertfast-e2e-config", default=None, choices=tuple(workloads.CONFIGS),
                    help="random weights of this config for the end to end rows")
    group.addoption("--bertfast-dtypes", default="fp32,bf16", help="comma list of dtypes")


def pytest_generate_tests(metafunc):
    if "dtype_name" in metafunc.fixturenames:
        names = [d.strip() for d in metafunc.config.getoption("--bertfast-dtypes").split(",") if d.strip()]
        for d in names:
            if d not in DTYPES:
                raise pytest.UsageError(f"--bertfast-dtypes: unknown dtype {d!r}; use {', '.join(DTYPES)}")
        metafunc.parametrize("dtype_name", names)


@pytest.fixture(scope="session")
def op_config_name(request):
    return request.config.getoption("--bertfast-config")


@pytest.fixture(scope="session")
def e2e_source(request):
    """The end to end model (fp32 eager reference, untouched), loaded once."""
    pytest.importorskip("transformers", reason="end to end rows compare with transformers' BertModel")
    name = request.config.getoption("--bertfast-e2e-config")
    if name:
        return load_source(config_name=name)
    model_dir = request.config.getoption("--bertfast-model")
    if model_dir is None:
        from bertfast import default_model_path

        try:
            model_dir = default_model_path()
        except RuntimeError as e:
            pytest.skip(f"no default model: {e}")
    return load_source(model_dir=model_dir)


class _Cache(dict):
    """Set-up objects (providers, lowp reference models) kept for the session."""


@pytest.fixture(scope="session")
def session_cache():
    cache = _Cache()
    yield cache
    cache.clear()

