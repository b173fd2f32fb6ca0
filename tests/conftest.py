"""Test-wide setup: 8 fake CPU devices, so sharding is exercised on every machine.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time of the
first conftest, before any test module imports jax.
"""

import os

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
