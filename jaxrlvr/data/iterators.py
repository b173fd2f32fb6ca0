"""Prompt iterators with saved and restored positions: epoch-wise shuffling and a curriculum.

``PromptIterator`` walks an epoch-wise permutation drawn from ``(seed, epoch)``, so the order is a
pure function of the seed and the iterator's whole state is three integers (JSON-serialisable,
stored in checkpoints beside the model) and the ids it has retired. ``retire(ids)`` takes
problems out of the pool for good (ScaleRL's No-Positive-Resampling, Khatri et al. 2025: a prompt
solved at a pass rate >= 0.9 is not drawn again; the RL phase's ``rl.retire_pass_rate``): later
batches skip them, and the permutations stay those of the full list, so a resumed run draws the
same batches.

``CurriculumPromptIterator`` samples each batch (without replacement within the batch) with
probability proportional to ``max(1 - success_rate, min_weight)``, using a per-problem
``SuccessRateTracker`` that the training loop feeds with rewards. The batch at step ``s`` is drawn
from ``(seed, s)``, so restoring the step and the tracker restores the sampling exactly.
Left out: difficulty pre-filtering with a reference model (that needs the sampler).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrlvr.data import loading


def _item_id(item) -> str | None:
    """A problem's id; None for items without one (preference pairs, a data shard's rows), which
    ``retire`` never takes out."""
    return getattr(item, "id", None)


class PromptIterator:
    """Infinite batches of problems in a deterministic per-epoch shuffled order.

    Args:
      problems: the problems (at least one); any items (preference pairs, a shard's rows) walk
        the same way, and only items with an ``id`` can be retired.
      batch_size: problems per batch (>= 1); a batch may span an epoch boundary.
      seed: shuffling seed.
    """

    def __init__(self, problems: Sequence[loading.Problem], batch_size: int, seed: int = 0):
        if not problems:
            raise ValueError("PromptIterator needs at least one problem")
        if batch_size < 1:
            raise ValueError(f"PromptIterator batch_size must be >= 1, got {batch_size}")
        self.problems = list(problems)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self.retired: set[str] = set()
        self._ids = {_item_id(p) for p in self.problems} - {None}
        self._order = self._permutation(self.epoch)

    def retire(self, problem_ids: Sequence[str]) -> None:
        """Never draw these problems again (ids not in this iterator's list are ignored)."""
        self.retired.update(str(i) for i in problem_ids if str(i) in self._ids)

    @property
    def num_retired(self) -> int:
        """How many problems are retired."""
        return len(self.retired)

    @property
    def active(self) -> int:
        """How many problems are still drawn (not retired)."""
        return sum(_item_id(p) not in self.retired for p in self.problems)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))

    def next_batch(self) -> list[loading.Problem]:
        """The next ``batch_size`` problems that are not retired; advances the position.

        Raises:
          ValueError: every problem is retired.
        """
        if self.retired and not self.active:
            raise ValueError(
                f"PromptIterator: all {len(self.problems)} problems are retired "
                "(rl.retire_pass_rate); nothing is left to draw"
            )
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self.problems):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            problem = self.problems[self._order[self.position]]
            self.position += 1
            if _item_id(problem) not in self.retired:
                batch.append(problem)
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> list[loading.Problem]:
        return self.next_batch()

    def state_dict(self) -> dict:
        """``{"epoch", "position", "seed", "num_problems", "retired"}``: ints and the sorted
        retired ids (JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_problems": len(self.problems),
            "retired": sorted(self.retired),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``; the problem list must be the same size."""
        expected = state.get("num_problems", len(self.problems))
        if expected != len(self.problems):
            raise ValueError(
                f"PromptIterator state is for {expected} problems, this one has "
                f"{len(self.problems)}"
            )
        if not 0 <= state["position"] <= len(self.problems):
            raise ValueError(f"PromptIterator state position {state['position']} out of range")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.retired = {str(i) for i in state.get("retired", ())}
        self._order = self._permutation(self.epoch)


