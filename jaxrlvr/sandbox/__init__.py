"""The sandbox: untrusted (model-written) Python programs run against tests under bubblewrap.

Its own package because two kinds of user run programs in it: the code reward
(``rewards.code``: a response's program against its problem's tests) and tool use
(``envs.python_tool``: a ``<python>`` call's output returned to the model). Plain host-side
Python, no JAX; nothing here knows rewards, tools or a run's config.

Modules:
  host     ``Sandbox`` (one warm bwrap process per config), ``SandboxConfig`` and
           ``SandboxLimits``, ``RunResult``, the memory cgroup, ``shared_sandbox`` (this process's
           warm sandbox), ``check_available`` (a one-line ``SandboxUnavailable`` when it cannot run)
  harness  the standard-library runner that lives inside the sandbox (run as a script)

The names below are re-exported for the reward and the tools (docs/code.md).
"""

from jaxrlvr.sandbox import harness, host
from jaxrlvr.sandbox.host import (
    RunResult,
    Sandbox,
    SandboxConfig,
    SandboxKind,
    SandboxLimits,
    SandboxUnavailable,
    base_python,
    check_available,
    close_shared,
    shared_sandbox,
)

__all__ = [
    "harness",
    "host",
    "RunResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxKind",
    "SandboxLimits",
    "SandboxUnavailable",
    "base_python",
    "check_available",
    "close_shared",
    "shared_sandbox",
]
