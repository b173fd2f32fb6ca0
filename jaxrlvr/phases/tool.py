"""The tool-use phases: RL on multi-turn tool-use rollouts (``env.tools``) and its warm start.

The run's sampler is wrapped into an ``envs.MultiTurnSampler`` (``multi_turn_sampler``: the
phases' ``sampler_wrapper``, which the run's assembly applies), so a rollout is a trajectory of
model turns and tool outputs, stored as one completion whose tool tokens are flagged as not
sampled. ``ToolPhase`` is the RL phase with the multi-turn rollout source
(``sources.MultiTurnSource``: the environments get the problems at reset, their step rewards
add to the verifier's, the step's metrics carry turns, tool calls and errors, tool time and
how rollouts ended, ``tool/...``); everything after sampling is the RL phase's own path:
grading, shaping and packing (tool tokens are out of the loss mask), GRPO / PPO advantages over
the whole trajectory, the off-policy corrections against the sampler's log-probs of the model
tokens, asynchronous rollouts and checkpoints. ``ToolSFTPhase`` is the SFT warm start on written
tool-use traces.
"""

from __future__ import annotations

from jaxrlvr import configlib, prompts
from jaxrlvr.envs import base as envs_base
from jaxrlvr.phases import base, rl, sft, sources


def multi_turn_sampler(cfg: base.Sections, sampler, tokenizer):
    """``sampler`` wrapped into an ``envs.MultiTurnSampler`` with ``env.tools`` and its limits
    (the python tool runs in ``reward.sandbox`` with ``reward.code``'s limits); ``cfg``: a tool
    phase's view (``env``, ``reward``, ``sampler``)."""
    from jaxrlvr import envs

    e = cfg.env
    tools = envs.make_tools(e.tools, sandbox=cfg.reward.code.sandbox(cfg.reward.sandbox))
    limits = envs.TurnLimits(
        max_turns=e.max_turns,
        max_tokens_per_turn=e.max_tokens_per_turn or cfg.sampler.max_tokens,
        max_total_tokens=cfg.sampler.max_tokens,
    )

    def close_tools():
        for tool in tools:
            getattr(tool, "close", lambda: None)()

    return envs.MultiTurnSampler(
        sampler,
        tokenizer,
        lambda: envs.ToolEnvironment(tools, max_output_chars=e.max_output_chars),
        limits,
        num_workers=e.num_workers,
        on_close=close_tools,
    )


class ToolSFTPhase(sft.SFTPhase):
    """The warm start of a tool-use run: SFT on written tool-use traces, whose tool outputs
    (``envs.split_trace``) are tokenized on their own, as a rollout appends them, and weigh 0,
    so SFT trains on what the model writes only. Its evaluation samples multi-turn rollouts."""

    sections = (*sft.SFTPhase.sections, "env", "reward", "sampler")

    @classmethod
    def wanted(cls, cfg):
        return sft.SFTPhase.wanted(cfg) and bool(cfg.env.tools)

    sampler_wrapper = staticmethod(multi_turn_sampler)

    def responses(self, texts):
        tok = self.ctx.tokenizer
        out = []
        for text in texts:
            ids, weights = [], []
            for piece, from_env in envs_base.split_trace(text):
                piece_ids = prompts.encode(tok, piece)
                ids += piece_ids
                weights += [0.0 if from_env else 1.0] * len(piece_ids)
            out.append((ids + [tok.eos_token_id], weights + [1.0]))
        return out


class ToolPhase(rl.RLPhase):
    name = "tool"
    sections = (*rl.RLPhase.sections, "env", "reward")
    source_cls = sources.MultiTurnSource

    @classmethod
    def wanted(cls, cfg: base.Sections) -> bool:
        return cfg.rl.online and bool(cfg.env.tools)

    @classmethod
    def check(cls, cfg, *, processes, shards, where):
        super().check(cfg, processes=processes, shards=shards, where=where)
        if processes > 1 and cfg.sampler.kind == "jax":
            # Each turn of the JAX sampler is one program over every process's rows: processes
            # whose rollouts need different numbers of turns would wait for each other forever.
            raise configlib.ConfigKeyError(
                "env.tools with sampler.kind=jax runs in one process only (use sampler.kind=vllm "
                "for a multi-process job)"
            )

    sampler_wrapper = staticmethod(multi_turn_sampler)
