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

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import jax
from flax import nnx

from jaxrlvr import checkpoint as checkpoint_lib
from jaxrlvr import compile_cache, prompts
from jaxrlvr import config as config_lib
from jaxrlvr import model as model_lib
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import registry
from jaxrlvr.algos import step as step_lib
from jaxrlvr.data import loading
from jaxrlvr.rewards import grading


@dataclasses.dataclass(eq=False)
class RunContext:
    """The run's components, assembled once (``assembly.assemble``) and shared by its phases.

    It holds no config: a phase reads its own sections (``Phase.sections``).

    Attributes:
      template: the prompt template (``data.template``) that renders a problem for the policy.
      train_problems: this process's training problems (its data shards', in shard order).
      train_shards: the data shards this process reads, by shard index.
      num_shards: the run's number of data shards (``assembly.data_shards``).
      row_block: (this process's row block, the number of blocks) (``step.process_row_block``).
      sampler: the rollout sampler, started when the run is assembled (on the initial weights;
        every phase hands it its weights before it samples).
    """

    run_dir: str
    mesh: jax.sharding.Mesh
    tokenizer: Any
    template: str
    model_cfg: model_lib.ModelConfig
    graphdef: nnx.GraphDef
    params_shape: nnx.State
    train_problems: list[loading.Problem]
    train_shards: dict[int, list[loading.Problem]]
    num_shards: int
    eval_problems: list[loading.Problem]
    row_block: tuple[int, int]
    grader: grading.Grader
    sampler: Any
    # The run's rollout passes (``passes.RolloutPass``: teacher scores, routing replay), in order.
    passes: tuple = ()

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def render(self, problem: loading.Problem) -> str:
        """The problem's prompt text, as the policy sees it."""
        return prompts.render(self.template, problem, self.tokenizer)

    def encode_prompts(self, problems: list[loading.Problem]) -> list[list[int]]:
        """The problems' rendered prompts as token ids."""
        return prompts.encode_many(self.tokenizer, [self.render(p) for p in problems])

    def sample(
        self,
        problems: list[loading.Problem],
        n: int,
        sampler_cfg: config_lib.SamplerSection,
        *,
        seed: int,
        first: int = 0,
        eval_mode: bool = False,
        generate: Callable | None = None,
    ) -> tuple[list[list[int]], list]:
        """(the prompts' token ids, ``n`` completions of each prompt, prompt-major) from the
        run's sampler with ``sampler``'s training (or ``eval_mode``) parameters.

        The one seeding rule of the run's sampling (rollouts, evaluation, pairs): ``problems``
        is this process's share of a list sampled with ``seed``, starting at index ``first`` of
        it. vLLM seeds prompt i with seed + i, so a share's seed is offset by ``first``; the JAX
        sampler runs one program over every process's rows with one seed, so it is not.
        ``generate(problems, prompt_ids, n, params)``: another way to call the sampler (the
        multi-turn source hands the environments their problems)."""
        prompt_ids = self.encode_prompts(problems)
        if sampler_cfg.kind != "jax":
            seed += first
        params = prompts.sampling_params(
            sampler_cfg, self.tokenizer, eval_mode=eval_mode, seed=seed
        )
        if generate is None:
            completions = self.sampler.generate(prompt_ids, n, params)
        else:
            completions = generate(problems, prompt_ids, n, params)
        if len(completions) != len(prompt_ids) * n:
            raise RuntimeError(
                f"sampler returned {len(completions)} completions for {len(prompt_ids)} x {n}"
            )
        return prompt_ids, completions

    def sample_and_grade(
        self,
        problems: list[loading.Problem],
        n: int,
        sampler_cfg: config_lib.SamplerSection,
        *,
        score: Callable | None = None,
        **sample_kw,
    ):
        """``sample`` (``sample_kw``: its ``seed``, ``first``, ``eval_mode``, ``generate``), then
        the grader's scores of every completion: (prompt ids, completions, scores,
        ``grading.GradingStats``). ``score(problems, completions, n)``: another way to score
        them (the multi-turn source adds the environments' rewards)."""
        prompt_ids, completions = self.sample(problems, n, sampler_cfg, **sample_kw)
        if score is None:
            scores, stats = self.grader.grade(problems, [c.text for c in completions], n)
        else:
            scores, stats = score(problems, completions, n)
        return prompt_ids, completions, scores, stats

    def compile_ahead(
        self,
        calls: list[tuple[list[loading.Problem], int, config_lib.SamplerSection, bool]],
        then: Phase | None = None,
        *,
        after: threading.Thread | threading.Event | None = None,
    ):
        """Lowers, here, and starts compiling, on a background thread once ``after`` is done
        (``compile_cache.wait_for``), the sampler programs that ``sample`` will run for
        ``calls`` (problems, samples per problem, sampler section, eval mode), in that order,
        then the first-step programs of the phase ``then`` (``Phase.programs_ahead``; its
        first step joins the thread, ``Phase.ahead``). Returns the thread, or None where
        nothing is compiled ahead: a multi-process job (its processes must compile the same
        programs in the same order), and for the sampler's part a sampler that compiles
        nothing (vLLM, the multi-turn wrapper). A call whose shapes differ from the guess just
        compiles its own program, as without this."""
        if self.row_block[1] > 1 or jax.process_count() > 1:
            return None
        thread, jobs = None, []
        precompile = getattr(self.sampler, "precompile_in_background", None)
        for problems, n, sampler_cfg, eval_mode in calls if precompile is not None else ():
            if problems and sampler_cfg.kind == "jax":
                params = prompts.sampling_params(
                    sampler_cfg, self.tokenizer, eval_mode=eval_mode, seed=0
                )
                jobs.append((self.encode_prompts(problems), n, params))
        if jobs:
            thread = precompile(jobs, after=after)
        programs = then.programs_ahead() if then is not None else []
        if programs:
            thread = then.ahead = compile_cache.compile_in_background(
                programs, after=thread or after
            )
            then.ahead_programs = len(programs)
        return thread

    def compiled_ahead(self, phases: list[Phase]) -> dict[str, Any]:
        """What ``compile_ahead`` compiled and how much of it ran: the sampler's programs
        (``programs``, ``used``) and a phase's first-step programs (``step_programs``;
        ``step_used``: whether its first step ran them, compiling and loading nothing)."""
        ahead = getattr(self.sampler, "compiled_ahead", None)
        out = dict(ahead()) if ahead is not None else {}
        for p in phases:
            if p.ahead_programs:
                out.update(step_programs=p.ahead_programs, step_used=p.ahead_used)
        return out

    def close(self) -> None:
        """Stops the sampler and the grading pool (each even if the other fails)."""
        for close in (self.sampler.close, self.grader.close):
            with contextlib.suppress(Exception):
                close()


