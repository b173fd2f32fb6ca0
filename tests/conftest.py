"""Test-wide setup: 8 fake CPU devices, so sharding is exercised on every machine.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time of the
first conftest, before any test module imports jax.
"""

import functools
import os
import pathlib

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
_VLLM_WORDS = ("mark.vllm", *_VLLM_FIXTURES)


def _uses_vllm(item) -> bool:
    return item.get_closest_marker("vllm") is not None or bool(
        _VLLM_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


@functools.cache
def _vllm_module(path: str) -> bool:
    """Whether a test module (a path relative to the root) starts or uses a vLLM server, from its
    text: xdist's controller sees test ids only, not marks or fixtures."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError:
        return False
    return any(word in text for word in _VLLM_WORDS)


def pytest_xdist_make_scheduler(config, log):
    """Two workers (scripts/test.sh: ``-n 2``) share out whole test modules, so each module's
    fixtures (compiled programs, trained runs) are built on one worker only, and every module
    with a vLLM test goes to one worker as one unit, in collection order: the session's shared
    server starts once, its tests see it in the same order as in one process (some read the
    weights an earlier test loaded), the tests that kill it still run after its other users
    (tests/sampling/conftest.py), and no two vLLM servers (a few GiB each) run at once. (xdist's
    own ``--dist loadgroup`` reads a test id that pytest 9 no longer uses.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndVLLM(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "vllm" if _vllm_module(path) else path

    return ModulesAndVLLM(config, log)


def pytest_collection_modifyitems(config, items):
    """The vLLM modules first (they are the longest unit under xdist, so it starts at once); a
    stable sort, every other order (the server-killing tests last) kept."""
    vllm_modules = {item.path for item in items if _uses_vllm(item)}
    items.sort(key=lambda item: item.path not in vllm_modules)
