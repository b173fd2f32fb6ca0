"""The RL phase: a rollout source, a learner, and the step's metrics.

One step: the rollout source (``phases.sources``) hands the step's graded rollouts (sampled now,
or k steps ahead on a background thread with ``rl.max_staleness`` = k > 0), the learner
(``phases.learner``) shapes them into a batch, prepares it on the mesh and updates the state,
the source hands the sampler the new weights, and ``step_metrics`` assembles the step's line
(the shaping's, prepare's and update's metrics, the source's, throughput and times). The method
(GRPO and its variants, PPO, expert iteration) is the record ``algos.registry.build`` builds
for ``rl.algo``; this phase knows none of their insides, the learner none of sampling, the
source none of losses.

Everything random is derived from ``run.seed`` and the step number (sampler seeds, data order);
the position (the data order's state and, asynchronously, the batches already generated) is
saved with every checkpoint, so a resumed run ends at the parameters of one never stopped.

The tool-use phase (``phases.tool``) is this phase with the multi-turn rollout source.
"""

from __future__ import annotations

import time
from typing import ClassVar

import jax
import numpy as np

from jaxrlvr import compile_cache, configlib, distributed, prompts
from jaxrlvr import config as config_lib
from jaxrlvr import metrics as metrics_lib
from jaxrlvr.data import templates
from jaxrlvr.phases import base, learner, sources


class RLPhase(base.RLStepsPhase):
    name = "rl"
    reward_metric = "reward_mean"
    samples_train_prompts = True
    sections = ("rl", "sampler", "optim", "data", "run", "eval")
    source_cls: ClassVar[type[sources.RolloutSource]] = sources.RolloutSource

    @classmethod
    def wanted(cls, cfg: base.Sections) -> bool:
        return cfg.rl.online

    @classmethod
    def geometry(cls, cfg):
        rl = cfg.rl
        if rl.steps <= 0:
            return None
        return base.BatchGeometry(
            rows=rl.rollouts_per_step,
            rows_key="rl.prompts_per_step x rl.group_size",
            microbatches=rl.microbatches,
            section="rl",
            packed=rl.packing,
            per_shard=(rl.prompts_per_step, "rl.prompts_per_step"),
        )

    @classmethod
    def check(cls, cfg, *, processes, shards, where):
        rl = cfg.rl
        budget = rl.max_tokens_per_microbatch
        # A token budget holds at least one row of rl.max_tokens_per_row per batch shard (longer
        # rows are refused at the step that packs them, ``rollout.budget_rows``).
        least = shards * (rl.max_tokens_per_row or 1)
        if budget is not None and rl.steps > 0 and budget < least:
            raise configlib.ConfigKeyError(
                f"rl.max_tokens_per_microbatch={budget} is less than one row of "
                f"rl.max_tokens_per_row={rl.max_tokens_per_row or 1} positions per batch shard "
                f"x {shards} batch shards ({where}) = {least}"
            )
        k = rl.max_staleness
        if processes > 1 and k > 0:
            # The background sampler's collectives would interleave with the update's.
            raise configlib.ConfigKeyError(
                f"rl.max_staleness={k}: asynchronous rollouts run in one process only"
            )

    @classmethod
    def data_files(cls, cfg):
        rl = cfg.rl
        if rl.steps <= 0:
            return []
        per_step = rl.prompts_per_step * (2 if rl.difficulty_filter else 1)
        return [base.DataFile("data.train", cfg.data.train, per_step, "rl.prompts_per_step")]

    def __init__(self, ctx: base.RunContext, cfg: config_lib.TrainConfig):
        super().__init__(ctx, cfg)
        self.source = self.source_cls(ctx, self.cfg.rl, self.cfg.sampler, self.cfg.run.seed)
        self.learner: learner.Learner | None = None

    def enter(self, params, rng) -> None:
        super().enter(params, rng)
        self._build_learner()

    def _build_learner(self) -> learner.Learner:
        """The phase's learner, built once (``enter``, or before it ``programs_ahead``)."""
        if self.learner is None:
            self.build_compiled()
            ctx = self.ctx
            self.learner = learner.Learner(
                self.cfg.rl,
                self.cfg.sampler.max_tokens,
                self.make_algorithm,
                self.compiled,
                ctx.mesh,
                self.shardings,
                pad_id=ctx.pad_id,
                max_length=ctx.model_cfg.max_position_embeddings,
                row_block=ctx.row_block,
                passes=ctx.passes,
            )
        return self.learner

    def programs_ahead(self):
        """The first step's prepare and update, lowered for a stand-in of its rollouts
        (``RolloutSource.stand_in``: each group half the gold completions an SFT warm start
        teaches, half wrong ones) shaped, budgeted and through the passes as a step's are.
        Their shapes are a guess: a first step whose rollouts land in other buckets (rows,
        length, microbatches) compiles its own programs, as without this. [] where nothing
        stands in: a sampler or pass that cannot (vLLM, a teacher's scores, r2 replay), the
        multi-turn source, several processes, a phase already started."""
        if self.position > 0 or jax.process_count() > 1 or self.ctx.row_block[1] > 1:
            return []
        try:
            return self._programs_ahead()
        except Exception as err:  # noqa: BLE001 (a guess: the step compiles its own programs)
            prompts.log(f"the RL phase's first step is not compiled ahead: {err}".splitlines()[0])
            return []

    def _programs_ahead(self):
        data = self.cfg.data
        formats = {m.domain: m.data.gold_format for m in data.mixture}

        def answer(p, right: bool) -> str:
            fmt = formats.get(p.domain, data.gold_format)
            return templates.render_gold(fmt, p.answer if right else f"{p.answer}0", p.solution)

        graded = self.source.stand_in(answer)
        if graded is None:
            return []
        lrn = self._build_learner()
        rollouts, _ = lrn.shape(
            graded.prompts, graded.completions, graded.scores, 0, fields=graded.fields
        )
        rollouts, microbatches = lrn.fit_budget(rollouts)
        for p in self.ctx.passes:
            rollouts = p.stand_in(rollouts, step=0)
        shape = jax.eval_shape(self.algorithm.init, self.ctx.params_shape, 0)
        state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
            shape,
            self.shardings,
        )
        return lrn.lowered(state, rollouts, microbatches)

    def state_dict(self):
        return self.source.state_dict()

    def load_state_dict(self, state) -> None:
        self.source.load_state_dict(state)

    def begin(self) -> None:
        # Version = updates applied so far: the versions the completions carry.
        self.source.sync(self.state.params, version=self.position)

    def close(self) -> None:
        self.source.close()

    def sampler_calls(self):
        """The rollout calls of the next step (``RolloutSource.first_calls``)."""
        return [(p, n, self.cfg.sampler, False) for p, n in self.source.first_calls()]

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        timer = metrics_lib.PhaseTimer()
        t = self.position
        graded = self.source.rollouts(t, self.total_steps, timer)
        with timer.phase("shape"):
            rollouts, out = self.learner.shape(
                graded.prompts,
                graded.completions,
                graded.scores,
                t,
                fields=graded.fields,
            )
            rollouts, microbatches = self.learner.fit_budget(rollouts)
        out["tokens/microbatches"] = microbatches
        if self.cfg.rl.max_tokens_per_microbatch is not None:  # the rows fit_budget chose
            out["tokens/batch_shape_B"] = int(np.shape(rollouts.input_ids)[0])
            out["tokens/padding_fraction"] = 1.0 - float(np.mean(rollouts.attention_mask))
        ahead, self.ahead, counter = self.ahead, None, None
        if ahead is not None:  # the programs compiled ahead (``programs_ahead``)
            ahead.join()
            counter = compile_cache.CompileCounter().start()
        with timer.phase("logprobs"):
            batch, prepare_m = self.learner.prepare(
                self.state, rollouts, microbatches, version=graded.version, current=t
            )
            self.learner.keep_version(self.state.params, t)
        with timer.phase("update"):
            self.state, update_m = self.learner.update(self.state, batch, microbatches)
            update_m, prepare_m = jax.device_get((update_m, prepare_m))
        if counter is not None:  # nothing compiled or loaded: the guess held
            counter.stop()
            self.ahead_used = counter.compiles + counter.cache_hits == 0
        device_m = self.learner.finish({**prepare_m, **update_m})
        self.source.wait(timer)
        with timer.phase("sync"):
            sync = self.source.sync(self.state.params, version=t + 1)
        self.position += 1
        return step_metrics(
            out,
            device_m,
            graded,
            sync,
            timer,
            epochs=self.cfg.rl.epochs_per_step,
            start=start,
        )


