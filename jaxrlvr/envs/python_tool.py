"""The Python tool: ``<python>code</python>`` -> what the code prints, run in the code sandbox.

The code runs in ``jaxrlvr.sandbox`` (bubblewrap by default: no network, no host files, a uid of
its own, CPU / memory / process / time limits; ``reward.sandbox`` chooses the mechanism) with its
stdout and stderr captured. A program that raises returns the exception's last line
(``ZeroDivisionError: division by zero``) and counts as a tool error, as does a timeout. Each
thread gets a warm sandbox of its own (``Sandbox.run`` is not thread-safe, and each sandbox has
its own uid range), so the rollout can run a batch of calls on a few threads.

The tool compares nothing: a call's request holds only the model's code, never the problem's
answer, which the episode's reward grades on the host after the final turn. The sandbox is left
clean after every call (or replaced), so one call's files, processes or shared memory never reach
the next call's output.
"""

from __future__ import annotations

import threading
import time

from jaxrlvr import sandbox as sandbox_lib
from jaxrlvr.envs import base


class PythonTool:
    """``<python>code</python>``: the code's printed output (see module docstring).

    Args:
      sandbox: the sandbox's mechanism and limits.
      max_output_bytes: the most bytes of output kept from one call.
    """

    name = "python"
    tag = "python"

    def __init__(self, sandbox: sandbox_lib.SandboxConfig, *, max_output_bytes: int = 1024):
        self.sandbox_cfg = sandbox
        self.max_output_bytes = max_output_bytes
        self._local = threading.local()
        self._boxes: list[sandbox_lib.Sandbox] = []
        self._lock = threading.Lock()

    def _box(self) -> sandbox_lib.Sandbox:
        box = getattr(self._local, "box", None)
        if box is None:
            box = self._local.box = sandbox_lib.Sandbox(self.sandbox_cfg)
            with self._lock:
                self._boxes.append(box)
        return box

    def __call__(self, argument: str) -> base.ToolResult:
        start = time.perf_counter()
        result = self._box().run(argument, capture=self.max_output_bytes)
        output, error = result.output, result.status != "done"
        if result.status == "timeout":
            output = (output + "\n" if output.strip() else "") + "error: timed out"
        elif result.status not in ("done", "program_error"):
            output = f"error: {result.status}"
        return base.ToolResult(output, error, time.perf_counter() - start)

    def close(self) -> None:
        with self._lock:
            boxes, self._boxes = self._boxes, []
        for box in boxes:
            box.close()
