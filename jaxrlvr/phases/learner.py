"""The RL phase's learner: graded rollouts -> host batch -> prepare -> update.

``rollout.shape`` builds the host batch of every rollout field (advantages, shaped rewards,
correctness, the sampler's log-probs) in a length bucket; a token budget
(``rl.max_tokens_per_microbatch``) trims and re-pads its rows and picks the step's microbatch
count; the compiled ``prepare`` places it on the mesh (the step's one host-to-device transfer)
and runs the old / reference / value passes on device; the compiled, donated ``update`` trains
on it. The method (GRPO and its variants, PPO, expert iteration) is the record
``methods.make_algorithm`` builds for ``rl.algo``; the learner knows none of their insides, and
nothing of how rollouts are sampled (``phases.sources``).

Off-policy correction (``algos.importance``, docs/corrections.md): a stale batch (``rl.
max_staleness`` k > 0, ``rl.behaviour_logprobs``) gets ``behaviour_logp``, the trainer's
log-probs under the version that sampled it: the learner keeps a copy of the parameters of every
version that still has a batch waiting (at most k + 1 copies) and runs the compiled ``prepare``
a second time with them, so the engine gap (behaviour vs sampler) and the staleness gap (current
vs behaviour) are corrected and reported apart. After a resume the versions of the batches saved
with the checkpoint are gone: those batches use the current parameters as their behaviour
version (the ratio reads 1) and ``offpolicy/behaviour_exact`` is 0 on those steps.

MoE routing replay (``algos.routing``, ``rl.routing_replay``): the rollouts' recorded routes
(``Batch.routes``) feed the routing diagnostics, then stay in the batch for "r3", are replaced
by the trainer's own routes under the step's parameters for "r2", and are dropped for "none".
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxrlvr import config as config_lib
from jaxrlvr import rollout
from jaxrlvr import teachers as teachers_lib
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import loss_config, routing
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
        graphdef=None,
        teachers=None,
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
        self._graphdef = graphdef  # the policy's (routing replay and diagnostics)
        self._route_fns: dict[str, Callable] = {}
        # On-policy distillation: the registry, and its local teachers by the domains each
        # serves when they score on device (every teacher local, one process).
        self.teachers = teachers
        one = teachers is not None and jax.process_count() == 1
        self.teacher_groups = teachers.device_groups if one else None

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

    def shape(
        self,
        prompt_ids,
        completions,
        scores,
        rl_step: int,
        *,
        teacher_logps=None,
        teacher_topk=None,
        domain_ids=None,
    ):
        """(host batch, shaping metrics) of the step's rollouts (``rollout.shape``; with
        ``teacher_logps`` / ``teacher_topk`` / ``domain_ids``, on-policy distillation's
        fields)."""
        return rollout.shape(
            prompt_ids,
            completions,
            scores,
            shaping_config(self.rl, self.max_tokens, rl_step, self.shards),
            pad_id=self.pad_id,
            max_length=self.max_length,
            teacher_logps=teacher_logps,
            teacher_topk=teacher_topk,
            domain_ids=domain_ids,
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
        rollouts, route_m = self._routes(state, rollouts)
        if self.teacher_groups is not None and rollouts.domain_ids is not None:
            rollouts, teacher_m = self._teacher_pass(rollouts)
            route_m = {**route_m, **teacher_m}
        fields = algorithm_lib.select_fields(rollouts, compiled.algorithm.rollout_spec)
        batch, metrics = compiled.prepare(state, fields)
        if route_m:
            metrics = {**metrics, **route_m}
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

    def _teacher_pass(self, rollouts):
        """(rollouts placed on the mesh with their teachers' fields, metrics): the rollouts are
        placed once (``compiled.prepare`` then moves nothing); each local teacher's pass runs on
        the whole batch with its parameters as arguments, and each token takes the values of
        its domain's teacher (``Batch.domain_ids``): ``teacher_logp``, or with
        ``rl.distill.signal: jsd`` ``teacher_topk_ids`` / ``teacher_topk_logp``
        (``LocalTeacher.topk``). Metrics per registry domain over its loss tokens (those of
        ``RolloutSource.teacher_scores``): ``distill/<domain>/reverse_kl`` (k1 of the sampler's
        log-prob minus the teacher's) and ``teacher_top1_lb``, or for the JSD ``agreement``
        (the share of sampled tokens equal to the teacher's most likely token)."""
        jnp = jax.numpy
        placed = step_lib.shard_batch(rollouts, self.mesh)
        ids = placed.domain_ids
        jsd = self.rl.distill.signal == "jsd"
        top_k = self.rl.distill.top_k if jsd else None
        fields = teachers_lib.device_scores(self.teacher_groups, placed, top_k=top_k)
        mask = placed.loss_mask != 0
        if jsd:
            hits = {"agreement": placed.labels == fields["teacher_topk_ids"][..., 0]}
        else:
            values = (fields["teacher_logp"],)
            hits = {"teacher_top1_lb": values[0] > np.log(0.5)}
        sums = {}
        for j, domain in enumerate(self.teachers.names):
            m = mask & (ids == j)
            sums[domain] = {"n": m.sum(), **{k: (m & h).sum() for k, h in hits.items()}}
            if not jsd:
                diff = placed.sampler_logp - values[0]
                sums[domain]["reverse_kl"] = jnp.where(m, diff, 0.0).sum()
        metrics = {}
        for domain, s in jax.device_get(sums).items():
            n = float(s.pop("n"))
            if n:
                metrics.update({f"distill/{domain}/{k}": float(v) / n for k, v in s.items()})
        return placed.replace(**fields), metrics

    def _route_fn(self, name: str) -> Callable:
        if name not in self._route_fns:
            fn = getattr(routing, name)
            self._route_fns[name] = jax.jit(lambda p, b: fn(self._graphdef, p, b))
        return self._route_fns[name]

    def _routes(self, state, rollouts):
        """(rollouts with the routes ``rl.routing_replay`` trains on, routing metrics)."""
        mode, metrics = self.rl.routing_replay, {}
        recorded = rollouts.routes
        if self._graphdef is None:
            return rollouts, metrics
        if recorded is not None and self.rl.routing_metrics and rollouts.sampler_logp is not None:
            out = self._route_fn("route_metrics")(state.params, rollouts)
            metrics = {k: float(v) for k, v in jax.device_get(out).items()}
        if mode == "r2":
            live = self._route_fn("trainer_routes")(state.params, rollouts.replace(routes=None))
            rollouts = rollouts.replace(routes=np.asarray(live).astype(np.int16))
        elif mode == "none" and recorded is not None:
            rollouts = rollouts.replace(routes=None)
        return rollouts, metrics

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
