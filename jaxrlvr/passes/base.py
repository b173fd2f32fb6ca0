"""The rollout pass interface (``RolloutPass``) that each pass module implements (``passes``
says what a pass is and lists them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from jaxrlvr.algos import batch as batch_lib

Where = Literal["host", "device", "both"]


class RolloutPass:
    """What a pass offers the rollout source and the learner (no-op defaults).

    Class attributes: ``name`` (its timer phase and how errors call it), ``where``, ``fields``
    (``Batch`` field -> "host" or "device": where the pass computes it; each a field registered
    with ``batch.register_field`` by the module that owns it).
    """

    name: ClassVar[str]
    where: ClassVar[Where]
    fields: ClassVar[dict[str, str]]

    @classmethod
    def from_config(cls, cfg, **run) -> RolloutPass | None:
        """The pass of a run (``run``: ``model_cfg``, ``graphdef``, ``mesh``, ``tokenizer``,
        ``problems``), checked, or None when the run does not use it."""
        raise NotImplementedError

    @property
    def timed_on_host(self) -> bool:
        """Whether the host part does this run's work (its time is then reported as
        ``time/<name>_s``): a pass that computes its fields on the device reports none."""
        return self.where != "device"

    def host(
        self,
        problems: Sequence[Any],
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Any],
    ) -> tuple[dict[str, list], dict[str, float]]:
        """On the trainer's host after grading: (fields per completion token, each an array
        [L] or [L, K] per completion for ``rollout.shape`` to lay out; metrics)."""
        return {}, {}

    def device(
        self, state: Any, rollouts: batch_lib.Batch, *, step: int
    ) -> tuple[batch_lib.Batch, dict[str, float]]:
        """Before the record's ``prepare`` (step ``step``): (rollouts with the pass's device
        fields, metrics)."""
        return rollouts, {}

    @property
    def can_stand_in(self) -> bool:
        """Whether ``host`` and ``stand_in`` can run on rollouts that stand in for a step's
        (compiling the learner's programs ahead: ``phases.rl.RLPhase.programs_ahead``) without
        a state or any outside effect. By default a pass without a device part: one that has
        one cannot say what it would hand on without running (then nothing is compiled
        ahead, and its host part never sees stand-ins)."""
        return self.where == "host"

    def stand_in(self, rollouts: batch_lib.Batch, *, step: int) -> batch_lib.Batch:
        """The rollouts as ``device`` would hand them on, computed without a state (the fields'
        shapes and dtypes are what counts), for a pass that ``can_stand_in``."""
        return rollouts

    def finish(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's prepare and update metrics (on the host) as the pass reports them."""
        return metrics
