"""Training phases and the one place where a run's phases are listed (``PLAN``).

Modules:
  base        RunContext (the run's assembled components), Phase (the shape every phase has),
              Hook (periodic work registered with its period)
  sft         SFTPhase: supervised warm start on gold or file pairs
  rl          RLPhase: a rollout source + a learner + the step's metrics (GRPO, PPO, EI, ...)
  sources     the rollout sources: single-turn (RLPhase's) and multi-turn (ToolPhase's)
  learner     the RL learner: shaping, token budget, prepare (behaviour versions), update
  preference  PreferencePhase: offline DPO / IPO / SimPO / ORPO on pairs from a file
  tool        ToolPhase and ToolSFTPhase: RL and its warm start on multi-turn tool use
  ahead       CompileAhead: what the loop compiles ahead while its first phase trains, and when

A new phase is a module with a ``base.Phase`` subclass plus one line in ``PLAN``: the phase
answers for itself whether a config has it (``wanted``), its batch geometry, checks, data files,
sampler and summary fields.
"""

from __future__ import annotations

from jaxrlvr import config as config_lib
from jaxrlvr.phases import base, preference, rl, sft, tool

__all__ = ["PLAN", "base", "plan", "by_name"]

# (slot, phase) in the order a run goes through them; in each slot the first phase that a config
# wants is the run's (a specialised phase stands before the one it replaces).
PLAN: tuple[tuple[str, type[base.Phase]], ...] = (
    ("warm start", tool.ToolSFTPhase),
    ("warm start", sft.SFTPhase),
    ("train", preference.PreferencePhase),
    ("train", tool.ToolPhase),
    ("train", rl.RLPhase),
)


def plan(cfg: config_lib.TrainConfig) -> list[type[base.Phase]]:
    """The run's phases, in order: for each slot of ``PLAN``, its first phase that ``cfg``
    wants (an SFT warm start when ``sft.steps`` > 0 or an SFT-only run, then the phase of
    ``rl.algo``)."""
    chosen: dict[str, type[base.Phase]] = {}
    for slot, cls in PLAN:
        if slot not in chosen and cls.wanted(cls.view(cfg)):
            chosen[slot] = cls
    return list(chosen.values())


def by_name(cfg: config_lib.TrainConfig) -> dict[str, type[base.Phase]]:
    """The run's phase classes by their checkpoint name."""
    return {cls.name: cls for cls in plan(cfg)}
