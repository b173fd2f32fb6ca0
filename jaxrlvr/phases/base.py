"""What every training phase shares: the run's components (``RunContext``) and the ``Phase`` shape.

A phase (SFT warm start, RL, offline preference; later tool-use RL) owns its ``Algorithm`` record
and compiled step, its train state, its batch source and its checkpointed position, and offers
one ``step``. The loop in ``train`` drives phases one after the other and runs the periodic hooks
(evaluation, checkpoints, metrics, progress) around them; it never looks inside a phase.

A phase's life, as the loop sees it:

    phase = Cls(ctx)                   nothing built yet
    phase.enter(params, rng)           its record and fresh state (from the previous phase's params)
    phase.state = restored             on --resume, the checkpoint's state replaces it
    phase.load_state_dict(position)    on --resume, the data position and anything in flight
    phase.begin()                      before its first step of this process (weight sync, ...)
    phase.step() -> metrics            until phase.done
    phase.finish()                     after its last step (the sampler gets the final weights)

Not here: which phases a run has (``phases.plan``) and the loop itself (``train``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import jax
from flax import nnx

from jaxrlvr import builders, methods
from jaxrlvr import config as config_lib
from jaxrlvr import model as model_lib
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import step as step_lib
from jaxrlvr.data import loading
from jaxrlvr.rewards import grading, verifiers


@dataclasses.dataclass(eq=False)
class RunContext:
    """The run's components, built once (``train.Trainer``) and shared by its phases.

    Attributes:
      train_problems: this process's training problems (its data shards', in shard order).
      train_shards: the data shards this process reads, by shard index.
      num_shards: the run's number of data shards (``builders.data_shards``).
      row_block: (this process's row block, the number of blocks) (``step.process_row_block``).
      current_params: the live policy parameters (the current phase's state's), which a sampler
        started on first use begins with.
    """

    cfg: config_lib.TrainConfig
    run_dir: str
    mesh: jax.sharding.Mesh
    tokenizer: Any
    model_cfg: model_lib.ModelConfig
    graphdef: nnx.GraphDef
    params_shape: nnx.State
    train_problems: list[loading.Problem]
    train_shards: dict[int, list[loading.Problem]]
    num_shards: int
    eval_problems: list[loading.Problem]
    row_block: tuple[int, int]
    reward_fn: verifiers.RewardFn
    pool: grading.GradingPool
    current_params: Callable[[], nnx.State]
    _sampler: Any = None
    # The grading pool serves one call at a time (the async producer grades the difficulty
    # filter's candidates on its own thread).
    _grade_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def sampler(self):
        """The rollout sampler, started on first use on the live parameters."""
        if self._sampler is None:
            model = nnx.merge(self.graphdef, self.current_params())
            self._sampler = builders.build_sampler(
                self.cfg, model, self.tokenizer, self.mesh, self.run_dir
            )
        return self._sampler

    @property
    def sampler_started(self) -> bool:
        return self._sampler is not None

    def encode_prompts(self, problems: list[loading.Problem]) -> list[list[int]]:
        """The problems' rendered prompts as token ids."""
        cfg, tok = self.cfg, self.tokenizer
        return builders.encode_many(tok, [builders.render(cfg, p, tok) for p in problems])

    def grade(self, problems: list[loading.Problem], texts: list[str], n: int):
        """(scores, stats) of ``n`` completions per problem (problem-major) by the run's grader."""
        truths = [p.answer for p in problems for _ in range(n)]
        with self._grade_lock:
            return self.pool.grade(self.reward_fn, texts, truths)


class Phase:
    """One training phase: its record, state, batch source and position; one ``step`` at a time.

    Subclasses set ``name`` (the phase's key in checkpoints and metrics), ``algorithm_phase`` (the
    record ``methods.make_algorithm`` builds for it) and implement ``step``; the rest has
    defaults.
    """

    name: ClassVar[str]
    algorithm_phase: ClassVar[str]
    # Whether the phase samples completions of the training prompts (their lengths are checked
    # against the model's positions before the run starts).
    samples_train_prompts: ClassVar[bool] = False

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.position = 0  # steps done
        self.state = None
        self.compiled: step_lib.CompiledAlgorithm | None = None

    # -- what the loop reads --------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        return self.position >= self.total_steps

    @property
    def eval_every(self) -> int | None:
        """Evaluate after every this many steps of the phase (None: only after its last)."""
        return None

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The progress bar's fields after a step."""
        return {"phase": self.name}

    # -- record and state -------------------------------------------------------------------------
    def make_algorithm(self, microbatches: int | None = None) -> algorithm_lib.Algorithm:
        ctx = self.ctx
        return methods.make_algorithm(
            self.cfg,
            self.algorithm_phase,
            ctx.graphdef,
            ctx.params_shape,
            ctx.mesh,
            microbatches=microbatches,
        )

    def enter(self, params: nnx.State, rng: jax.Array) -> None:
        """The phase's record, its fresh state from ``params``, and the compiled prepare/update."""
        self.algorithm = self.make_algorithm()
        _, self.shardings = methods.abstract_state(
            self.algorithm, self.ctx.params_shape, self.ctx.mesh
        )
        self.state = jax.device_put(self.algorithm.init(params, rng), self.shardings)
        self.compiled = step_lib.CompiledAlgorithm(self.algorithm, self.ctx.mesh, self.shardings)

    def abstract_state(self):
        """The state's shape with its target shardings: what a checkpoint restores into."""
        return methods.abstract_state(self.make_algorithm(), self.ctx.params_shape, self.ctx.mesh)[
            0
        ]

    # -- life -------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Before the first step this process runs of the phase (fresh or resumed)."""

    def step(self) -> dict[str, float]:
        raise NotImplementedError

    def finish(self) -> None:
        """After the phase's last step."""

    def state_dict(self) -> dict[str, Any]:
        """The phase's host-side position (JSON), saved with every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def close(self) -> None:
        """Stops what the phase started (threads); the context's components are the loop's."""


class RLStepsPhase(Phase):
    """A phase of ``rl.steps`` steps, evaluated every ``eval.every`` steps: the method of
    ``rl.algo`` (RL or offline preference). ``reward_metric``: the step metric the progress bar
    shows."""

    reward_metric: ClassVar[str]

    @property
    def total_steps(self) -> int:
        return self.cfg.rl.steps

    @property
    def eval_every(self) -> int:
        return self.cfg.eval.every

    def postfix(self, metrics):
        reward = metrics.get(self.reward_metric, float("nan"))
        return {"phase": self.cfg.rl.algo, "reward": f"{reward:.2f}"}