class SuccessRateTracker:
    """Per-problem success rate with a Beta(prior_successes, prior_failures) prior.

    A sample counts as a success when its reward is >= ``threshold``.
    """

    def __init__(
        self,
        *,
        prior_successes: float = 1.0,
        prior_failures: float = 1.0,
        threshold: float = 1.0,
    ):
        if prior_successes <= 0 or prior_failures <= 0:
            raise ValueError("SuccessRateTracker priors must be > 0")
        self.prior_successes = float(prior_successes)
        self.prior_failures = float(prior_failures)
        self.threshold = float(threshold)
        self.successes: dict[str, int] = {}
        self.attempts: dict[str, int] = {}

    def update(self, problem_ids: Sequence[str], rewards: Sequence[float]) -> None:
        """Record one reward per sample (ids may repeat, e.g. G samples per prompt)."""
        if len(problem_ids) != len(rewards):
            raise ValueError(f"{len(problem_ids)} ids but {len(rewards)} rewards")
        for pid, reward in zip(problem_ids, rewards, strict=True):
            self.attempts[pid] = self.attempts.get(pid, 0) + 1
            self.successes[pid] = self.successes.get(pid, 0) + int(float(reward) >= self.threshold)

    def rate(self, problem_id: str) -> float:
        """Posterior-mean success rate (the prior mean for unseen problems)."""
        s = self.successes.get(problem_id, 0) + self.prior_successes
        n = self.attempts.get(problem_id, 0) + self.prior_successes + self.prior_failures
        return s / n

    def state_dict(self) -> dict:
        return {
            "prior_successes": self.prior_successes,
            "prior_failures": self.prior_failures,
            "threshold": self.threshold,
            "successes": dict(self.successes),
            "attempts": dict(self.attempts),
        }

    def load_state_dict(self, state: dict) -> None:
        self.prior_successes = float(state["prior_successes"])
        self.prior_failures = float(state["prior_failures"])
        self.threshold = float(state["threshold"])
        self.successes = {str(k): int(v) for k, v in state["successes"].items()}
        self.attempts = {str(k): int(v) for k, v in state["attempts"].items()}


class CurriculumPromptIterator:
    """Batches sampled in proportion to ``max(1 - success_rate, min_weight)``.

    Args:
      problems: the problems (ids must be unique).
      batch_size: distinct problems per batch (<= len(problems)).
      seed: sampling seed.
      tracker: the success-rate tracker (a fresh one by default).
      min_weight: floor on the weight, so solved problems are still revisited now and then.

    Feed it with ``update(problem_ids, rewards)`` after grading.
    """

    def __init__(
        self,
        problems: Sequence[loading.Problem],
        batch_size: int,
        seed: int = 0,
        *,
        tracker: SuccessRateTracker | None = None,
        min_weight: float = 0.05,
    ):
        if not 1 <= batch_size <= len(problems):
            raise ValueError(
                f"CurriculumPromptIterator batch_size must be in [1, {len(problems)}], "
                f"got {batch_size}"
            )
        if len({p.id for p in problems}) != len(problems):
            raise ValueError("CurriculumPromptIterator needs unique problem ids")
        if not 0 < min_weight <= 1:
            raise ValueError(
                f"CurriculumPromptIterator min_weight must be in (0, 1], got {min_weight}"
            )
        self.problems = list(problems)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.step = 0
        self.min_weight = float(min_weight)
        self.tracker = tracker if tracker is not None else SuccessRateTracker()

    def weights(self) -> np.ndarray:
        """Sampling probabilities over ``problems`` (sum to 1)."""
        w = np.array([max(1.0 - self.tracker.rate(p.id), self.min_weight) for p in self.problems])
        return w / w.sum()

    def next_batch(self) -> list[loading.Problem]:
        rng = np.random.default_rng([self.seed, self.step])
        idx = rng.choice(len(self.problems), size=self.batch_size, replace=False, p=self.weights())
        self.step += 1
        return [self.problems[i] for i in idx]

    def update(self, problem_ids: Sequence[str], rewards: Sequence[float]) -> None:
        self.tracker.update(problem_ids, rewards)

    def __iter__(self):
        return self

    def __next__(self) -> list[loading.Problem]:
        return self.next_batch()

    def state_dict(self) -> dict:
        """``{"step", "seed", "num_problems", "tracker"}`` (JSON-serialisable)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "num_problems": len(self.problems),
            "tracker": self.tracker.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_problems", len(self.problems)) != len(self.problems):
            raise ValueError("CurriculumPromptIterator state is for a different problem list")
        self.step = int(state["step"])
        self.seed = int(state["seed"])
        self.tracker.load_state_dict(state["tracker"])
