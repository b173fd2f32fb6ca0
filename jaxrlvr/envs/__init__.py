"""Environments of multi-turn rollouts: the protocol, the tools, and the rollout loop.

Modules:
  base         EnvStep, Environment (the protocol), Tool, ToolEnvironment, split_trace
  python_tool  PythonTool: ``<python>code</python>`` runs in the code-reward sandbox
  calculator   Calculator: ``<calc>expression</calc>``
  multi_turn   MultiTurnSampler (any sampler -> multi-turn trajectories), Trajectory, TurnLimits,
               trajectory_metrics

``make_tools`` builds tools by name (what ``env.tools`` of a run config names).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxrlvr import sandbox as sandbox_lib
from jaxrlvr.envs import base, calculator, multi_turn, python_tool
from jaxrlvr.envs.base import Environment, EnvStep, Tool, ToolEnvironment, ToolResult, split_trace
from jaxrlvr.envs.calculator import Calculator
from jaxrlvr.envs.multi_turn import MultiTurnSampler, Trajectory, TurnLimits, trajectory_metrics
from jaxrlvr.envs.python_tool import PythonTool

__all__ = [
    "base",
    "calculator",
    "python_tool",
    "multi_turn",
    "EnvStep",
    "Environment",
    "Tool",
    "ToolEnvironment",
    "ToolResult",
    "split_trace",
    "Calculator",
    "PythonTool",
    "MultiTurnSampler",
    "Trajectory",
    "TurnLimits",
    "trajectory_metrics",
    "make_tools",
]


def make_tools(names: Sequence[str], *, sandbox: sandbox_lib.SandboxConfig) -> list[Tool]:
    """The tools named (``python``, ``calculator``), in order."""
    makers = {"python": lambda: PythonTool(sandbox), "calculator": Calculator}
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise ValueError(f"env.tools: unknown tool(s) {unknown}; known: {sorted(makers)}")
    return [makers[n]() for n in names]
