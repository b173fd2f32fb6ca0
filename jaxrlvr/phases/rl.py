"""The RL phase: sample -> grade -> shape -> prepare -> update -> sync, one step at a time.

The sampler generates ``rl.group_size`` completions per prompt, the grading pool scores them,
``rollout.shape`` builds the host batch of every rollout field (advantages, shaped rewards,
correctness, the sampler's log-probs) in a length bucket, the compiled ``prepare`` places it on
the mesh (the step's one host-to-device transfer) and runs the old / reference / value passes on
device, the compiled, donated ``update`` trains on it, its metrics come back together with
prepare's (the one device-to-host transfer), and the sampler receives the new weights. The
method (GRPO and its variants, PPO, expert iteration) is the record ``methods.make_algorithm``
builds for ``rl.algo``; this phase knows none of their insides.

Everything random is derived from ``run.seed`` and the step number (sampler seeds, data order);
the position (the data order's state and, asynchronously, the batches already generated) is
saved with every checkpoint, so a resumed run ends at the parameters of one never stopped.

With ``rl.max_staleness`` = k > 0 the rollouts are asynchronous (``async_rollouts``): step
t + k's batch is generated, on a background thread, while step t grades and updates; the phase
waits for it before the weight sync. Each batch's version lag (from the versions the sampler
stamps on its completions) is checked against k and logged. k = 0 is the synchronous loop.

Off-policy correction (``algos.importance``, docs/corrections.md): every batch carries the
sampler's log-probs (``Completion.logprobs``, from the JAX sampler and from vLLM alike) as
``sampler_logp``. A stale batch (k > 0, ``rl.behaviour_logprobs``) also gets
``behaviour_logp``, the trainer's log-probs under the version that sampled it: the phase keeps
a copy of the parameters of every version that still has a batch waiting (at most k + 1 copies)
and runs the compiled ``prepare`` a second time with them (one more log-prob pass per step),
so the engine gap (behaviour vs sampler) and the staleness gap (current vs behaviour) are
corrected and reported apart. After a resume the versions of the k batches saved with the
checkpoint are gone: those batches use the current parameters as their behaviour version (the
staleness ratio reads 1) and ``offpolicy/behaviour_exact`` is 0 on those steps.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxrlvr import async_rollouts, builders, distributed, rollout
from jaxrlvr import config as config_lib
from jaxrlvr import metrics as metrics_lib
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import loss_config
from jaxrlvr.algos import step as step_lib
from jaxrlvr.data import iterators, loading, shards
from jaxrlvr.phases import base


def shaping_config(
    cfg: config_lib.TrainConfig, rl_step: int, shards: int = 1
) -> rollout.ShapingConfig:
    """The host shaping of step ``rl_step``; packed row counts are multiples of the update's
    microbatches x ``shards`` (``batch_shards``)."""
    rl = cfg.rl
    overlong = None
    if rl.overlong_cache_len:
        overlong = loss_config.OverlongConfig(
            max_len=cfg.sampler.max_tokens, cache_len=rl.overlong_cache_len
        )
    return rollout.ShapingConfig(
        group_size=rl.group_size,
        advantage=rl.advantage,
        length_reward_weight=(
            rl.length_reward_weight if rl_step >= rl.length_reward_from_step else 0.0
        ),
        overlong=overlong,
        mask_forced_tokens=rl.mask_forced_tokens,
        mask_truncated=rl.loss.mask_truncated,
        drop_zero_variance_groups=rl.drop_zero_variance_groups,
        packing=rl.packing,
        share_prompts=rl.packing and rl.share_prompts,
        max_tokens_per_row=rl.max_tokens_per_row,
        # With a token budget (microbatches 1) ``RLPhase.fit_budget`` sets the final row count.
        row_multiple=rl.microbatches * shards,
    )


class RLPhase(base.RLStepsPhase):
    name = "rl"
    algorithm_phase = "rl"
    reward_metric = "reward_mean"
    samples_train_prompts = True

    def __init__(self, ctx: base.RunContext):
        super().__init__(ctx)
        self.iterator = self.make_iterator()
        self.producer = None
        if self.cfg.rl.max_staleness > 0:
            self.producer = async_rollouts.RolloutProducer(
                self._rollout_job, self.cfg.rl.max_staleness
            )
        # Parameter copies by version, for the behaviour log-probs of stale batches.
        self._versions: dict[int, object] = {}

    def enter(self, params, rng) -> None:
        super().enter(params, rng)
        # The phase's records by microbatch count (``compiled_for``): the configured one now.
        self._compiled = {self.algorithm.rollout_spec.num_microbatches: self.compiled}

    def compiled_for(self, microbatches: int | None = None) -> step_lib.CompiledAlgorithm:
        """The phase's prepare/update compiled for ``microbatches`` (default: the configured
        count). A token budget picks the count per step from a few buckets; each count's record
        is built on first use and kept, and all of them share ``self.state``: the count changes
        how a batch is cut, not the state's shapes or shardings."""
        if microbatches is None:
            return self.compiled
        if microbatches not in self._compiled:
            self._compiled[microbatches] = step_lib.CompiledAlgorithm(
                self.make_algorithm(microbatches), self.ctx.mesh, self.shardings
            )
        return self._compiled[microbatches]

    def make_iterator(self):
        cfg, ctx = self.cfg, self.ctx
        cls = iterators.CurriculumPromptIterator if cfg.rl.curriculum else iterators.PromptIterator
        if ctx.num_shards == 1:
            return cls(ctx.train_problems, cfg.rl.prompts_per_step, seed=cfg.run.seed)
        per_shard = cfg.rl.prompts_per_step // ctx.num_shards
        return shards.ShardedIterator(
            ctx.train_shards,
            lambda items, seed: cls(items, per_shard, seed=seed),
            seed=cfg.run.seed,
            gather=distributed.allgather_json,
        )

    def state_dict(self):
        # First the producer: the batch in flight finishes and is saved too.
        rollouts = self.producer.state_dict() if self.producer is not None else None
        return {"data": self.iterator.state_dict(), "rollouts": rollouts}

    def load_state_dict(self, state) -> None:
        if state.get("data") is not None:
            self.iterator.load_state_dict(state["data"])
        if self.producer is not None and state.get("rollouts") is not None:
            self.producer.load_state_dict(state["rollouts"])

    def begin(self) -> None:
        # Version = updates applied so far: the versions the completions carry.
        self.ctx.sampler.update_weights(self.sampler_weights(), version=self.position)

    def step(self) -> dict[str, float]:
        return self.rl_step()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()

    def sampler_generate(self, problems, prompts, n, params):
        """The sampler's ``n`` completions of each prompt (the tool-use phase also hands the
        problems to its environments)."""
        return self.ctx.sampler.generate(prompts, n, params)

    def _generate(self, problems, n, seed):
        ctx = self.ctx
        prompts = ctx.encode_prompts(problems)
        if self.cfg.sampler.kind != "jax":  # vLLM seeds prompt i with seed + i: global index
            seed += ctx.row_block[0] * len(problems)
        params = builders.sampling_params(self.cfg, ctx.tokenizer, seed=seed)
        completions = self.sampler_generate(problems, prompts, n, params)
        if len(completions) != len(prompts) * n:
            raise RuntimeError(
                f"sampler returned {len(completions)} completions for {len(prompts)} x {n}"
            )
        return prompts, completions

    def _grade(self, problems, completions, n):
        return self.ctx.grade(problems, [c.text for c in completions], n)

    def draw(self) -> list[loading.Problem]:
        """The next step's problems from the data order (twice as many candidates with the
        difficulty filter)."""
        problems = self.iterator.next_batch()
        if self.cfg.rl.difficulty_filter:
            problems = problems + self.iterator.next_batch()
        return problems

    def step_seed(self, rl_step: int) -> int:
        return self.cfg.run.seed * 1_000_003 + rl_step

    def sample(self, step_seed: int, drawn: list[loading.Problem] | None = None):
        """The step's prompts and their completions (with the difficulty filter: keep the prompts
        the policy solves sometimes); ``drawn``: the problems ``draw`` returned (default: draw)."""
        rl = self.cfg.rl
        problems, m = (self.draw() if drawn is None else drawn), {}
        if rl.difficulty_filter:
            candidates = problems
            k = rl.difficulty_filter_k
            _, comps = self._generate(candidates, k, step_seed + 104729)
            scores, _ = self._grade(candidates, comps, k)
            rates = np.asarray([s["answer_reward"] for s in scores]).reshape(-1, k).mean(1)
            informative = [p for p, r in zip(candidates, rates) if 0 < r < 1]
            rest = [p for p, r in zip(candidates, rates) if not 0 < r < 1]
            problems = (informative + rest)[: len(candidates) // 2]
            m["filter/informative_fraction"] = len(informative) / len(candidates)
        prompts, completions = self._generate(problems, rl.group_size, step_seed)
        return problems, prompts, completions, m

    def _rollout_job(self, rl_step: int):
        """The producer's work for ``rl_step``: the problems are drawn now (on the trainer's
        thread, in step order), the sampling runs when the returned job is called."""
        drawn = self.draw()
        seed = self.step_seed(rl_step)

        def job() -> async_rollouts.Rollouts:
            problems, prompts, completions, m = self.sample(seed, drawn)
            return async_rollouts.Rollouts(rl_step, problems, prompts, completions, m)

        return job

    def grade(self, problems, completions):
        scores, stats = self._grade(problems, completions, self.cfg.rl.group_size)
        if self.cfg.rl.curriculum:  # a CurriculumPromptIterator (one per data shard)
            g = self.cfg.rl.group_size
            self.iterator.update(
                [p.id for p in problems for _ in range(g)], [s["answer_reward"] for s in scores]
            )
        return scores, stats

    def shape(self, prompts, completions, scores):
        return rollout.shape(
            prompts,
            completions,
            scores,
            shaping_config(self.cfg, self.position, builders.batch_shards(self.ctx.mesh)),
            pad_id=self.ctx.pad_id,
            max_length=self.ctx.model_cfg.max_position_embeddings,
        )

    def fit_budget(self, rollouts):
        """(rollouts, microbatches) of the step: with ``rl.max_tokens_per_microbatch``, the
        packed rows trimmed of their all-padding tail and padded again with all-padding rows to
        the row count that ``rollout.budget_rows`` chooses with the count; without, unchanged,
        in ``rl.microbatches``. Multi-process: the count is chosen from the processes' common
        share shape (``step.agree_local_shapes``), so every process runs the same program."""
        rl = self.cfg.rl
        if rl.max_tokens_per_microbatch is None:
            return rollouts, rl.microbatches
        used = max(rollout.used_rows(rollouts), 1)
        rollouts = jax.tree.map(lambda x: np.asarray(x)[:used], rollouts)
        blocks = 1
        if self.compiled.local_rows:
            rollouts = step_lib.agree_local_shapes(rollouts)
            blocks = self.ctx.row_block[1]
        rows, length = np.shape(rollouts.input_ids)
        total, n = rollout.budget_rows(
            rows * blocks,
            length,
            rl.max_tokens_per_microbatch,
            shards=builders.batch_shards(self.ctx.mesh),
            key="rl.max_tokens_per_microbatch",
        )
        # Rows per microbatch are a multiple of the batch shards, so of the process blocks too.
        return step_lib.pad_rows(rollouts, total // blocks, length), n

    def prepare(self, rollouts, microbatches: int | None = None, version: int | None = None):
        """The compiled ``prepare`` of the step's rollouts; with ``version`` (the weight version
        that sampled a stale batch) the batch of a record that reads ``behaviour_logp`` (GRPO,
        PPO) also gets it: the same pass run with that version's kept parameters (module
        docstring)."""
        compiled = self.compiled_for(microbatches)
        fields = algorithm_lib.select_fields(rollouts, compiled.algorithm.rollout_spec)
        batch, metrics = compiled.prepare(self.state, fields)
        spec = compiled.algorithm.batch_spec
        if version is not None and "behaviour_logp" in spec.required + spec.optional:
            metrics = dict(metrics)
            params = self._versions.get(version)
            exact = params is not None or version == self.position
            if params is not None and version != self.position:
                behaviour, _ = compiled.prepare(self.state.replace(params=params), fields)
                batch = batch.replace(behaviour_logp=behaviour.old_logp)
            else:  # the current version sampled it, or its parameters are gone (resume)
                batch = batch.replace(behaviour_logp=batch.old_logp)
            metrics["offpolicy/behaviour_exact"] = float(exact)
        return jax.block_until_ready(batch), metrics

    def keep_version(self) -> None:
        """Before the update: keep a copy of the current parameters (version ``position``) while a
        batch it samples is still to be trained, and drop the versions no batch needs any more
        (pending batches of steps t + 1 .. t + k come from versions >= t + 1 - k)."""
        t, k = self.position, self.cfg.rl.max_staleness
        if not (k > 0 and self.cfg.rl.behaviour_logprobs):
            return
        oldest = max(0, t + 1 - k)
        self._versions = {v: p for v, p in self._versions.items() if v >= oldest}
        if t + 1 < self.cfg.rl.steps and t not in self._versions:
            self._versions[t] = jax.tree.map(lambda x: x.copy(), self.state.params)

    def update(self, batch, microbatches: int | None = None):
        # One call per step: the record runs its epochs (rl.epochs_per_step) itself.
        self.state, metrics = self.compiled_for(microbatches).update(self.state, batch)
        return metrics

    def sampler_weights(self):
        """The policy parameters to hand to the sampler. The update donates the state's
        buffers; with ``rl.max_staleness`` > 0 the producer thread may still start a generation
        on the previous weights after the next update has begun, so a JAX sampler that shares
        the trainer's devices gets its own copy (one parameter set of memory) instead of the
        state's buffers, which the donation deletes. A sampler on a sub-mesh of its own
        (``sampler.jax_devices``) copies in ``update_weights``, and a vLLM export reads the
        weights to the host before it returns."""
        s = self.cfg.sampler
        if self.cfg.rl.max_staleness > 0 and s.kind == "jax" and s.jax_devices == 0:
            return jax.tree.map(lambda x: x.copy(), self.state.params)
        return self.state.params

    def sync(self):
        return self.ctx.sampler.update_weights(self.sampler_weights(), version=self.position + 1)

    def rl_step(self) -> dict[str, float]:
        start = time.perf_counter()
        timer = metrics_lib.PhaseTimer()
        t, k = self.position, self.cfg.rl.max_staleness
        async_m: dict[str, float] = {}
        version = None
        if k == 0:
            with timer.phase("sample"):
                problems, prompts, completions, filter_m = self.sample(self.step_seed(t))
        else:
            # async_rollouts: generate step t + k (weights of version t) while this step trains.
            with timer.phase("sample"):  # only the first k steps of a run generate here
                self.producer.fill(t, self.cfg.rl.steps)
            if t + k < self.cfg.rl.steps:
                self.producer.submit(t + k)
            ro = self.producer.pop(t)
            problems, prompts, completions, filter_m = (
                ro.problems,
                ro.prompts,
                ro.completions,
                ro.metrics,
            )
            if self.cfg.rl.behaviour_logprobs:
                version = ro.version
            async_m = {
                "async/staleness": float(async_rollouts.check_lag(ro, t, k)),
                "async/rollout_version": float(ro.version),
                "time/generate_s": ro.generate_s,
            }
        with timer.phase("reward"):
            scores, grading_stats = self.grade(problems, completions)
        with timer.phase("shape"):
            rollouts, out = self.shape(prompts, completions, scores)
            rollouts, microbatches = self.fit_budget(rollouts)
        out["tokens/microbatches"] = microbatches
        if self.cfg.rl.max_tokens_per_microbatch is not None:  # the rows fit_budget chose
            out["tokens/batch_shape_B"] = int(np.shape(rollouts.input_ids)[0])
            out["tokens/padding_fraction"] = 1.0 - float(np.mean(rollouts.attention_mask))
        with timer.phase("logprobs"):
            batch, prepare_m = self.prepare(rollouts, microbatches, version=version)
            self.keep_version()
        with timer.phase("update"):
            update_m = self.update(batch, microbatches)
            update_m, prepare_m = jax.device_get((update_m, prepare_m))
        if k:
            # The one place the trainer waits for rollouts: step t + k's batch must be finished by
            # version t before the sampler moves to version t + 1.
            with timer.phase("wait_rollouts"):
                self.producer.wait()
        with timer.phase("sync"):
            sync = self.sync()
        self.position += 1

        out.update({k: float(v) for k, v in {**prepare_m, **update_m}.items()})
        # The update measures the sampler/trainer log-prob gap at rollout time (its off-policy
        # diagnostics); logged under the dashboard's name as well.
        if "logp_diff_abs" in out:
            out["sampler_trainer_logprob_gap_mean"] = out["logp_diff_abs"]
            out["sampler_trainer_logprob_gap_max"] = out["logp_diff_abs_max"]
        out.update(filter_m)
        out.update(grading_stats.as_metrics())
        out.update({f"sync/{k}": float(v) for k, v in (sync or {}).items()})
        seconds = timer.seconds
        out.update(timer.collect())
        out.update(async_m)
        out["throughput/sample_tokens_per_s"] = out["tokens/response"] / max(
            async_m.get("time/generate_s", seconds.get("sample", 0.0)), 1e-9
        )
        out["throughput/update_tokens_per_s"] = (
            out.pop("tokens/attended") * self.cfg.rl.epochs_per_step
        ) / max(seconds.get("update", 0.0), 1e-9)
        out["time/step_s"] = time.perf_counter() - start  # the phases and the host work between
        # Multi-process: over every process's rollouts; the outcome-conditional lengths are
        # weighted by each process's count of correct / incorrect completions.
        right = out.get("accuracy", 0.0) * len(completions)
        return distributed.reduce_metrics(
            out,
            weights={
                "response_length_correct_mean": right,
                "response_length_incorrect_mean": len(completions) - right,
            },
        )