class Sections:
    """The config sections a phase declared (``Phase.sections``), read as ``cfg.<section>``;
    reading any other section is an error naming the phase, so what a phase reads is listed in
    one place."""

    def __init__(self, cfg: config_lib.TrainConfig, names: tuple[str, ...], owner: str):
        self._cfg, self._names, self._owner = cfg, frozenset(names), owner

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._names:
            raise AttributeError(
                f"phase {self._owner!r} reads config section {name!r}, which is not one of its "
                f"sections {sorted(self._names)}"
            )
        return getattr(self._cfg, name)


@dataclasses.dataclass(frozen=True)
class BatchGeometry:
    """One step's batch of a phase, as the mesh and the data shards must split it.

    Attributes:
      rows: rows per step (unpacked: the sequences; packed: at most that many rows).
      rows_key: the config keys that set ``rows`` (for messages).
      microbatches: the update's microbatches; section: the config section that sets them.
      packed: whether the rows are packed (their count is rounded up to a multiple of
        microbatches x batch shards, so only a multiple above ``rows`` is refused).
      per_shard: (count, key) that every data shard's share must divide, or None.
    """

    rows: int
    rows_key: str
    microbatches: int
    section: str
    packed: bool
    per_shard: tuple[int, str] | None = None


@dataclasses.dataclass(frozen=True)
class DataFile:
    """A data file a phase reads: its config key, its value (None: not set, which preflight
    refuses with ``missing``), and the batch it must fill."""

    key: str
    path: str | None
    batch: int
    batch_key: str
    missing: str = ""


