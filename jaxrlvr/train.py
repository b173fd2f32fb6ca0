"""The driver: SFT warm start, then the RL loop, eval, checkpoints, export.

The driver knows no algorithm's insides. ``make_algorithm`` maps the config to an
``algos.algorithm.Algorithm`` record (SFT, GRPO and its variants, PPO, expert iteration), and one
RL step reads

    sample -> grade -> shape -> prepare -> update -> sync

each a named method: the sampler generates ``rl.group_size`` completions per prompt, the grading
pool scores them, ``rollout.shape`` builds the host batch of every rollout field (advantages,
shaped rewards, correctness, the sampler's log-probs) in a length bucket, the compiled
``prepare`` places it on the mesh (the step's one host-to-device transfer) and runs the
old / reference / value passes on device, the compiled, donated ``update`` runs
``rl.epochs_per_step`` times, its metrics come back together with prepare's (the one
device-to-host transfer), and the sampler receives the new weights.

Everything random is derived from ``run.seed`` and the step number (sampler seeds, data order), and
every checkpoint holds the train state, the data position and the loop counters, so a run killed
at any point and resumed with ``--resume`` ends with the same parameters as one never killed.
SIGTERM (a scheduler's preemption) saves a checkpoint between steps and ends the run cleanly.

With ``rl.max_staleness`` = k > 0 the rollouts are asynchronous (``async_rollouts``): step
t + k's batch is generated, on a background thread, while step t grades and updates; the trainer
waits for it before the weight sync. Each batch's version lag (from the versions the sampler
stamps on its completions) is checked against k and logged, and the generated but untrained
batches are saved with every checkpoint. k = 0 is the synchronous loop, unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from typing import Any

import jax
import numpy as np
import yaml
from flax import nnx

from jaxrlvr import (
    async_rollouts,
    builders,
    configlib,
    distributed,
    interrupt,
    methods,
    placement,
    preflight,
    rollout,
)
from jaxrlvr import checkpoint as checkpoint_lib
from jaxrlvr import config as config_lib
from jaxrlvr import metrics as metrics_lib
from jaxrlvr import model as model_lib
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import loss_config, preference
from jaxrlvr.algos import step as step_lib
from jaxrlvr.data import iterators, loading, shards, templates

log = builders.log


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
        max_tokens_per_row=rl.max_tokens_per_row,
        # With a token budget (microbatches 1) ``Trainer.fit_budget`` sets the final row count.
        row_multiple=rl.microbatches * shards,
    )


def _nan_to_none(x):
    """``x`` (nested dicts/lists) with NaN floats as None: JSON-safe checkpoint side-cars."""
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_nan_to_none(v) for v in x]
    return None if isinstance(x, float) and x != x else x


# ----------------------------------------------------------------------------------------------
# Evaluation


def evaluate(
    cfg, sampler, tokenizer, problems, pool, reward_fn, *, block=(0, 1)
) -> dict[str, float]:
    """Held-out metrics of the first ``eval.max_problems`` problems. In a multi-process job
    (``block``: this process's row block of ``step.process_row_block``) each process samples and
    grades its contiguous share and the metrics are reduced over the processes."""
    problems = problems[: cfg.eval.max_problems]
    if not problems:
        return {}
    first = 0
    if block[1] > 1:
        first = len(problems) * block[0] // block[1]
        problems = problems[first : len(problems) * (block[0] + 1) // block[1]]
    n = cfg.eval.samples_per_problem
    prompts = [builders.encode(tokenizer, builders.render(cfg, p, tokenizer)) for p in problems]
    # vLLM seeds prompt i with seed + i: offset by the share's first prompt (the JAX sampler
    # runs one program over all processes' rows, with one seed).
    offset = first if cfg.sampler.kind != "jax" else 0
    params = builders.sampling_params(
        cfg, tokenizer, eval_mode=True, seed=cfg.run.seed + 7919 + offset
    )
    completions = sampler.generate(prompts, n, params)
    truths = [p.answer for p in problems for _ in range(n)]
    scores, _ = pool.grade(reward_fn, [c.text for c in completions], truths)
    lengths = [len(c.token_ids) for c in completions]
    if block[1] > 1:  # every share's per-completion values, one share per block, in order
        keys = ("answer_reward", "format_reward", "reward")
        mine = [block[0], [[s[k] for k in keys] for s in scores], lengths]
        parts = {b: (rows, lens) for b, rows, lens in distributed.allgather_json(mine)}
        scores = [dict(zip(keys, row)) for b in sorted(parts) for row in parts[b][0]]
        lengths = [x for b in sorted(parts) for x in parts[b][1]]
    return {
        "eval/accuracy": float(np.mean([s["answer_reward"] for s in scores])),
        "eval/format_rate": float(np.mean([s["format_reward"] for s in scores])),
        "eval/reward_mean": float(np.mean([s["reward"] for s in scores])),
        "eval/response_length_mean": float(np.mean(lengths)),
        **metrics_lib.length_by_outcome(
            lengths, [s["answer_reward"] for s in scores], prefix="eval/"
        ),
        "eval/n": len(scores) // n,
        "eval/samples_per_problem": n,
    }


# ----------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class LoopState:
    """Host-side counters saved with every checkpoint (JSON)."""

    phase: str = "sft"  # "sft" | "rl" | "done"
    sft_step: int = 0
    rl_step: int = 0
    data: dict | None = None
    eval_history: list = dataclasses.field(default_factory=list)
    eval_after_sft: dict | None = None
    # rl.max_staleness > 0: the batches generated for the steps after this one (RolloutProducer).
    rollouts: dict | None = None


class Trainer:
    """Holds the run's components; ``run()`` drives the phases."""

    def __init__(self, cfg: config_lib.TrainConfig, *, resume: bool = False):
        self.cfg = cfg
        self.run_dir = cfg.run.out_dir
        os.makedirs(self.run_dir, exist_ok=True)
        # GPUs for the vLLM servers and for JAX, set before JAX's backend starts (placement).
        self.placement = placement.place_trainer(cfg.sampler)
        distributed.initialize(cfg.distributed)
        placement.check_jax_devices(self.placement)
        self.mesh = model_lib.make_mesh(cfg.mesh, builders.device_split(cfg)[0])
        builders.check_microbatches_fit_mesh(cfg, self.mesh)
        self.tokenizer = builders.build_tokenizer(cfg)
        self.pad_id = self.tokenizer.pad_token_id
        model = builders.build_model(cfg, self.tokenizer, self.mesh)
        self.model_cfg = model.config
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.params_shape = jax.eval_shape(lambda p: p, params)
        self.train_problems, self.eval_problems = builders.load_splits(cfg)
        # Multi-process: this process keeps only the training rows of its data shards.
        self.row_block = step_lib.process_row_block(self.mesh)
        self.num_shards, owned = builders.data_shards(cfg, self.mesh)
        split = shards.split(self.train_problems, self.num_shards, cfg.run.seed)
        self.train_shards = {i: split[i] for i in owned}
        self.train_problems = [p for i in owned for p in split[i]]
        self.reward_fn, self.pool = builders.build_grader(cfg)
        self.loop = LoopState(phase="sft" if cfg.sft.steps > 0 else "rl")
        self.ckpt = checkpoint_lib.Checkpointer(
            os.path.join(self.run_dir, "checkpoints"), keep=cfg.checkpoint.keep
        )
        self._enter_phase(self.loop.phase, params, jax.random.PRNGKey(cfg.run.seed))
        if resume:
            self._restore()
        elif jax.process_index() == 0:
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(config_lib.config_to_dict(cfg), f, sort_keys=False)
        self.iterator = self._make_iterator()
        if self.loop.data is not None:
            self.iterator.load_state_dict(self.loop.data)
        self.producer = None
        if cfg.rl.max_staleness > 0:
            self.producer = async_rollouts.RolloutProducer(self._rollout_job, cfg.rl.max_staleness)
            if self.loop.rollouts is not None:
                self.producer.load_state_dict(self.loop.rollouts)
        self._grade_lock = threading.Lock()  # the grading pool serves one call at a time
        self._sampler = None
        self._pref_iter = None  # the preference phase's pair order (``preference_step``)
        self._last_accuracy = None
        self.metrics = None
        # Multi-host: every process runs the same loop; only process 0 writes the run's files.
        if jax.process_index() != 0:
            return
        self.metrics = metrics_lib.MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard)
        if resume:
            # Lines after the restored checkpoint were logged by the killed run; drop them.
            self.metrics.truncate_after(self.global_step + 1)

    def _log(self, step: int, metrics: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(step, metrics)

    @property
    def sampler(self):
        """The rollout sampler, started on first use."""
        if self._sampler is None:
            self._sampler = builders.build_sampler(
                self.cfg,
                nnx.merge(self.graphdef, self.state.params),
                self.tokenizer,
                self.mesh,
                self.run_dir,
            )
        return self._sampler

    @property
    def global_step(self) -> int:
        return self.loop.sft_step + self.loop.rl_step

    # -- state and phases ---------------------------------------------------------------------
    def _enter_phase(self, phase: str, params, rng) -> None:
        """The phase's algorithm record, its fresh state, and the compiled prepare/update."""
        self.algorithm = methods.make_algorithm(
            self.cfg, phase, self.graphdef, self.params_shape, self.mesh
        )
        _, shardings = methods.abstract_state(self.algorithm, self.params_shape, self.mesh)
        self.state = jax.device_put(self.algorithm.init(params, rng), shardings)
        self.compiled = step_lib.CompiledAlgorithm(self.algorithm, self.mesh, shardings)
        self._phase, self._shardings = phase, shardings
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
            algorithm = methods.make_algorithm(
                self.cfg,
                self._phase,
                self.graphdef,
                self.params_shape,
                self.mesh,
                microbatches=microbatches,
            )
            self._compiled[microbatches] = step_lib.CompiledAlgorithm(
                algorithm, self.mesh, self._shardings
            )
        return self._compiled[microbatches]

    def _make_iterator(self):
        cfg = self.cfg
        cls = iterators.CurriculumPromptIterator if cfg.rl.curriculum else iterators.PromptIterator
        if self.num_shards == 1:
            return cls(self.train_problems, cfg.rl.prompts_per_step, seed=cfg.run.seed)
        per_shard = cfg.rl.prompts_per_step // self.num_shards
        return shards.ShardedIterator(
            self.train_shards,
            lambda items, seed: cls(items, per_shard, seed=seed),
            seed=cfg.run.seed,
            gather=distributed.allgather_json,
        )

    # -- checkpoints ----------------------------------------------------------------------------
    def _save(self) -> None:
        if self.producer is not None:  # first: the batch in flight finishes and is saved too
            self.loop.rollouts = self.producer.state_dict()
        self.loop.data = self.iterator.state_dict()
        extra = {
            # NaN metrics (e.g. the correct responses' mean length when none is correct) as null.
            "loop": _nan_to_none(dataclasses.asdict(self.loop)),
            "config": config_lib.config_to_dict(self.cfg),
            "model_config": self.model_cfg.to_hf_config(),
        }
        self.ckpt.save(self.global_step, {"state": self.state}, extra)

    def _restore(self) -> None:
        """Restores the newest checkpoint that restores cleanly (older ones on failure)."""

        def target(step, extra):
            phase = LoopState(**extra["loop"]).phase
            algo = methods.make_algorithm(
                self.cfg, phase, self.graphdef, self.params_shape, self.mesh
            )
            return {"state": methods.abstract_state(algo, self.params_shape, self.mesh)[0]}

        restored = self.ckpt.restore_latest(target, log=log)
        if restored is None:
            log(f"--resume: no checkpoint in {self.ckpt.directory} yet; starting fresh")
            return
        step, tree, extra = restored
        if jax.process_index() == 0:
            for path in self.ckpt.set_aside_newer_than(step):
                log(f"moved the unreadable checkpoint to {path} (kept for inspection)")
        loop = LoopState(**extra["loop"])
        if loop.phase != self.loop.phase:
            self._enter_phase(loop.phase, self.state.params, self.state.rng)
        self.state = tree["state"]
        self.loop = loop
        log(f"resumed from checkpoint step {step} (phase {loop.phase})")

    # -- SFT ------------------------------------------------------------------------------------
    def _sft_examples(self) -> list[loading.Problem]:
        """SFT pairs as Problems (question = prompt text, answer = response text)."""
        cfg = self.cfg
        if cfg.sft.data == "gold":
            return [
                loading.Problem(
                    question=builders.render(cfg, p, self.tokenizer),
                    answer=templates.render_gold(cfg.data.gold_format, p.answer, p.solution),
                    id=p.id,
                )
                for p in self.train_problems
            ]
        import datasets

        rows = datasets.load_dataset("json", data_files=cfg.sft.data, split="train")
        examples, skipped = [], 0
        for i, row in enumerate(rows):
            prompt, response = row.get(cfg.sft.prompt_field), row.get(cfg.sft.response_field)
            if not isinstance(prompt, str) or not isinstance(response, str) or not response:
                skipped += 1
                continue
            examples.append(loading.Problem(question=prompt, answer=response, id=f"sft-{i}"))
        if skipped:
            log(f"{cfg.sft.data}: skipped {skipped} rows without a prompt and response")
        if not examples:
            raise ValueError(f"sft.data={cfg.sft.data!r}: no usable prompt/response rows")
        return examples

    def _sft_iterator(self):
        """The SFT order: one iterator, or one per owned data shard (gold pairs follow their
        problems' shards; pairs from a file are split like the problems)."""
        cfg = self.cfg
        examples = self._sft_examples()
        if self.num_shards == 1:
            return iterators.PromptIterator(examples, cfg.sft.batch_size, seed=cfg.run.seed + 1)
        if cfg.sft.data == "gold":  # in self.train_problems' order: the owned shards'
            per_shard, start = {}, 0
            for i, problems in self.train_shards.items():
                per_shard[i] = examples[start : start + len(problems)]
                start += len(problems)
        else:
            split = shards.split(examples, self.num_shards, cfg.run.seed + 1)
            per_shard = {i: split[i] for i in self.train_shards}
        size = cfg.sft.batch_size // self.num_shards
        return shards.ShardedIterator(
            per_shard,
            lambda items, seed: iterators.PromptIterator(items, size, seed=seed),
            seed=cfg.run.seed + 1,
        )

    def _sft_batch(self, examples: list[loading.Problem]):
        limit = self.model_cfg.max_position_embeddings
        prompts, responses = [], []
        for ex in examples:
            p = builders.encode(self.tokenizer, ex.question)
            r = builders.encode(self.tokenizer, ex.answer) + [self.tokenizer.eos_token_id]
            prompts.append(p[: limit - 1])
            responses.append(r[: max(limit - len(prompts[-1]), 0)])
        sft = self.cfg.sft
        packed = rollout.pack(
            prompts,
            responses,
            pad_id=self.pad_id,
            max_length=limit,
            segments=sft.packing,
            row_tokens=sft.max_tokens_per_row,
            row_multiple=sft.microbatches * builders.batch_shards(self.mesh),
        )
        return rollout.to_batch(packed)

    def run_sft(self, progress, stop) -> None:
        cfg = self.cfg
        sft_iter = self._sft_iterator()
        # Fast-forward the SFT data order on resume (cheap: host-side index arithmetic).
        for _ in range(self.loop.sft_step):
            sft_iter.next_batch()
        last: dict[str, float] = {}
        while self.loop.sft_step < cfg.sft.steps:
            t0 = time.perf_counter()
            batch, _ = self.compiled.prepare(self.state, self._sft_batch(sft_iter.next_batch()))
            self.state, m = self.compiled.update(self.state, batch)
            m = {f"sft/{k}": float(v) for k, v in jax.device_get(m).items()}
            m["time/step_s"] = time.perf_counter() - t0
            self.loop.sft_step += 1
            if self.loop.sft_step < cfg.sft.steps:
                self._log(self.global_step, m)
            else:
                last = m  # logged with the post-SFT evaluation below
            progress.update(1)
            progress.set_postfix(phase="sft", loss=f"{m.get('sft/loss', float('nan')):.3f}")
            if self.loop.sft_step >= cfg.sft.steps:
                break
            # The last SFT step is saved after the switch to RL (below), under the same step.
            if stop.should_stop(self.global_step):
                self._save()
                return
            if self.loop.sft_step % cfg.checkpoint.every == 0:
                self._save()
        self.sampler.update_weights(self.sampler_weights())
        ev = self._evaluate()
        self.loop.eval_after_sft = ev
        self._log(self.global_step, {**last, **ev})
        log(f"after SFT warm start: held-out accuracy {ev.get('eval/accuracy', float('nan')):.3f}")
        # Switch to the RL phase with a fresh optimiser state.
        self.loop.phase = "rl"
        if cfg.rl.algo != "none":
            self._enter_phase("rl", self.state.params, self.state.rng)
        self._save()

    # -- RL: sample -> grade -> shape -> prepare -> update -> sync ----------------------------
    def _generate(self, problems, n, seed):
        prompts = [
            builders.encode(self.tokenizer, builders.render(self.cfg, p, self.tokenizer))
            for p in problems
        ]
        if self.cfg.sampler.kind != "jax":  # vLLM seeds prompt i with seed + i: global index
            seed += self.row_block[0] * len(problems)
        params = builders.sampling_params(self.cfg, self.tokenizer, seed=seed)
        completions = self.sampler.generate(prompts, n, params)
        if len(completions) != len(prompts) * n:
            raise RuntimeError(
                f"sampler returned {len(completions)} completions for {len(prompts)} x {n}"
            )
        return prompts, completions

    def _grade(self, problems, completions, n):
        truths = [p.answer for p in problems for _ in range(n)]
        with self._grade_lock:
            return self.pool.grade(self.reward_fn, [c.text for c in completions], truths)

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
            shaping_config(self.cfg, self.loop.rl_step, builders.batch_shards(self.mesh)),
            pad_id=self.pad_id,
            max_length=self.model_cfg.max_position_embeddings,
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
            blocks = step_lib.process_row_block(self.mesh)[1]
        rows, length = np.shape(rollouts.input_ids)
        total, n = rollout.budget_rows(
            rows * blocks,
            length,
            rl.max_tokens_per_microbatch,
            shards=builders.batch_shards(self.mesh),
            key="rl.max_tokens_per_microbatch",
        )
        # Rows per microbatch are a multiple of the batch shards, so of the process blocks too.
        return step_lib.pad_rows(rollouts, total // blocks, length), n

    def prepare(self, rollouts, microbatches: int | None = None):
        compiled = self.compiled_for(microbatches)
        fields = algorithm_lib.select_fields(rollouts, compiled.algorithm.rollout_spec)
        batch, metrics = compiled.prepare(self.state, fields)
        return jax.block_until_ready(batch), metrics

    def update(self, batch, microbatches: int | None = None):
        # One call per step: the record runs rl.epochs_per_step epochs itself.
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
        return self.sampler.update_weights(self.sampler_weights(), version=self.loop.rl_step + 1)

    def rl_step(self) -> dict[str, float]:
        start = time.perf_counter()
        timer = metrics_lib.PhaseTimer()
        t, k = self.loop.rl_step, self.cfg.rl.max_staleness
        async_m: dict[str, float] = {}
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
            batch, prepare_m = self.prepare(rollouts, microbatches)
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
        self.loop.rl_step += 1

        out.update({k: float(v) for k, v in {**prepare_m, **update_m}.items()})
        # The update measures the sampler/trainer log-prob gap at rollout time (its TIS metrics);
        # logged under the dashboard's name as well.
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

    # -- offline preference phase (rl.algo: dpo | ipo | simpo | orpo) ---------------------------
    def _preference_pairs(self) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected) rows of ``pref.data``, read with ``datasets``."""
        import datasets

        pref = self.cfg.pref
        rows = datasets.load_dataset("json", data_files=pref.data, split="train")
        keys = (pref.prompt_field, pref.chosen_field, pref.rejected_field)
        pairs = [tuple(row.get(k) for k in keys) for row in rows]
        good = [p for p in pairs if all(isinstance(x, str) for x in p) and p[1] and p[2]]
        if len(good) < len(pairs):
            log(f"{pref.data}: skipped {len(pairs) - len(good)} rows without {'/'.join(keys)}")
        if not good:
            raise ValueError(f"pref.data={pref.data!r}: no usable {'/'.join(keys)} rows")
        return good

    def _preference_batch(self, pairs: list[tuple]):
        """Stacked pair rows (``algos.preference``): the P chosen, then the P rejected, each
        prompt + response + EOS, right-padded (unpacked), cut to the model's context. Pairs
        that carry cached reference log-probs (``_cache_reference``: per response token, two
        more entries) fill ``ref_logp`` at the response positions, so ``prepare`` runs no
        reference forward."""
        limit = self.model_cfg.max_position_embeddings
        eos = self.tokenizer.eos_token_id
        prompts, responses = [], []
        for side in (1, 2):
            for pair in pairs:
                p = builders.encode(self.tokenizer, pair[0])[: limit - 1]
                r = builders.encode(self.tokenizer, pair[side]) + [eos]
                prompts.append(p)
                responses.append(r[: max(limit - len(p), 0)])
        packed = rollout.pack(prompts, responses, pad_id=self.pad_id, max_length=limit)
        batch = rollout.to_batch(packed)
        if all(len(pair) == 5 for pair in pairs):
            mask = np.asarray(batch.loss_mask) > 0
            ref = np.zeros(mask.shape, np.float32)
            for row, values in enumerate([p[3] for p in pairs] + [p[4] for p in pairs]):
                ref[row, mask[row]] = values
            batch = batch.replace(ref_logp=ref)
        return batch

    def _cache_reference(self, pairs: list[tuple[str, str, str]]) -> list[tuple]:
        """``pairs``, each with the frozen reference's per-token log-probs of its chosen and
        of its rejected response appended (``pref.cache_reference``): one reference pass over
        the data set, through the record's ``prepare``, in batches of ``pref.batch_size`` pairs
        (the last filled up with pairs from the start, whose values are dropped)."""
        from jax.experimental import multihost_utils

        t0 = time.perf_counter()
        size, n = self.cfg.pref.batch_size, len(pairs)
        out = []
        for start in range(0, n, size):
            chunk = [pairs[(start + j) % n] for j in range(size)]
            batch = self._preference_batch(chunk)
            prepared, _ = self.prepare(batch)
            ref = np.asarray(multihost_utils.process_allgather(prepared.ref_logp, tiled=True))
            mask = np.asarray(batch.loss_mask) > 0
            for i, pair in enumerate(chunk[: min(size, n - start)]):
                out.append((*pair[:3], ref[i][mask[i]], ref[i + size][mask[i + size]]))
        seconds = time.perf_counter() - t0
        log(f"pref.cache_reference: the reference's log-probs of {n} pairs in {seconds:.1f} s")
        return out

    def preference_step(self) -> dict[str, float]:
        """One offline preference step: next pairs -> prepare (reference log-probs) -> update ->
        sync (the sampler serves held-out evaluation)."""
        if self._pref_iter is None:
            # PromptIterator indexes any items; fast-forward the order on resume.
            pairs = self._preference_pairs()
            if self.cfg.pref.cache_reference and self.cfg.rl.algo in preference.REFERENCE_KINDS:
                pairs = self._cache_reference(pairs)
            self._pref_iter = iterators.PromptIterator(
                pairs, self.cfg.pref.batch_size, seed=self.cfg.run.seed + 2
            )
            for _ in range(self.loop.rl_step):
                self._pref_iter.next_batch()
        t0 = time.perf_counter()
        batch, prepare_m = self.prepare(self._preference_batch(self._pref_iter.next_batch()))
        update_m = self.update(batch)
        out = {k: float(v) for k, v in jax.device_get({**prepare_m, **update_m}).items()}
        out["time/step_s"] = time.perf_counter() - t0
        self.sync()
        self.loop.rl_step += 1
        return out

    def _evaluate(self) -> dict[str, float]:
        ev = evaluate(
            self.cfg,
            self.sampler,
            self.tokenizer,
            self.eval_problems,
            self.pool,
            self.reward_fn,
            block=self.row_block,
        )
        self._last_accuracy = ev.get("eval/accuracy", self._last_accuracy)
        return ev

    def _postfix(self, m: dict) -> dict[str, str]:
        acc = "n/a" if self._last_accuracy is None else f"{self._last_accuracy:.2f}"
        reward = m.get("reward_mean", m.get("reward_accuracy", float("nan")))
        return dict(phase=self.cfg.rl.algo, reward=f"{reward:.2f}", eval_acc=acc)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        from tqdm import tqdm

        total = cfg.sft.steps + (cfg.rl.steps if cfg.rl.algo != "none" else 0)
        progress = tqdm(
            total=total,
            initial=self.global_step,
            disable=not cfg.run.progress,
            desc="train",
            dynamic_ncols=True,
        )
        t_start = time.perf_counter()
        if self.loop.eval_history:
            self._last_accuracy = self.loop.eval_history[-1].get("eval/accuracy")
        elif self.loop.eval_after_sft:
            self._last_accuracy = self.loop.eval_after_sft.get("eval/accuracy")
        with interrupt.GracefulStop() as stop:
            if self.loop.phase == "sft":
                self.run_sft(progress, stop)
            if cfg.sft.steps == 0 and self.loop.rl_step == 0 and cfg.eval.at_start:
                self.loop.eval_after_sft = self._evaluate()
                self._log(0, self.loop.eval_after_sft)
            if cfg.rl.algo != "none" and not stop.requested:
                # Version = updates applied so far: the versions the completions carry.
                self.sampler.update_weights(self.sampler_weights(), version=self.loop.rl_step)
                offline = cfg.rl.algo in config_lib.PREFERENCE_ALGOS
                step = self.preference_step if offline else self.rl_step
                while self.loop.rl_step < cfg.rl.steps:
                    m = step()
                    done = self.loop.rl_step == cfg.rl.steps
                    if self.loop.rl_step % cfg.eval.every == 0 or done:
                        ev = self._evaluate()
                        m.update(ev)
                        self.loop.eval_history.append({"step": self.loop.rl_step, **ev})
                    self._log(self.global_step, m)
                    progress.update(1)
                    progress.set_postfix(**self._postfix(m))
                    stopping = stop.should_stop(self.global_step)
                    if self.loop.rl_step % cfg.checkpoint.every == 0 or done or stopping:
                        self._save()
                    if stopping:
                        break
        progress.close()
        if stop.requested:
            log(
                f"{stop.requested}: saved checkpoint step {self.global_step} and stopped; "
                "continue with --resume"
            )
            return {"interrupted": stop.requested, "step": self.global_step}
        final = self.loop.eval_history[-1] if self.loop.eval_history else self._evaluate()
        self.loop.phase = "done"
        summary = {
            "run_dir": os.path.abspath(self.run_dir),
            "algo": cfg.rl.algo,
            "sft_steps": self.loop.sft_step,
            "rl_steps": self.loop.rl_step,
            "eval_accuracy_after_sft": (self.loop.eval_after_sft or {}).get("eval/accuracy"),
            "eval_accuracy_final": final.get("eval/accuracy"),
            "eval_format_rate_final": final.get("eval/format_rate"),
            "eval_history": self.loop.eval_history,
            "wall_s": time.perf_counter() - t_start,
            "checkpoints": os.path.abspath(self.ckpt.directory),
        }
        if self.metrics is not None:
            self.metrics.write_summary(summary)
        return summary

    def close(self) -> None:
        if getattr(self, "producer", None) is not None:
            with contextlib.suppress(Exception):
                self.producer.close()
        if self._sampler is not None:
            with contextlib.suppress(Exception):
                self._sampler.close()
        with contextlib.suppress(Exception):
            self.pool.close()
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                self.metrics.close()


def run(
    cfg: config_lib.TrainConfig, *, resume: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Runs a training job end to end and prints where its outputs are.

    Everything the run will read is checked first (``preflight``): an ``out_dir`` that already
    holds a run is refused unless ``resume`` (continue it) or ``overwrite`` (move it aside).
    """
    placement.place_trainer(cfg.sampler)  # before jax.process_index() starts the backend
    distributed.initialize(cfg.distributed)  # likewise (a no-op for one process)
    cfg = preflight.check(
        cfg, mode="train", resume=resume, overwrite=overwrite and jax.process_index() == 0
    )
    if jax.process_count() > 1:  # every process checked out_dir before process 0 writes to it
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxrlvr-preflight")
    trainer = Trainer(cfg, resume=resume)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    distributed.finish()  # a clean end: the other processes do not report this one as lost
    if "interrupted" in summary:
        return summary
    plots_dir = os.path.join(cfg.run.out_dir, "plots")
    with contextlib.suppress(Exception):
        from jaxrlvr import plots

        plots.plot_runs([cfg.run.out_dir], plots_dir)
    before, after = summary["eval_accuracy_after_sft"], summary["eval_accuracy_final"]
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"
    print(f"held-out accuracy after SFT warm start: {fmt(before)}")
    print(f"held-out accuracy after {cfg.rl.algo.upper()}: {fmt(after)}")
    print(f"metrics: {os.path.join(cfg.run.out_dir, 'metrics.jsonl')}")
    print(f"plots: {plots_dir}")
    print(f"checkpoints: {summary['checkpoints']}")
    return summary


# ----------------------------------------------------------------------------------------------
# Restoring only the policy: eval and export


def restore_policy(
    cfg: config_lib.TrainConfig, run_dir: str, mesh, tokenizer, *, step: int | None = None
) -> tuple[int, model_lib.Qwen2ForCausalLM]:
    """The policy of a run's checkpoint (default: the newest that restores), restored into an
    abstract model: no Hugging Face weights are loaded, no data or graders are touched.

    The architecture comes from the checkpoint (``model_config``), else from the run's config.
    """
    ckpt = checkpoint_lib.Checkpointer(os.path.join(run_dir, "checkpoints"))

    def target(s, extra):
        if extra.get("model_config"):
            m = cfg.model
            model_cfg = model_lib.ModelConfig.from_hf_config(
                extra["model_config"],
                dtype=m.dtype,
                param_dtype=m.param_dtype,
                remat=m.remat,
                scan_layers=m.scan_layers,
            )
        else:
            model_cfg = builders.model_config(cfg, tokenizer)
        graphdef, params_shape = builders.abstract_model(model_cfg, mesh)
        algo = methods.make_algorithm(
            cfg, LoopState(**extra["loop"]).phase, graphdef, params_shape, mesh
        )
        target.graphdef = graphdef
        return {"state": methods.abstract_state(algo, params_shape, mesh)[0]}

    try:
        restored = ckpt.restore_latest(target, step=step, log=log)
    finally:
        ckpt.close()
    if restored is None:
        raise checkpoint_lib.CheckpointError(f"no complete checkpoint in {ckpt.directory}")
    step, tree, _ = restored
    return step, nnx.merge(target.graphdef, tree["state"].params)


def _single_host_mesh():
    return model_lib.make_mesh(model_lib.MeshConfig(data=1, fsdp=-1, tensor=1))


def evaluate_only(cfg: config_lib.TrainConfig, run_dir: str | None = None) -> dict[str, float]:
    """Held-out evaluation of a run's newest checkpoint (``run_dir``), or of the config's
    initial model when ``run_dir`` is None."""
    if run_dir is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=run_dir))
    cfg = preflight.check(cfg, mode="eval", checkpoint=run_dir)
    placement.check_jax_devices(placement.place_trainer(cfg.sampler))  # vLLM's GPUs stay free
    mesh = model_lib.make_mesh(cfg.mesh)
    tokenizer = builders.build_tokenizer(cfg)
    if run_dir is None:
        model = builders.build_model(cfg, tokenizer, mesh)
    else:
        step, model = restore_policy(cfg, run_dir, mesh, tokenizer)
        log(f"evaluating checkpoint step {step} of {run_dir}")
    _, problems = builders.load_splits(cfg, train=False)
    reward_fn, pool = builders.build_grader(cfg)
    sampler = None
    try:
        sampler = builders.build_sampler(cfg, model, tokenizer, mesh, cfg.run.out_dir)
        return evaluate(cfg, sampler, tokenizer, problems, pool, reward_fn)
    finally:
        if sampler is not None:
            sampler.close()
        pool.close()


def export_checkpoint(run_dir: str, out_dir: str, *, step: int | None = None) -> str:
    """Restores a checkpoint's policy and writes a Hugging Face folder (config, safetensors,
    tokenizer). Reads only the run directory (and the tokenizer): no data, graders or HF load."""
    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = configlib.build(config_lib.TrainConfig, yaml.safe_load(f))
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=run_dir))
    tokenizer = builders.build_tokenizer(cfg)
    step, model = restore_policy(cfg, run_dir, _single_host_mesh(), tokenizer, step=step)
    model_lib.save_hf(model, out_dir, tokenizer_src=tokenizer)
    with open(os.path.join(out_dir, "jaxrlvr_export.json"), "w") as f:
        json.dump({"run_dir": os.path.abspath(run_dir), "step": step}, f)
    return out_dir
