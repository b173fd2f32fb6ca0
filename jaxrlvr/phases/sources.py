"""Rollout sources of the RL phase: where a step's graded rollouts come from.

A source draws the step's problems from the data order (with the difficulty filter twice as
many candidates), samples ``rl.group_size`` completions per prompt, grades them, feeds the
curriculum, and, with ``rl.max_staleness`` = k > 0, produces the batches k steps ahead on a
background thread (``phases.producer``), checking each batch's weight version against k. It
hands the learner (``phases.learner``) a ``GradedRollouts`` and knows nothing of losses; it also
owns the sampler's weights (``sync``: which copy of the parameters the sampler may keep).

Two sources share this interface: ``RolloutSource`` (one completion per sample: the RL phase's)
and ``MultiTurnSource`` (a multi-turn tool-use trajectory per sample: the tool phase's), whose
environments get the problems, whose environment rewards add to the verifier's and whose
trajectories add their own metrics.

Everything random is derived from ``run.seed`` and the step number, so a source resumed from its
``state_dict`` produces the batches of one never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrlvr import config as config_lib
from jaxrlvr import distributed, prompts
from jaxrlvr import metrics as metrics_lib
from jaxrlvr.data import iterators, loading, shards
from jaxrlvr.envs import multi_turn
from jaxrlvr.phases import base, producer
from jaxrlvr.rewards import grading
from jaxrlvr.sampling import base as sampling_base


@dataclasses.dataclass
class GradedRollouts:
    """One step's rollouts as the learner receives them.

    Attributes:
      prompts: the prompts' token ids; completions: ``group_size`` per prompt, prompt-major.
      scores: the grader's scores of each completion (``reward``, ``answer_reward``, ...).
      metrics: the source's metrics of the step (filter, grading, async lag, tool use).
      version: the weight version that sampled the batch when the learner needs its behaviour
        log-probs (stale batches with ``rl.behaviour_logprobs``), else None.
      generate_s: seconds the asynchronous generation took (None: sampled in the step).
      fields: the rollout passes' host fields (``passes.RolloutPass.host``): ``Batch`` field
        name -> per completion an array [L] or [L, K] over its tokens (``rollout.shape`` lays
        them out).
    """

    prompts: list[list[int]]
    completions: list[sampling_base.Completion]
    scores: list[dict[str, float]]
    metrics: dict[str, float]
    version: int | None = None
    generate_s: float | None = None
    fields: dict[str, list[np.ndarray]] = dataclasses.field(default_factory=dict)


def solved_problems(problems, scores, group_size: int, threshold: float) -> list[str]:
    """No-Positive-Resampling (ScaleRL): the ids of the problems whose group of ``group_size``
    completions (``scores`` prompt-major) passes at a rate (mean ``answer_reward``) of at least
    ``threshold``; ``rl.retire_pass_rate`` takes them out of the pool for good."""
    rates = np.asarray([s["answer_reward"] for s in scores], np.float64).reshape(-1, group_size)
    if len(rates) != len(problems):
        raise ValueError(f"{len(scores)} scores are not {len(problems)} groups of {group_size}")
    return [p.id for p, r in zip(problems, rates.mean(1)) if r >= threshold]


class RolloutSource:
    """Single-turn rollouts of the training problems (module docstring).

    Args:
      ctx: the run (sampler, grader, data shards, prompt rendering).
      rl, sampler, seed: the ``rl`` and ``sampler`` sections and ``run.seed``.
    """

    completion_cls: type[sampling_base.Completion] = sampling_base.Completion

    def __init__(
        self,
        ctx: base.RunContext,
        rl: config_lib.RLSection,
        sampler: config_lib.SamplerSection,
        seed: int,
    ):
        self.ctx, self.rl, self.sampler_cfg, self.seed = ctx, rl, sampler, seed
        self.iterator = self.make_iterator()
        self.producer = None
        if rl.max_staleness > 0:
            self.producer = producer.RolloutProducer(
                self._rollout_job, rl.max_staleness, completion_cls=self.completion_cls
            )

    def make_iterator(self):
        ctx, rl = self.ctx, self.rl
        cls = iterators.CurriculumPromptIterator if rl.curriculum else iterators.PromptIterator
        if ctx.num_shards == 1:
            return cls(ctx.train_problems, rl.prompts_per_step, seed=self.seed)
        per_shard = rl.prompts_per_step // ctx.num_shards
        return shards.ShardedIterator(
            ctx.train_shards,
            lambda items, seed: cls(items, per_shard, seed=seed),
            seed=self.seed,
            gather=distributed.allgather_json,
        )

    # -- position ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # First the producer: the batch in flight finishes and is saved too.
        rollouts = self.producer.state_dict() if self.producer is not None else None
        return {"data": self.iterator.state_dict(), "rollouts": rollouts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("data") is not None:
            self.iterator.load_state_dict(state["data"])
        if self.producer is not None and state.get("rollouts") is not None:
            self.producer.load_state_dict(state["rollouts"])

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()

    # -- sampling ---------------------------------------------------------------------------------
    def generate(self, problems, prompt_ids, n, params) -> list[sampling_base.Completion]:
        """The sampler's ``n`` completions of each prompt."""
        return self.ctx.sampler.generate(prompt_ids, n, params)

    def _first(self, problems) -> int:
        """The index of this process's first problem among every process's of the step (the
        shares are equal: one per row block), for ``RunContext.sample``'s seeding rule."""
        return self.ctx.row_block[0] * len(problems)

    def score(self, problems, completions, n) -> tuple[list[dict], grading.GradingStats]:
        """The grader's scores of ``n`` completions per problem."""
        return self.ctx.grader.grade(problems, [c.text for c in completions], n)

    def draw(self) -> list[loading.Problem]:
        """The next step's problems from the data order (twice as many candidates with the
        difficulty filter)."""
        problems = self.iterator.next_batch()
        if self.rl.difficulty_filter:
            problems = problems + self.iterator.next_batch()
        return problems

    def first_calls(self) -> list[tuple[list[loading.Problem], int]]:
        """(problems, samples per problem) of the sampler calls of the source's next step, as
        the data order will draw them (the iterator is put back): what the run compiles ahead
        (``RunContext.compile_ahead``). With the difficulty filter, the rollouts' problems are
        the ones the filter keeps, unknown before: the first half of the candidates stands in
        for them. None with several data shards (a multi-process job compiles nothing ahead)."""
        if self.ctx.num_shards != 1:
            return []
        state = self.iterator.state_dict()
        try:
            problems = self.draw()
        finally:
            self.iterator.load_state_dict(state)
        calls = []
        if self.rl.difficulty_filter:
            calls.append((problems, self.rl.difficulty_filter_k))
            problems = problems[: len(problems) // 2]
        return [*calls, (problems, self.rl.group_size)]

    def step_seed(self, rl_step: int) -> int:
        return self.seed * 1_000_003 + rl_step

    def sample(self, step_seed: int, drawn: list[loading.Problem] | None = None):
        """The step's problems, prompts and completions, and the sampling's metrics (with the
        difficulty filter: keep the prompts the policy solves sometimes); ``drawn``: the problems
        ``draw`` returned (default: draw now)."""
        rl = self.rl
        problems, m = (self.draw() if drawn is None else drawn), {}
        if rl.difficulty_filter:
            candidates = problems
            k = rl.difficulty_filter_k
            *_, scores, _ = self.ctx.sample_and_grade(
                candidates,
                k,
                self.sampler_cfg,
                seed=step_seed + 104729,
                first=self._first(candidates),
                generate=self.generate,
                score=self.score,
            )
            rates = np.asarray([s["answer_reward"] for s in scores]).reshape(-1, k).mean(1)
            informative = [p for p, r in zip(candidates, rates) if 0 < r < 1]
            rest = [p for p, r in zip(candidates, rates) if not 0 < r < 1]
            problems = (informative + rest)[: len(candidates) // 2]
            m["filter/informative_fraction"] = len(informative) / len(candidates)
        prompt_ids, completions = self.ctx.sample(
            problems,
            rl.group_size,
            self.sampler_cfg,
            seed=step_seed,
            first=self._first(problems),
            generate=self.generate,
        )
        return problems, prompt_ids, completions, m

    def _rollout_job(self, rl_step: int):
        """The producer's work for ``rl_step``: the problems are drawn now (on the trainer's
        thread, in step order), the sampling runs when the returned job is called."""
        drawn = self.draw()
        seed = self.step_seed(rl_step)

        def job() -> producer.Rollouts:
            problems, prompt_ids, completions, m = self.sample(seed, drawn)
            return producer.Rollouts(rl_step, problems, prompt_ids, completions, m)

        return job

    def grade(self, problems, completions):
        """The step's scores; feeds the curriculum (one ``CurriculumPromptIterator`` per data
        shard) with each problem's answer rewards."""
        scores, stats = self.score(problems, completions, self.rl.group_size)
        g = self.rl.group_size
        if self.rl.curriculum:
            self.iterator.update(
                [p.id for p in problems for _ in range(g)], [s["answer_reward"] for s in scores]
            )
        if self.rl.retire_pass_rate is not None:
            # Each process retires the problems it drew, which its own data shards hold.
            self.iterator.retire(solved_problems(problems, scores, g, self.rl.retire_pass_rate))
        return scores, stats

    # -- the step ---------------------------------------------------------------------------------
    def rollouts(self, t: int, total_steps: int, timer: metrics_lib.PhaseTimer) -> GradedRollouts:
        """Step ``t``'s graded rollouts: sampled now (k = 0), or taken from the producer, which
        then starts on step t + k with the sampler's current weights (version t)."""
        k = self.rl.max_staleness
        version, generate_s, m = None, None, {}
        if k == 0:
            with timer.phase("sample"):
                problems, prompt_ids, completions, sample_m = self.sample(self.step_seed(t))
        else:
            with timer.phase("sample"):  # only the first k steps of a run generate here
                self.producer.fill(t, total_steps)
            if t + k < total_steps:
                self.producer.submit(t + k)
            ro = self.producer.pop(t)
            problems, prompt_ids, completions, sample_m = (
                ro.problems,
                ro.prompts,
                ro.completions,
                ro.metrics,
            )
            if self.rl.behaviour_logprobs:
                version = ro.version
            generate_s = ro.generate_s
            m = {
                "async/staleness": float(producer.check_lag(ro, t, k)),
                "async/rollout_version": float(ro.version),
                "time/generate_s": ro.generate_s,
            }
        with timer.phase("reward"):
            scores, grading_stats = self.grade(problems, completions)
        fields, pass_m = self._host_passes(problems, prompt_ids, completions, timer)
        metrics = {**sample_m, **grading_stats.as_metrics(), **m, **pass_m}
        if self.rl.retire_pass_rate is not None:
            metrics["data/retired"] = float(self.iterator.num_retired)
        return GradedRollouts(prompt_ids, completions, scores, metrics, version, generate_s, fields)

    def _host_passes(self, problems, prompt_ids, completions, timer=None):
        """(fields, metrics) of each rollout pass's host part (teacher scores, route checks)."""
        fields, metrics = {}, {}
        for p in self.ctx.passes:
            timed = timer is not None and p.timed_on_host
            with timer.phase(p.name) if timed else contextlib.nullcontext():
                f, pm = p.host(problems, prompt_ids, completions)
            fields.update(f)
            metrics.update(pm)
        return fields, metrics

    def stand_in(self, answers: Callable[[loading.Problem, bool], str]) -> GradedRollouts | None:
        """A stand-in of the next step's graded rollouts, for compiling the learner's programs
        for their shapes ahead of the step (``RLPhase.programs_ahead``): the problems
        ``first_calls`` says the step will sample, each group's completions alternating
        ``answers(problem, True)`` and ``answers(problem, False)`` (the phase's guess: what an
        SFT warm start teaches, right and wrong, so the groups' rewards vary as real ones do),
        at most ``sampler.max_tokens`` each, built by the sampler's ``stand_in`` with the
        fields its completions carry, graded and through the passes' host parts like a real
        step's. Nothing is sampled and nothing the run draws from (data order, seeds,
        curriculum) moves. None where the sampler or a pass cannot stand in (vLLM; a
        teacher's scores, r2 replay: ``RolloutPass.can_stand_in``) or nothing is compiled ahead
        (several data shards)."""
        stand_in = getattr(self.ctx.sampler, "stand_in", None)
        if stand_in is None or not all(p.can_stand_in for p in self.ctx.passes):
            return None
        calls = self.first_calls()
        if not calls:
            return None
        problems, n = calls[-1]
        tok = self.ctx.tokenizer
        prompt_ids = self.ctx.encode_prompts(problems)
        texts = [answers(p, j % 2 == 0) for p in problems for j in range(n)]
        ids = [t[: self.sampler_cfg.max_tokens] for t in prompts.encode_many(tok, texts)]
        params = prompts.sampling_params(self.sampler_cfg, tok, eval_mode=False, seed=0)
        completions = stand_in(prompt_ids, ids, params)
        scores, _ = self.score(problems, completions, n)
        fields, _ = self._host_passes(problems, prompt_ids, completions)
        return GradedRollouts(prompt_ids, completions, scores, {}, fields=fields)

    def wait(self, timer: metrics_lib.PhaseTimer) -> None:
        """The one place the trainer waits for rollouts: step t + k's batch must be finished by
        version t before the sampler moves to version t + 1."""
        if self.producer is not None:
            with timer.phase("wait_rollouts"):
                self.producer.wait()

    # -- the sampler's weights --------------------------------------------------------------------
    def sampler_weights(self, params):
        """The policy parameters to hand to the sampler. The update donates the state's
        buffers; with ``rl.max_staleness`` > 0 the producer thread may still start a generation
        on the previous weights after the next update has begun, so a JAX sampler that shares
        the trainer's devices gets its own copy (one parameter set of memory) instead of the
        state's buffers, which the donation deletes. A sampler on a sub-mesh of its own
        (``sampler.jax_devices``) copies in ``update_weights``, and a vLLM export reads the
        weights to the host before it returns."""
        s = self.sampler_cfg
        if self.rl.max_staleness > 0 and s.kind == "jax" and s.jax_devices == 0:
            return jax.tree.map(lambda x: x.copy(), params)
        return params

    def sync(self, params, version: int):
        """Hands the sampler the weights of ``version`` (updates applied so far); its metrics."""
        return self.ctx.sampler.update_weights(self.sampler_weights(params), version=version)


class MultiTurnSource(RolloutSource):
    """Multi-turn tool-use rollouts (the run's sampler is an ``envs.MultiTurnSampler``): a
    sample is a trajectory of model turns and tool outputs, stored as one completion whose tool
    tokens are flagged as not sampled. The environments get the problems at reset, their step
    rewards add to the verifier's, and the step's metrics carry turns, tool calls, tool errors
    and time, and how rollouts ended (``tool/...``)."""

    completion_cls = multi_turn.Trajectory

    def generate(self, problems, prompt_ids, n, params):
        return self.ctx.sampler.generate(prompt_ids, n, params, problems=problems)

    def first_calls(self):
        """None: a trajectory's turns are separate calls of shapes known only as it runs."""
        return []

    def score(self, problems, completions, n):
        scores, stats = super().score(problems, completions, n)
        for s, c in zip(scores, completions):
            if c.env_reward:
                s["reward"] = s["reward"] + c.env_reward
        return scores, stats

    def sample(self, step_seed, drawn=None):
        problems, prompt_ids, completions, m = super().sample(step_seed, drawn)
        m = {**m, **multi_turn.trajectory_metrics(completions, prefix="tool/")}
        return problems, prompt_ids, completions, m
