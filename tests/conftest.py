"""Test-wide setup: 8 fake CPU devices, so sharding is exercised on every machine.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time of the
first conftest, before any test module imports jax.
"""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# The suite is compile-bound (hundreds of tiny programs, each run a few times): XLA:CPU's LLVM
# backend at -O0 compiles them ~30% faster (measured: test_updates' four microbatching cases
# 30.5 s -> 20.5 s, three compile-heavy files 201 s -> 145 s). It changes code generation, not
# the program's semantics: HLO passes are the same and no fast-math is enabled. Subprocess runs
# get the same flag through runs.env / multihost_runs.env.
if "xla_backend_optimization_level" not in _flags:
    _flags = (_flags + " --xla_backend_optimization_level=0").strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Fixtures that start or hold a real vLLM server (tests/sampling/conftest.py and modules' own).
_VLLM_FIXTURES = {"vllm_python", "vllm_server", "_vllm_server_session"}


def _uses_vllm(item) -> bool:
    return item.get_closest_marker("vllm") is not None or bool(
        _VLLM_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist (scripts/test.sh runs two workers with ``--dist loadgroup``).

    Each test module is one group, so its module fixtures (compiled programs, trained runs) are
    built on one worker only. Every module with a vLLM test is one group, ``vllm``, run on one
    worker and first (it is the longest): the session's shared server then starts once, the
    tests that kill it still run after its other users (tests/sampling/conftest.py), and no two
    vLLM servers (a few GiB each) run at once. Without xdist the marks do nothing."""
    vllm_modules = {item.path for item in items if _uses_vllm(item)}
    for item in items:
        group = "vllm" if item.path in vllm_modules else str(item.path)
        item.add_marker(pytest.mark.xdist_group(name=group))
    # A stable sort: the vLLM group first, every other order (the killing tests last) kept.
    items.sort(key=lambda item: item.path not in vllm_modules)
