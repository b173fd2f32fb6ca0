"""Training phases and the one place where a run's phases are chosen (``plan``).

Modules:
  base        RunContext (the run's shared components) and Phase (the shape every phase has)
  sft         SFTPhase: supervised warm start on gold or file pairs
  rl          RLPhase: sample -> grade -> shape -> prepare -> update -> sync (GRPO, PPO, EI, ...)
  preference  PreferencePhase: offline DPO / IPO / SimPO / ORPO on pairs from a file
  tool        ToolRLPhase: the RL phase on multi-turn tool-use rollouts (``env.tools``)

A new phase is a module with a ``base.Phase`` subclass plus one line in ``plan``.
"""

from __future__ import annotations

from jaxrlvr import config as config_lib
from jaxrlvr.phases import base, preference, rl, sft, tool

__all__ = ["base", "plan", "by_name"]


def plan(cfg: config_lib.TrainConfig) -> list[type[base.Phase]]:
    """The run's phases, in order: an SFT warm start when ``sft.steps`` > 0 (or an SFT-only run,
    ``rl.algo: none``), then the phase of ``rl.algo`` (on tool-use rollouts with ``env.tools``)."""
    phases: list[type[base.Phase]] = []
    if cfg.sft.steps > 0 or cfg.rl.algo == "none":
        phases.append(sft.SFTPhase)
    if cfg.rl.algo in config_lib.PREFERENCE_ALGOS:
        phases.append(preference.PreferencePhase)
    elif cfg.rl.algo != "none":
        phases.append(tool.ToolRLPhase if cfg.env.tools else rl.RLPhase)
    return phases


def by_name(cfg: config_lib.TrainConfig) -> dict[str, type[base.Phase]]:
    """The run's phase classes by their checkpoint name."""
    return {cls.name: cls for cls in plan(cfg)}