def step_metrics(
    out: dict,
    device_m: dict,
    graded: sources.GradedRollouts,
    sync: dict | None,
    timer: metrics_lib.PhaseTimer,
    *,
    epochs: int,
    start: float,
) -> dict[str, float]:
    """The RL step's metrics line: the shaping's (``out``), prepare's and update's
    (``device_m``), the source's, the weight sync's (``sync/...``), the phases' times and the
    sampling and update throughput, reduced over the processes."""
    out.update({k: float(v) for k, v in device_m.items()})
    # The update measures the sampler/trainer log-prob gap at rollout time (its off-policy
    # diagnostics); logged under the dashboard's name as well.
    if "logp_diff_abs" in out:
        out["sampler_trainer_logprob_gap_mean"] = out["logp_diff_abs"]
        out["sampler_trainer_logprob_gap_max"] = out["logp_diff_abs_max"]
    out.update(graded.metrics)
    out.update({f"sync/{k}": float(v) for k, v in (sync or {}).items()})
    seconds = timer.seconds
    out.update(timer.collect())
    generate_s = graded.generate_s if graded.generate_s is not None else seconds.get("sample", 0.0)
    out["throughput/sample_tokens_per_s"] = out["tokens/response"] / max(generate_s, 1e-9)
    out["throughput/update_tokens_per_s"] = (out.pop("tokens/attended") * epochs) / max(
        seconds.get("update", 0.0), 1e-9
    )
    out["time/step_s"] = time.perf_counter() - start  # the phases and the host work between
    # Multi-process: over every process's rollouts; the outcome-conditional lengths are
    # weighted by each process's count of correct / incorrect completions.
    right = out.get("accuracy", 0.0) * len(graded.completions)
    return distributed.reduce_metrics(
        out,
        weights={
            "response_length_correct_mean": right,
            "response_length_incorrect_mean": len(graded.completions) - right,
        },
    )