@dataclasses.dataclass
class StepInfo:
    """What a hook sees after a step: the phase that stepped, the run's step count, the step's
    metrics (a hook may add to them: the evaluation's land in the same line), and whether the
    run stops after this step."""

    phase: Phase
    step: int
    metrics: dict[str, float]
    stopping: bool = False


@dataclasses.dataclass(frozen=True)
class Hook:
    """Periodic work after a step, registered as data (levanter's ``add_hook(fn, every=N)``).

    ``fn(info)`` runs after a step of the phase when its step count is a multiple of ``every``
    (None or 0: never by count), after the phase's last step when ``at_phase_end``, and on an
    agreed stop when ``on_stop``. The loop's hooks run in registration order, then the phase's
    own (``Phase.hooks``)."""

    name: str
    fn: Callable[[StepInfo], None]
    every: int | None = 1
    at_phase_end: bool = False
    on_stop: bool = False

    def due(self, info: StepInfo) -> bool:
        phase = info.phase
        return bool(
            (self.every and phase.position % self.every == 0)
            or (self.at_phase_end and phase.done)
            or (self.on_stop and info.stopping)
        )


class Phase:
    """One training phase: its record, state, batch source and position; one ``step`` at a time.

    A phase owns what is its own, as class-level answers the run asks before anything is built
    (``wanted``, ``geometry``, ``check``, ``data_files``) and as the parts of the run's summary
    it fills (``summary``). Subclasses set ``name`` (the phase's key in checkpoints and metrics),
    ``sections`` (the config sections it reads: ``self.cfg`` holds only these),
    ``method`` (the registered method whose record it trains, ``algos.registry``) and implement
    ``step``; the rest has defaults.
    """

    name: ClassVar[str]
    sections: ClassVar[tuple[str, ...]]
    # Whether the phase samples completions of the training prompts (their lengths are checked
    # against the model's positions before the run starts).
    samples_train_prompts: ClassVar[bool] = False
    # ``wrap(view, sampler, tokenizer)``: the run's sampler as this phase needs it (the tool-use
    # phases': multi-turn); the assembly applies each distinct wrapper of the run's phases once.
    sampler_wrapper: ClassVar[Callable[[Sections, Any, Any], Any] | None] = None

    def __init__(self, ctx: RunContext, cfg: config_lib.TrainConfig):
        self.ctx = ctx
        self.cfg = self.view(cfg)
        self.position = 0  # steps done
        self.state = None
        self.compiled: step_lib.CompiledAlgorithm | None = None
        # The thread compiling ``programs_ahead`` (``RunContext.compile_ahead``), joined by the
        # first step; how many programs; whether the first step ran them (set by the phase).
        self.ahead: threading.Thread | None = None
        self.ahead_programs = 0
        self.ahead_used: bool | None = None

    # -- what the run asks the phase before it is built -------------------------------------------
    # Each of these gets the phase's ``view`` of the config: its own sections only.
    @classmethod
    def view(cls, cfg: config_lib.TrainConfig) -> Sections:
        """``cfg`` as the phase may read it: its ``sections`` only."""
        return Sections(cfg, cls.sections, cls.name)

    @classmethod
    def wanted(cls, cfg: Sections) -> bool:
        """Whether a run of ``cfg`` has this phase (``phases.plan`` asks each phase of the plan)."""
        raise NotImplementedError

    @classmethod
    def geometry(cls, cfg: Sections) -> BatchGeometry | None:
        """The phase's batch per step (None: no steps), checked against the mesh and the data
        shards before anything is built."""
        return None

    @classmethod
    def check(cls, cfg: Sections, *, processes: int, shards: int, where: str) -> None:
        """One-line config error when the phase cannot run ``cfg`` in a job of ``processes`` on a
        mesh whose batch axes make ``shards`` batch shards (``where``: those axes, for the
        message)."""

    @classmethod
    def data_files(cls, cfg: Sections) -> list[DataFile]:
        """The data files the phase reads, checked (exist, parse, fill a batch) by preflight."""
        return []

    @classmethod
    def method(cls, cfg: Sections) -> str:
        """The registered method (``algos.registry``) whose record the phase trains; checkpoints
        record it with the phase's name."""
        raise NotImplementedError

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

    def hooks(self) -> list[Hook]:
        """The phase's own hooks, run after the loop's."""
        return []

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The progress bar's fields after a step."""
        return {"phase": self.name}

    @classmethod
    def summary_defaults(cls, evals: dict[str, dict]) -> dict[str, Any]:
        """The phase's fields of the summary of a run without it (every phase of
        ``phases.PLAN`` is asked, so a summary has the same keys whatever the run's phases)."""
        return {}

    def summary(self, evals: dict[str, dict]) -> dict[str, Any]:
        """The phase's fields of the run's summary; ``evals``: the held-out evaluation after each
        finished phase, by name ("start": before any step)."""
        return {}

    def report(self, summary: dict[str, Any]) -> list[str]:
        """The lines ``train.run`` prints for this phase when the run ends (``summary``: the
        run's, ``Phase.summary`` fields included)."""
        return []

    # -- record and state -------------------------------------------------------------------------
    def make_algorithm(self, microbatches: int | None = None) -> algorithm_lib.Algorithm:
        ctx = self.ctx
        return registry.build(
            self.method(self.cfg),
            self.cfg,
            ctx.graphdef,
            ctx.params_shape,
            ctx.mesh,
            microbatches=microbatches,
        )

    def enter(self, params: nnx.State, rng: jax.Array) -> None:
        """The phase's record, its fresh state from ``params``, and the compiled prepare/update."""
        self.build_compiled()
        self.state = jax.device_put(self.algorithm.init(params, rng), self.shardings)

    def build_compiled(self) -> None:
        """The phase's record, its state's shardings and its compiled prepare/update, built
        once: by ``enter``, or before it by ``programs_ahead`` (``enter`` then runs the
        programs compiled ahead, which belong to these jit objects)."""
        if self.compiled is not None:
            return
        self.algorithm = self.make_algorithm()
        _, self.shardings = checkpoint_lib.abstract_state(
            self.algorithm, self.ctx.params_shape, self.ctx.mesh
        )
        self.compiled = step_lib.CompiledAlgorithm(self.algorithm, self.ctx.mesh, self.shardings)

    def programs_ahead(self) -> list[jax.stages.Lowered]:
        """Programs of the phase's first step, lowered (tracing holds the GIL, so on the
        caller's thread) for the run to compile on a background thread while an earlier phase
        trains (``run.compile_ahead``); the first step then waits for ``ahead``, the thread
        that compiles them. None by default ([])."""
        return []

    def abstract_state(self):
        """The state's shape with its target shardings: what a checkpoint restores into."""
        ctx = self.ctx
        return checkpoint_lib.abstract_state(self.make_algorithm(), ctx.params_shape, ctx.mesh)[0]

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

    def sampler_calls(self) -> list[tuple[list[loading.Problem], int, Any, bool]]:
        """The sampler calls of the phase's next step, as ``RunContext.compile_ahead`` takes
        them (none by default: a phase that does not sample)."""
        return []

    def close(self) -> None:
        """Stops what the phase started (threads); the context's components are the loop's."""


