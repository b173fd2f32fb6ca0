"""Multi-turn rollouts: model turns and environment turns, token in and token out.

``MultiTurnSampler`` wraps a sampler (``JaxSampler`` or ``VLLMSampler``) and keeps its interface:
``generate(prompt_token_ids, n, sampling_params)`` returns one ``Trajectory`` (a ``Completion``)
per sample, so everything downstream (grading, packing, GRPO / PPO advantages over the whole
trajectory, the off-policy corrections, asynchronous rollouts, evaluation) works on multi-turn
rows unchanged. One rollout:

    turn 1:  sampler(prompt)                                -> model tokens, as sampled
    env:     env.step(decode(turn 1))                       -> observation text, tokenized once
    turn 2:  sampler(prompt + turn 1 + observation)         -> model tokens, as sampled
    ...      until the environment is done, or a limit ends it

No token is ever decoded and re-tokenized: each model turn's token ids (and the sampler's
log-probs of them) are appended as the sampler returned them, and the next turn's prompt is the
token ids so far (TRL issue 5224 is what happens otherwise). The observation's tokens are marked
as not sampled (``Completion.forced``, log-prob 0), so the loss mask covers model tokens only.

Limits (``TurnLimits``): model turns per rollout, tokens per model turn, and tokens in total after
the prompt (model and environment tokens). A rollout that breaks one ends there with
``finish_reason`` "length" and its reason in ``Trajectory.end_reason``: ``done`` (the
environment ended it, or had nothing to answer: the final answer), ``max_turns`` (it asked
for a tool after its last allowed turn), ``turn_tokens`` (a turn ran out of tokens),
``total_tokens`` (the total did).

What each turn recomputes: the sampler prefills the whole prefix again (prompt, earlier turns,
observations). The JAX sampler's KV cache lives inside one compiled generation, so turn k costs a
prefill of the prefix (prompt + k-1 turns) on top of its decode; at the tool demo's sizes
(prompts of ~15 tokens, prefixes under ~100) that is one forward of the prefix per turn, small
next to the decode steps. vLLM reuses the prefix's KV blocks through its prefix cache when that
is on. Samples of one prompt share the first turn's prefill (``n`` per prompt); later turns
sample one continuation per trajectory.

Weights: ``update_weights`` waits for the rollouts in flight, so every turn of a trajectory is
sampled by the weights of its first turn (``Trajectory.weight_version``), as a single-turn
completion is.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxrlvr.envs import base as env_base
from jaxrlvr.sampling import base

END_REASONS = ("done", "max_turns", "turn_tokens", "total_tokens")


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    """Limits of one rollout.

    Attributes:
      max_turns: model turns per rollout (>= 1).
      max_tokens_per_turn: new tokens per model turn.
      max_total_tokens: tokens after the prompt, model and environment ones together (the
        sampler's ``max_tokens`` of a single-turn run).
    """

    max_turns: int
    max_tokens_per_turn: int
    max_total_tokens: int

    def __post_init__(self):
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"env.{name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trajectory(base.Completion):
    """A multi-turn rollout as one completion (``forced`` marks the environment's tokens).

    Attributes (beyond ``Completion``'s):
      turns: model turns taken.
      tool_calls, tool_errors: environment steps that ran a tool, and those whose tool failed.
      tool_seconds: wall-clock seconds spent in the tools.
      env_reward: the sum of the environment's step rewards.
      end_reason: one of ``END_REASONS``.
      turn_spans: (start, end) token index of each model turn in ``token_ids``.
    """

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    env_reward: float = 0.0
    end_reason: str = "done"
    turn_spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        super().__post_init__()
        # JSON (a checkpoint of in-flight rollouts) turns the spans into lists.
        object.__setattr__(self, "turn_spans", tuple(tuple(s) for s in self.turn_spans))
        if self.end_reason not in END_REASONS:
            raise ValueError(f"end_reason must be one of {END_REASONS}, got {self.end_reason!r}")


@dataclasses.dataclass
class _Rollout:
    prompt_index: int
    env: Any
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    forced: list[bool] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    version: int | None = None
    calls: int = 0
    errors: int = 0
    tool_seconds: float = 0.0
    env_reward: float = 0.0
    end: str | None = None
    truncated: bool = False
    routes: list = dataclasses.field(default_factory=list)  # MoE routes, in token order
    covered: int = 0  # input tokens of [prompt][ids] that ``routes`` covers

    def add_routes(self, turn_routes, context: int, new: int) -> None:
        """A turn's routes (``Completion.routes`` of its ``context`` prompt tokens and ``new``
        kept tokens, or None): the part past what earlier turns covered, so each token keeps the
        routes of the first forward that read it (an environment token: the prefill of the
        next turn; the trajectory's tokens are that turn's prompt, no re-tokenisation)."""
        end = context + new - 1
        if turn_routes is not None and end > self.covered:
            self.routes.append(np.asarray(turn_routes)[self.covered : end])
            self.covered = end

    def all_routes(self, prompt_len: int):
        """[prompt_len + len(ids) - 1, L, k] routes, -1 where no turn recorded any; None when
        the sampler recorded none."""
        if not self.routes:
            return None
        r = np.concatenate(self.routes)
        need = prompt_len + len(self.ids) - 1
        pad = np.full((max(need - len(r), 0), *r.shape[1:]), -1, r.dtype)
        return np.concatenate([r, pad])[:need]

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, forced: bool):
        self.ids.extend(int(t) for t in ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.forced.extend([forced] * len(ids))


class MultiTurnSampler:
    """A sampler whose completions are multi-turn rollouts (module docstring).

    Args:
      sampler: the engine (``JaxSampler`` / ``VLLMSampler``; any ``sampling.Sampler``).
      tokenizer: the run's tokenizer (decodes model turns for the environment, encodes
        observations once).
      make_env: a new ``Environment`` per trajectory.
      limits: the rollout's limits.
      num_workers: threads that run environment steps (tool calls) of one turn in parallel.
    """

    def __init__(
        self,
        sampler: Any,
        tokenizer: Any,
        make_env: Callable[[], env_base.Environment],
        limits: TurnLimits,
        *,
        num_workers: int = 2,
        on_close: Callable[[], None] | None = None,
    ):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.limits = limits
        self._pool = ThreadPoolExecutor(max(1, num_workers), thread_name_prefix="jaxrlvr-env")
        self._on_close = on_close
        # New weights wait for the rollouts in flight: every turn of a trajectory is sampled by
        # the weights its first turn had (its ``weight_version``).
        self._lock = threading.Lock()

    # -- the Sampler interface ------------------------------------------------------------------
    def update_weights(self, weights: Any, *, version: int | None = None) -> dict[str, float]:
        with self._lock:
            return self.sampler.update_weights(weights, version=version)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._on_close is not None:
            self._on_close()
        self.sampler.close()

    def __getattr__(self, name):  # the engine's extras (urls, version, batch_multiple, ...)
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling_params: base.SamplingParams,
        *,
        problems: Sequence[Any] | None = None,
    ) -> list[Trajectory]:
        """``n`` rollouts per prompt, flat and prompt-major (``sampling.base.Sampler``);
        ``problems`` (one per prompt) are passed to the environments' ``reset``."""
        with self._lock:
            return self._generate(prompt_token_ids, n, sampling_params, problems)

    def _generate(self, prompt_token_ids, n, sampling_params, problems):
        if sampling_params.thinking_budget is not None:
            raise ValueError("sampler.thinking_budget cannot be combined with env.tools")
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        if problems is not None and len(problems) != len(prompts):
            raise ValueError(f"generate: {len(problems)} problems for {len(prompts)} prompts")
        lim = self.limits
        rollouts = []
        for i, p in enumerate(prompts):
            text = self.tokenizer.decode(p, skip_special_tokens=False)
            for _ in range(n):
                env = self.make_env()
                r = _Rollout(prompt_index=i, env=env)
                opening = env.reset(text, None if problems is None else problems[i])
                if opening:
                    r.append(self._encode(opening), None, forced=True)
                rollouts.append(r)
        params = self._turn_params(sampling_params, rollouts[0].env if rollouts else None)
        active = list(range(len(rollouts)))
        turn = 0
        while active:
            room = max(lim.max_total_tokens - len(rollouts[j].ids) for j in active)
            turn_params = dataclasses.replace(
                params,
                max_tokens=max(1, min(lim.max_tokens_per_turn, room)),
                seed=None if params.seed is None else params.seed + 1_000_003 * turn,
            )
            if turn == 0 and all(not r.ids for r in rollouts):
                # The first turn of every sample of a prompt shares one prefill.
                completions = self.sampler.generate(prompts, n, turn_params)
            else:
                completions = self.sampler.generate(
                    [prompts[rollouts[j].prompt_index] + rollouts[j].ids for j in active],
                    1,
                    turn_params,
                )
            if len(completions) != len(active):
                raise RuntimeError(
                    f"sampler returned {len(completions)} completions for {len(active)} rollouts"
                )
            stepping = []
            for j, c in zip(active, completions):
                r = rollouts[j]
                if r.version is None:  # the oldest weights that produced a token of it
                    r.version = c.weight_version
                ids, lps = list(c.token_ids), list(c.logprobs) if c.logprobs else None
                room = lim.max_total_tokens - len(r.ids)
                cut = len(ids) > room
                if cut:
                    ids, lps = ids[:room], (lps[:room] if lps is not None else None)
                start = len(r.ids)
                r.add_routes(c.routes, len(prompts[r.prompt_index]) + start, len(ids))
                r.append(ids, lps, forced=False)
                r.spans.append((start, len(r.ids)))
                if cut or (c.finish_reason == "length" and len(r.ids) >= lim.max_total_tokens):
                    r.end, r.truncated = "total_tokens", True
                elif c.finish_reason == "length":
                    r.end, r.truncated = "turn_tokens", True
                else:
                    stepping.append((j, self.tokenizer.decode(ids, skip_special_tokens=False)))
            steps = list(self._pool.map(lambda a: rollouts[a[0]].env.step(a[1]), stepping))
            next_active = []
            for (j, _), step in zip(stepping, steps):
                r = rollouts[j]
                r.env_reward += float(step.reward)
                if "tool" in step.info:
                    r.calls += 1
                    r.errors += int(bool(step.info.get("error")))
                    r.tool_seconds += float(step.info.get("seconds", 0.0))
                if step.done or step.observation is None:
                    r.end = "done"
                    continue
                if len(r.spans) >= lim.max_turns:
                    r.end, r.truncated = "max_turns", True
                    continue
                obs = self._encode(step.observation)
                if len(r.ids) + len(obs) >= lim.max_total_tokens:
                    r.end, r.truncated = "total_tokens", True
                    continue
                r.append(obs, None, forced=True)
                next_active.append(j)
            active = next_active
            turn += 1
        for r in rollouts:
            r.env.close()
        want_lp = sampling_params.logprobs
        out = [
            Trajectory(
                prompt_index=r.prompt_index,
                token_ids=r.ids,
                logprobs=r.logprobs if want_lp else [],
                text=self.tokenizer.decode(r.ids, skip_special_tokens=True),
                finish_reason="length" if r.truncated else "stop",
                forced=r.forced,
                weight_version=r.version,
                turns=len(r.spans),
                tool_calls=r.calls,
                tool_errors=r.errors,
                tool_seconds=r.tool_seconds,
                env_reward=r.env_reward,
                end_reason=r.end or "done",
                turn_spans=tuple(r.spans),
                routes=r.all_routes(len(prompts[r.prompt_index])),
            )
            for r in rollouts
        ]
        base.check_prompt_major(out, len(prompts), n)
        return out

    # -- internals ------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _turn_params(self, params: base.SamplingParams, env: Any) -> base.SamplingParams:
        """``params`` with the environment's stop strings added (as stop token ids when one
        token encodes them, which every sampler matches exactly)."""
        stop_ids, stops = list(params.stop_token_ids), list(params.stop)
        for text in getattr(env, "stop", ()):
            ids = self._encode(text)
            if len(ids) == 1:
                stop_ids.append(ids[0]) if ids[0] not in stop_ids else None
            elif text not in stops:
                stops.append(text)
        return dataclasses.replace(params, stop_token_ids=tuple(stop_ids), stop=tuple(stops))


def trajectory_metrics(
    completions: Sequence[base.Completion], prefix: str = ""
) -> dict[str, float]:
    """Per-rollout means of the trajectories' turns, tool calls, tool errors and tool time, and
    the fraction of rollouts that ended for each reason (empty for single-turn completions)."""
    trajs = [c for c in completions if isinstance(c, Trajectory)]
    if not trajs:
        return {}
    k = len(trajs)
    calls = sum(t.tool_calls for t in trajs)
    out = {
        f"{prefix}turns_mean": sum(t.turns for t in trajs) / k,
        f"{prefix}calls_per_rollout": calls / k,
        f"{prefix}errors_per_rollout": sum(t.tool_errors for t in trajs) / k,
        f"{prefix}seconds": sum(t.tool_seconds for t in trajs),
        f"{prefix}seconds_per_call": sum(t.tool_seconds for t in trajs) / max(calls, 1),
        f"{prefix}env_tokens_mean": sum(sum(t.forced or ()) for t in trajs) / k,
    }
    for reason in END_REASONS:
        out[f"{prefix}end/{reason}"] = sum(t.end_reason == reason for t in trajs) / k
    return out
