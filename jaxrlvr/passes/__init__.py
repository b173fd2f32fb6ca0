"""Rollout passes: features that add data to a step's graded rollouts, each one module.

A pass (``RolloutPass``) declares the ``Batch`` fields it adds (``fields``: name -> where it
computes them), where it runs (``where``: "host", "device" or "both"), its checks (made when it
is built, from the run's config and model, before any compute) and its metrics (once, in the
pass). Each field is declared once, with its layout and dtype class, by the module that owns it
(``batch.register_field``: ``algos.distill``'s teacher scores, ``teachers.registry``'s domain
ids, ``algos.routing``'s routes). The carriers move its fields without knowing them:
``GradedRollouts.fields`` (per completion token, from ``host``), ``rollout.shape`` (laid out like
the sampler's log-probs), ``Batch.extra`` (by name), the learner (``device`` before the record's
``prepare``; ``finish`` on the step's device metrics).

``passes()`` lists them in the order they run; ``build`` makes the run's (each pass's
``from_config`` returns None when the run does not need it). A new pass is its module plus one
line here.

- ``teacher_scores.TeacherScores``: on-policy distillation's teacher log-probs or top-k.
- ``routing_replay.RoutingReplay``: MoE routes checked, replayed (r3, r2) or compared
  (``rl.routing_metrics``).

Not here: the features' math (``algos.routing``, ``algos.distill``), the teachers themselves
(``teachers``).
"""

from __future__ import annotations

from jaxrlvr.passes import routing_replay, teacher_scores
from jaxrlvr.passes.base import RolloutPass, Where

__all__ = ["RolloutPass", "Where", "build", "passes"]


def passes() -> tuple[type[RolloutPass], ...]:
    """Every pass class, in the order they run."""
    return (teacher_scores.TeacherScores, routing_replay.RoutingReplay)


def build(cfg, **run) -> tuple[RolloutPass, ...]:
    """The run's passes (``RolloutPass.from_config`` of each), checked, in order."""
    built = (cls.from_config(cfg, **run) for cls in passes())
    return tuple(p for p in built if p is not None)