class RLStepsPhase(Phase):
    """A phase of ``rl.steps`` steps, evaluated every ``eval.every`` steps: the method of
    ``rl.algo`` (RL or offline preference). ``reward_metric``: the step metric the progress bar
    shows."""

    reward_metric: ClassVar[str]

    @classmethod
    def method(cls, cfg):
        return cfg.rl.algo

    @property
    def total_steps(self) -> int:
        return self.cfg.rl.steps

    @property
    def eval_every(self) -> int:
        return self.cfg.eval.every

    def postfix(self, metrics):
        reward = metrics.get(self.reward_metric, float("nan"))
        return {"phase": self.cfg.rl.algo, "reward": f"{reward:.2f}"}

    @classmethod
    def summary_defaults(cls, evals):
        return {"algo": registry.NONE, "rl_steps": 0}

    def summary(self, evals):
        return {"algo": self.cfg.rl.algo, "rl_steps": self.position}

    def report(self, summary):
        final = accuracy_text(summary["eval_accuracy_final"])
        return [f"held-out accuracy after {self.cfg.rl.algo.upper()}: {final}"]


def accuracy_text(accuracy: float | None) -> str:
    """A held-out accuracy as the run's last lines print it ("n/a": not evaluated)."""
    return "n/a" if accuracy is None else f"{accuracy:.3f}"
