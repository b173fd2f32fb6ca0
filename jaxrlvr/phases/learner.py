"""The RL phase's learner: graded rollouts -> host batch -> prepare -> update.

``rollout.shape`` builds the host batch of every rollout field (advantages, shaped rewards,
correctness, the sampler's log-probs) in a length bucket; a token budget
(``rl.max_tokens_per_microbatch``) trims and re-pads its rows and picks the step's microbatch
count; the compiled ``prepare`` places it on the mesh (the step's one host-to-device transfer)
and runs the old / reference / value passes on device; the compiled, donated ``update`` trains
on it. The method (GRPO and its variants, PPO, expert iteration) is the record
``registry.build`` builds for ``rl.algo``; the learner knows none of their insides, and
nothing of how rollouts are sampled (``phases.sources``).

Off-policy correction (``algos.importance``, docs/corrections.md): a stale batch (``rl.
max_staleness`` k > 0, ``rl.behaviour_logprobs``) gets ``behaviour_logp``, the trainer's
log-probs under the version that sampled it: the learner keeps a copy of the parameters of every
version that still has a batch waiting (at most k + 1 copies) and runs the compiled ``prepare``
a second time with them, so the engine gap (behaviour vs sampler) and the staleness gap (current
vs behaviour) are corrected and reported apart. After a resume the versions of the batches saved
with the checkpoint are gone: those batches use the current parameters as their behaviour
version (the ratio reads 1) and ``offpolicy/behaviour_exact`` is 0 on those steps.

Rollout passes (``passes``: teacher scores, routing replay): the learner lays out their host
fields with the rollouts (``GradedRollouts.fields``), runs each one's device part before the
record's ``prepare`` and hands it the step's metrics (``finish``); it knows none of them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxrlvr import config as config_lib
from jaxrlvr import rollout
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import loss_config
from jaxrlvr.algos import step as step_lib


def shaping_config(
    rl: config_lib.RLSection, max_tokens: int, rl_step: int, shards: int = 1
) -> rollout.ShapingConfig:
    """The host shaping of step ``rl_step`` (``max_tokens``: ``sampler.max_tokens``, the
    overlong penalty's length); packed row counts are multiples of the update's microbatches x
    ``shards`` (the mesh's batch shards)."""
    overlong = None
    if rl.overlong_cache_len:
        overlong = loss_config.OverlongConfig(max_len=max_tokens, cache_len=rl.overlong_cache_len)
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
        # With a token budget (microbatches 1) ``Learner.fit_budget`` sets the final row count.
        row_multiple=rl.microbatches * shards,
    )


class Learner:
    """Shapes graded rollouts into a batch and trains the state on it (module docstring).

    Args:
      rl, max_tokens: the ``rl`` section and ``sampler.max_tokens``.
      make_algorithm: ``make_algorithm(microbatches)``: the phase's record for a microbatch
        count (the state it inits has the same shapes whatever the count).
      compiled: the record compiled for the configured count; mesh, shardings: its placement.
      pad_id, max_length: the tokenizer's pad id and the model's positions.
      row_block: (this process's row block, the number of blocks).
      passes: the run's rollout passes (``passes.RolloutPass``), in order.
    """

    def __init__(
        self,
        rl: config_lib.RLSection,
        max_tokens: int,
        make_algorithm: Callable[[int | None], algorithm_lib.Algorithm],
        compiled: step_lib.CompiledAlgorithm,
        mesh,
        shardings,
        *,
        pad_id: int,
        max_length: int,
        row_block: tuple[int, int],
        passes=(),
    ):
        self.rl, self.max_tokens = rl, max_tokens
        self.make_algorithm, self.mesh, self.shardings = make_algorithm, mesh, shardings
        self.pad_id, self.max_length, self.row_block = pad_id, max_length, row_block
        self.shards = step_lib.batch_shard_count(mesh)
        # The records by microbatch count (``compiled_for``): the configured one now.
        self._compiled = {compiled.algorithm.rollout_spec.num_microbatches: compiled}
        self.compiled = compiled
        # Parameter copies by version, for the behaviour log-probs of stale batches.
        self._versions: dict[int, object] = {}
        self.passes = tuple(passes)

    def compiled_for(self, microbatches: int | None = None) -> step_lib.CompiledAlgorithm:
        """The prepare/update compiled for ``microbatches`` (default: the configured count). A
        token budget picks the count per step from a few buckets; each count's record is built
        on first use and kept, and all of them share the phase's state: the count changes how a
        batch is cut, not the state's shapes or shardings."""
        if microbatches is None:
            return self.compiled
        if microbatches not in self._compiled:
            self._compiled[microbatches] = step_lib.CompiledAlgorithm(
                self.make_algorithm(microbatches), self.mesh, self.shardings
            )
        return self._compiled[microbatches]

    def shape(self, prompt_ids, completions, scores, rl_step: int, *, fields=None):
        """(host batch, shaping metrics) of the step's rollouts (``rollout.shape``; ``fields``:
        the passes' per-token fields, ``GradedRollouts.fields``)."""
        return rollout.shape(
            prompt_ids,
            completions,
            scores,
            shaping_config(self.rl, self.max_tokens, rl_step, self.shards),
            pad_id=self.pad_id,
            max_length=self.max_length,
            fields=fields,
        )

    def fit_budget(self, rollouts):
        """(rollouts, microbatches) of the step: with ``rl.max_tokens_per_microbatch``, the
        packed rows trimmed of their all-padding tail and padded again with all-padding rows to
        the row count that ``rollout.budget_rows`` chooses with the count; without, unchanged,
        in ``rl.microbatches``. Multi-process: the count is chosen from the processes' common
        share shape (``step.agree_local_shapes``), so every process runs the same program."""
        rl = self.rl
        if rl.max_tokens_per_microbatch is None:
            return rollouts, rl.microbatches
        used = max(rollout.used_rows(rollouts), 1)
        rollouts = jax.tree.map(lambda x: np.asarray(x)[:used], rollouts)
        blocks = 1
        if self.compiled.local_rows:
            rollouts = step_lib.agree_local_shapes(rollouts)
            blocks = self.row_block[1]
        rows, length = np.shape(rollouts.input_ids)
        total, n = rollout.budget_rows(
            rows * blocks,
            length,
            rl.max_tokens_per_microbatch,
            shards=self.shards,
            key="rl.max_tokens_per_microbatch",
        )
        # Rows per microbatch are a multiple of the batch shards, so of the process blocks too.
        return step_lib.pad_rows(rollouts, total // blocks, length), n

    def prepare(
        self,
        state,
        rollouts,
        microbatches: int | None = None,
        *,
        version: int | None = None,
        current: int = 0,
    ):
        """The compiled ``prepare`` of the step's rollouts at ``state`` (weight version
        ``current``); with ``version`` (the weight version that sampled a stale batch) the batch
        of a record that reads ``behaviour_logp`` (GRPO, PPO) also gets it: the same pass run
        with that version's kept parameters (module docstring)."""
        compiled = self.compiled_for(microbatches)
        pass_m = {}
        for p in self.passes:
            rollouts, m = p.device(state, rollouts, step=current)
            pass_m.update(m)
        fields = algorithm_lib.select_fields(rollouts, compiled.algorithm.rollout_spec)
        batch, metrics = compiled.prepare(state, fields)
        if pass_m:
            metrics = {**metrics, **pass_m}
        spec = compiled.algorithm.batch_spec
        if version is not None and "behaviour_logp" in spec.required + spec.optional:
            metrics = dict(metrics)
            params = self._versions.get(version)
            exact = params is not None or version == current
            if params is not None and version != current:
                behaviour, _ = compiled.prepare(state.replace(params=params), fields)
                batch = batch.replace(behaviour_logp=behaviour.old_logp)
            else:  # the current version sampled it, or its parameters are gone (resume)
                batch = batch.replace(behaviour_logp=batch.old_logp)
            metrics["offpolicy/behaviour_exact"] = float(exact)
        return jax.block_until_ready(batch), metrics

    def lowered(self, state, rollouts, microbatches: int | None = None):
        """The step's prepare and update lowered for ``state`` (shapes suffice) and host
        ``rollouts`` after the passes' device parts (``CompiledAlgorithm.lower_step``)."""
        compiled = self.compiled_for(microbatches)
        fields = algorithm_lib.select_fields(rollouts, compiled.algorithm.rollout_spec)
        return compiled.lower_step(state, fields)

    def keep_version(self, params, t: int) -> None:
        """Before the update of step ``t``: keep a copy of the current parameters (version ``t``)
        while a batch it samples is still to be trained, and drop the versions no batch needs
        any more (pending batches of steps t + 1 .. t + k come from versions >= t + 1 - k)."""
        k = self.rl.max_staleness
        if not (k > 0 and self.rl.behaviour_logprobs):
            return
        oldest = max(0, t + 1 - k)
        self._versions = {v: p for v, p in self._versions.items() if v >= oldest}
        if t + 1 < self.rl.steps and t not in self._versions:
            self._versions[t] = jax.tree.map(lambda x: x.copy(), params)

    def update(self, state, batch, microbatches: int | None = None):
        """(new state, metrics): one call per step; the record runs its epochs
        (``rl.epochs_per_step``) itself."""
        return self.compiled_for(microbatches).update(state, batch)

    def finish(self, metrics: dict) -> dict:
        """The step's prepare and update metrics, on the host, as the passes report them."""
        for p in self.passes:
            metrics = p.finish(metrics)
        return metrics
