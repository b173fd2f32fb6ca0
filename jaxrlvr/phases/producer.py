"""Asynchronous rollouts: the batch of step t + k is generated while the trainer updates step t.

``rl.max_staleness`` = k. The RL phase's rollout source (``phases.sources``) and a
`RolloutProducer` share one schedule, fixed in advance so that runs are reproducible and
resumable bit for bit:

    step t:  submit(t + k)        the producer's thread generates step t + k's batch with the
                                  sampler's current weights, version t (the policy after t updates)
             pop(t)               step t's batch, generated at step t - k by version t - k
             grade, shape, prepare, update      (the producer generates meanwhile)
             wait()               "waiting": the trainer blocks until step t + k's batch is done
             sync                 the sampler moves to version t + 1

so every batch from step k on is exactly k versions old (steps t < k: t versions; they are
generated before step 0 by version 0). `check_lag` enforces ``lag <= k`` on every batch, from the
versions the sampler stamped on the completions (``Completion.weight_version``), never from the
schedule itself.

One generation is in flight at a time, on one thread of this process (the sampler is a JAX
program on devices of its own, ``sampler.jax_devices``, or HTTP requests to vLLM servers, so
the work itself runs off the trainer's Python thread). Waiting happens in one place: ``wait``
before the weight sync, because the sampler holds one set of weights and step t + k's batch must
be finished by version t before version t + 1 arrives. With k > 1 the schedule keeps that exact
lag, but it overlaps no more than k = 1: one batch is generated per update either way.

Checkpoints: the batches already generated for steps after the checkpoint (k of them) are saved
with it (`RolloutProducer.state_dict`: problems, prompt ids, completions with their sampler
log-probs and versions; JSON in the checkpoint's metadata) rather than regenerated, since the
weights that generated them are gone. The data iterator's position is saved past them.

Left out: more than one generation in flight, and in-flight weight updates (PipelineRL), which
would make a completion's tokens come from several versions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jaxrlvr.data import loading
from jaxrlvr.sampling import base


@dataclasses.dataclass
class Rollouts:
    """One step's sampled batch, as the producer hands it to the trainer.

    Attributes:
      step: the RL step that trains on it.
      problems: the step's problems (after the difficulty filter, if any).
      prompts: their prompt token ids.
      completions: ``len(problems) * group_size`` completions, prompt-major.
      metrics: the sampling's own metrics (difficulty filter).
      generate_s: seconds the generation took (on the producer's thread).
    """

    step: int
    problems: list[loading.Problem]
    prompts: list[list[int]]
    completions: list[base.Completion]
    metrics: dict[str, float]
    generate_s: float = 0.0

    @property
    def version(self) -> int | None:
        """The weight version that generated every completion; raises if they disagree."""
        versions = {c.weight_version for c in self.completions}
        if len(versions) != 1:
            raise RuntimeError(
                f"step {self.step}: completions of one batch come from weight versions "
                f"{sorted(versions, key=str)}"
            )
        return versions.pop()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "problems": [dataclasses.asdict(p) for p in self.problems],
            "prompts": self.prompts,
            "completions": [_completion_json(c) for c in self.completions],
            "metrics": self.metrics,
            "generate_s": self.generate_s,
        }

    @classmethod
    def from_json(
        cls, data: dict, completion_cls: type[base.Completion] = base.Completion
    ) -> Rollouts:
        """The batch ``to_json`` wrote; its completions are ``completion_cls`` (the rollout
        source's: plain completions or multi-turn trajectories)."""
        return cls(
            step=int(data["step"]),
            problems=[loading.Problem(**p) for p in data["problems"]],
            prompts=[list(p) for p in data["prompts"]],
            completions=[completion_cls(**_completion_fields(c)) for c in data["completions"]],
            metrics=dict(data["metrics"]),
            generate_s=float(data.get("generate_s", 0.0)),
        )


def _completion_json(c: base.Completion) -> dict:
    """A completion as JSON; MoE routes (``Completion.routes``) as their dtype and nested ids."""
    out = dataclasses.asdict(c)
    if out.get("routes") is not None:
        routes = np.asarray(out["routes"])
        out["routes"] = {"dtype": routes.dtype.name, "ids": routes.tolist()}
    return out


def _completion_fields(data: dict) -> dict:
    """``_completion_json``'s inverse (routes back to an array of their dtype)."""
    routes = data.get("routes")
    if isinstance(routes, dict):
        data = {**data, "routes": np.asarray(routes["ids"], routes["dtype"])}
    return data


def check_lag(rollouts: Rollouts, trainer_version: int, max_staleness: int) -> int:
    """The batch's version lag (trainer version - sampler version); raises if it exceeds
    ``max_staleness`` or the sampler stamped no version."""
    version = rollouts.version
    if version is None:
        raise RuntimeError(
            f"step {rollouts.step}: the sampler stamped no weight version on its completions"
        )
    lag = trainer_version - version
    if not 0 <= lag <= max_staleness:
        raise RuntimeError(
            f"step {rollouts.step}: rollouts of weight version {version} are {lag} versions "
            f"behind the trainer's {trainer_version}; rl.max_staleness={max_staleness}"
        )
    return lag


class RolloutProducer:
    """Generates batches ahead of the trainer on one background thread (module docstring).

    Args:
      make_rollouts: ``make_rollouts(step) -> Rollouts`` for a step. It is called on the
        trainer's thread and returns a zero-argument callable that does the generation (run on
        the producer's thread): host-side state (the data iterator) advances in step order on
        the trainer's thread, only the sampling runs concurrently.
      max_staleness: k >= 1.
      completion_cls: the completions' type, for the batches a checkpoint restores.
    """

    def __init__(
        self,
        make_rollouts: Callable[[int], Callable[[], Rollouts]],
        max_staleness: int,
        *,
        completion_cls: type[base.Completion] = base.Completion,
    ):
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: the producer needs k >= 1")
        self._make = make_rollouts
        self._completion_cls = completion_cls
        self.max_staleness = max_staleness
        self._ready: dict[int, Rollouts] = {}
        self._inflight: tuple[int, concurrent.futures.Future] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
        self.next_step = 0  # the first step not yet submitted

    def fill(self, step: int, last_step: int) -> None:
        """Generates, synchronously, the batches of ``step .. step + k - 1`` (up to
        ``last_step``, exclusive) that are neither ready nor in flight: the first k steps of a
        run (by version 0). A resumed run has them from its checkpoint."""
        self.next_step = max(self.next_step, step)
        while self.next_step < min(step + self.max_staleness, last_step):
            job = self._make(self.next_step)
            self._ready[self.next_step] = _timed(job)
            self.next_step += 1

    def submit(self, step: int) -> None:
        """Starts generating ``step``'s batch on the producer's thread."""
        if self._inflight is not None:
            raise RuntimeError(f"step {step}: step {self._inflight[0]}'s batch is still in flight")
        if step != self.next_step:
            raise RuntimeError(f"submit({step}): the next step to generate is {self.next_step}")
        job = self._make(step)
        self._inflight = (step, self._executor.submit(_timed, job))
        self.next_step += 1

    def wait(self) -> None:
        """Blocks until the batch in flight (if any) is generated; re-raises its error."""
        if self._inflight is None:
            return
        step, future = self._inflight
        self._inflight = None
        self._ready[step] = future.result()

    def pop(self, step: int) -> Rollouts:
        """``step``'s batch (it must have been generated: ``fill`` or ``submit`` + ``wait``)."""
        if step not in self._ready:
            raise RuntimeError(
                f"step {step}: no generated batch (ready: {sorted(self._ready)}, in flight: "
                f"{None if self._inflight is None else self._inflight[0]})"
            )
        return self._ready.pop(step)

    def peek(self, step: int) -> Rollouts | None:
        """``step``'s generated batch if it is ready, without taking it (tests, benchmarks)."""
        return self._ready.get(step)

    def state_dict(self) -> dict:
        """The generated, untrained batches (JSON-serialisable); call between steps."""
        self.wait()
        return {
            "next_step": self.next_step,
            "ready": [self._ready[s].to_json() for s in sorted(self._ready)],
        }

    def load_state_dict(self, state: dict) -> None:
        self._ready = {}
        for item in state["ready"]:
            r = Rollouts.from_json(item, self._completion_cls)
            self._ready[r.step] = r
        self.next_step = int(state["next_step"])

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _timed(job: Callable[[], Rollouts]) -> Rollouts:
    t0 = time.perf_counter()
    out = job()
    out.generate_s = time.perf_counter() - t0
    return out
