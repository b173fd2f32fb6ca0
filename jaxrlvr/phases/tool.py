"""The tool-use RL phase: the RL phase on multi-turn rollouts (``env.tools``).

The run's sampler is an ``envs.MultiTurnSampler`` (``builders.build_sampler`` wraps the engine
when ``env.tools`` is set), so a rollout is a trajectory of model turns and tool outputs, stored
as one completion whose tool tokens are flagged as not sampled. Everything after sampling is the
RL phase's own path: grading (the task's verifier on the whole trajectory's text), shaping and
packing (tool tokens are out of the loss mask), GRPO / PPO advantages over the whole trajectory,
the off-policy corrections against the sampler's log-probs of the model tokens, asynchronous
rollouts and checkpoints. This phase adds what only trajectories have: the environments get the
problems at reset, the environment's step rewards are added to the verifier's, and the step's
metrics carry turns, tool calls, tool errors and time, and how rollouts ended (``tool/...``).
"""

from __future__ import annotations

from jaxrlvr.envs import rollout as env_rollout
from jaxrlvr.phases import rl


class ToolRLPhase(rl.RLPhase):
    # The same phase as the RL one for checkpoints and the loop: a run may add tools on resume
    # only through a config change that preflight reports.
    name = "rl"

    def sampler_generate(self, problems, prompts, n, params):
        return self.ctx.sampler.generate(prompts, n, params, problems=problems)

    def _grade(self, problems, completions, n):
        scores, stats = super()._grade(problems, completions, n)
        for s, c in zip(scores, completions):
            extra = getattr(c, "env_reward", 0.0)
            if extra:
                s["reward"] = s["reward"] + extra
        return scores, stats

    def sample(self, step_seed, drawn=None):
        problems, prompts, completions, m = super().sample(step_seed, drawn)
        m = {**m, **env_rollout.trajectory_metrics(completions, prefix="tool/")}
        return problems, prompts, completions, m
