"""Teacher scoring, the rollout pass of on-policy distillation (``algos.distill``).

Fields: ``domain_ids`` [B, T] (each label's problem domain, an index into the registry's sorted
domains; host), and the teacher's signal of the student's sampled tokens: ``teacher_logp``
[B, T] (``rl.distill.signal: reverse_kl``) or ``teacher_topk_ids`` / ``teacher_topk_logp``
[B, T, K] (``jsd``, K = ``rl.distill.top_k``). Where: both. When every teacher is a local JAX
teacher in a one-process job, the teachers score the placed training batch on device
(``teachers.device_scores``, ``device``); otherwise (a vLLM teacher among them, or several
processes) each completion is scored on the host, each teacher asked once
(``TeacherRegistry.completion_logprobs`` / ``completion_topk``, ``host``). Checks: the run's
teachers are loaded and checked when the pass is built (``teachers.load_registry``: every
problem's domain has a teacher, the tokenizers and vocabularies match the student's). Metrics:
``teachers.metrics`` of the laid-out batch, whichever way it was scored (``distill/<domain>/...``).

The pass runs when ``rl.distill`` names teachers.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrlvr import teachers
from jaxrlvr.algos import step as step_lib
from jaxrlvr.passes.base import RolloutPass


class TeacherScores(RolloutPass):
    """On-policy distillation's teacher scores (module docstring).

    Args:
      registry: the run's ``teachers.TeacherRegistry``.
      signal, top_k: ``rl.distill.signal`` and ``top_k``.
      group_size: completions per prompt (prompt-major).
      mesh: the trainer's mesh (device scoring places the batch on it).
    """

    name = "teacher"
    where = "both"
    fields = {
        "domain_ids": "host",
        "teacher_logp": "host or device",
        "teacher_topk_ids": "host or device",
        "teacher_topk_logp": "host or device",
    }

    def __init__(self, registry, *, signal: str, top_k: int | None, group_size: int, mesh=None):
        self.registry, self.jsd, self.top_k = registry, signal == "jsd", top_k
        self.group_size, self.mesh = group_size, mesh
        one = jax.process_count() == 1
        self.device_groups = registry.device_groups if one else None

    @property
    def timed_on_host(self) -> bool:
        # Local teachers on one process score the placed batch on the device (``device``).
        return self.device_groups is None

    @classmethod
    def from_config(cls, cfg, *, model_cfg, mesh, tokenizer, problems, **_):
        d = cfg.rl.distill
        if not d.sources:
            return None
        registry = teachers.load_registry(
            d,
            domains=[p.domain or "default" for p in problems],
            student_vocab_size=model_cfg.vocab_size,
            student_tokenizer=tokenizer,
            mesh=mesh,
            chunk_size=cfg.rl.logprob_chunk_size,
        )
        return cls(
            registry, signal=d.signal, top_k=d.top_k, group_size=cfg.rl.group_size, mesh=mesh
        )

    def host(self, problems, prompts, completions):
        g = self.group_size
        domains = [problems[i // g].domain or "default" for i in range(len(completions))]
        index = [self.registry.index(d) for d in domains]
        fields = {"domain_ids": [np.full(len(c.token_ids), j) for c, j in zip(completions, index)]}
        if self.device_groups is not None:
            return fields, {}  # scored on the placed batch (``device``)
        per = [prompts[i // g] for i in range(len(completions))]
        tokens = [c.token_ids for c in completions]
        if self.jsd:
            got = self.registry.completion_topk(per, tokens, domains, self.top_k)
            fields["teacher_topk_ids"] = [ids for ids, _ in got]
            fields["teacher_topk_logp"] = [lp for _, lp in got]
        else:
            fields["teacher_logp"] = self.registry.completion_logprobs(per, tokens, domains)
        return fields, {}

    def device(self, state, rollouts, *, step):
        if self.device_groups is not None:
            # Placed once (``compiled.prepare`` then moves nothing); each local teacher's pass
            # runs on the whole batch and each token takes its domain's teacher's values.
            rollouts = step_lib.shard_batch(rollouts, self.mesh)
            top_k = self.top_k if self.jsd else None
            got = teachers.device_scores(self.device_groups, rollouts, top_k=top_k)
            rollouts = rollouts.replace(**got)
        return rollouts, teachers.metrics(rollouts, self.registry.names, jsd=self.jsd)
