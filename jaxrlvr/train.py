"""The driver: a loop over phases, with evaluation, checkpoints, metrics and progress as hooks.

``phases.plan`` chooses the run's phases from the config (an SFT warm start, then RL or offline
preference); each phase owns its ``Algorithm`` record, its state, its batch source and its
position, and offers one ``step`` (``phases.base``). The loop here knows no phase's insides:

    for each phase, from the checkpoint's on:
        begin                                   (weight sync, data order)
        step -> metrics                         until the phase is done
            evaluate     every phase.eval_every steps and after its last   (hook)
            log          metrics.jsonl / TensorBoard, process 0             (hook)
            progress     tqdm                                               (hook)
            next phase   entered from this one's parameters after its last step
            checkpoint   every checkpoint.every steps, at a phase's end, on an agreed stop (hook)

Everything random is derived from ``run.seed`` and the step numbers, and every checkpoint holds
the current phase's state, every phase's step count, the current phase's position (data order,
batches in flight) and the evaluations so far, so a run killed at any point and resumed with
``--resume`` ends with the same parameters as one never killed. SIGTERM (a scheduler's
preemption) stops the loop at a step boundary that every process agrees on
(``interrupt.GracefulStop.should_stop``), saves that step and ends the run cleanly.

The builders (tokenizer, model, data, samplers, graders) are ``builders``; evaluation is
``evaluation``; restoring a policy for eval, pairs and export is ``assembly``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import yaml

from jaxrlvr import (
    assembly,
    compile_cache,
    distributed,
    evaluation,
    interrupt,
    phases,
    prompts,
)
from jaxrlvr import checkpoint as checkpoint_lib
from jaxrlvr import config as config_lib
from jaxrlvr import metrics as metrics_lib
from jaxrlvr.phases import ahead as ahead_lib
from jaxrlvr.phases import base

log = prompts.log


def _nan_to_none(x):
    """``x`` (nested dicts/lists) with NaN floats as None: JSON-safe checkpoint side-cars."""
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_nan_to_none(v) for v in x]
    return None if isinstance(x, float) and x != x else x


@dataclasses.dataclass
class LoopState:
    """Host-side loop state saved with every checkpoint (JSON).

    Attributes:
      phase: the current phase's name (``Phase.name``).
      steps: steps done, by phase name.
      position: the current phase's ``state_dict`` (its data order, batches in flight).
      eval_history: every evaluation so far, ``{"phase", "step", **metrics}``.
      phase_evals: the evaluation after each finished phase, by name ("start": before any step).
    """

    phase: str
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    position: dict = dataclasses.field(default_factory=dict)
    eval_history: list = dataclasses.field(default_factory=list)
    phase_evals: dict = dataclasses.field(default_factory=dict)


class Trainer:
    """The run's context, phases and hooks; ``run()`` is the loop.

    ``run``: the run ``assembly.open_run`` opened (``train.run``), which closes its context;
    None: the run is assembled here (``assembly.assemble``: no compile cache, backend start or
    preflight, as tests build it) and ``close`` closes it.
    """

    def __init__(
        self,
        cfg: config_lib.TrainConfig,
        *,
        resume: bool = False,
        run: assembly.OpenRun | None = None,
    ):
        self.cfg = cfg
        self.run_dir = cfg.run.out_dir
        os.makedirs(self.run_dir, exist_ok=True)
        self._owns_ctx = run is None
        if run is None:
            self.ctx, params = assembly.assemble(cfg, mode="train")
        else:
            self.ctx, params = run.ctx, run.take_params()
        self.phases = [cls(self.ctx, cfg) for cls in phases.plan(cfg)]
        self.loop = LoopState(phase=self.phases[0].name)
        self.ckpt = checkpoint_lib.Checkpointer(
            os.path.join(self.run_dir, "checkpoints"), keep=cfg.checkpoint.keep
        )
        self.phases[0].enter(params, jax.random.PRNGKey(cfg.run.seed))
        del params
        if resume:
            try:
                self._restore()
            except BaseException:
                if self._owns_ctx:  # the sampler and the grading pool; nothing else has started
                    self.ctx.close()
                raise
        elif jax.process_index() == 0:
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(config_lib.config_to_dict(cfg), f, sort_keys=False)
        self.metrics = None
        # Multi-host: every process runs the same loop; only process 0 writes the run's files.
        if jax.process_index() == 0:
            self.metrics = metrics_lib.MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard)
            if resume:
                # Lines after the restored checkpoint were logged by the killed run; drop them.
                self.metrics.truncate_after(self.global_step + 1)
        self.progress = None
        self._ahead: ahead_lib.CompileAhead | None = None  # ``run.compile_ahead`` (``run``)
        # The loop's hooks, in the order they run after a step, after the evaluation, whose
        # period is the phase's (``hooks_for``); a phase adds its own (``Phase.hooks``).
        self.hooks = [
            base.Hook("log", self._log_hook),
            base.Hook("progress", self._progress_hook),
            base.Hook(
                "checkpoint",
                self._checkpoint_hook,
                every=cfg.checkpoint.every,
                at_phase_end=True,
                on_stop=True,
            ),
        ]

    # -- what the loop is at -------------------------------------------------------------------
    @property
    def phase(self) -> base.Phase:
        """The current phase."""
        return next(p for p in self.phases if p.name == self.loop.phase)

    @property
    def state(self):
        """The current phase's train state."""
        return self.phase.state

    @property
    def global_step(self) -> int:
        return sum(p.position for p in self.phases)

    # -- hooks ---------------------------------------------------------------------------------
    def hooks_for(self, phase: base.Phase) -> list[base.Hook]:
        """The hooks after a step of ``phase``: the evaluation every ``phase.eval_every`` steps
        and after its last, the loop's (log, progress, checkpoint), then the phase's own."""
        evaluate = base.Hook(
            "evaluate", self._evaluate_hook, every=phase.eval_every, at_phase_end=True
        )
        return [evaluate, *self.hooks, *phase.hooks()]

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the live sampler's policy."""
        c = self.cfg
        return evaluation.evaluate(
            self.ctx, c.eval, c.sampler, seed=c.run.seed, reward_names=evaluation.reward_names(c)
        )

    def _evaluate_hook(self, info: base.StepInfo) -> None:
        """Evaluates, adds the metrics to the step's line, and records them (the evaluation after
        a phase's last step follows ``Phase.finish``, which hands the sampler its weights)."""
        phase = info.phase
        ev = self.evaluate()
        info.metrics.update(ev)
        self.loop.eval_history.append({"phase": phase.name, "step": phase.position, **ev})
        if phase.done:
            self.loop.phase_evals[phase.name] = ev
            log(
                f"after {phase.name}: held-out accuracy {ev.get('eval/accuracy', float('nan')):.3f}"
            )

    def _log_hook(self, info: base.StepInfo) -> None:
        if self.metrics is not None:
            self.metrics.log(info.step, info.metrics)

    def _progress_hook(self, info: base.StepInfo) -> None:
        self.progress.update(1)
        self.progress.set_postfix(
            **info.phase.postfix(info.metrics), eval_acc=self._last_accuracy()
        )

    def _checkpoint_hook(self, info: base.StepInfo) -> None:
        self._save()

    def _save(self) -> None:
        phase = self.phase
        self.loop.steps = {p.name: p.position for p in self.phases}
        self.loop.position = phase.state_dict()
        extra = {
            # NaN metrics (e.g. the correct responses' mean length when none is correct) as null.
            "loop": _nan_to_none(dataclasses.asdict(self.loop)),
            # The phase and its method (``algos.registry``): what ``export`` / ``eval`` rebuild.
            "phase": phase.name,
            "method": phase.method(phase.cfg),
            "config": config_lib.config_to_dict(self.cfg),
            "model_config": self.ctx.model_cfg.to_hf_config(),
        }
        self.ckpt.save(self.global_step, {"state": phase.state}, extra)

    def _restore(self) -> None:
        """Restores the newest checkpoint that restores cleanly (older ones on failure)."""
        by_name = {p.name: p for p in self.phases}

        def target(step, extra):
            name = extra["loop"]["phase"]
            if name not in by_name:
                raise checkpoint_lib.CheckpointError(
                    f"its phase {name!r} is not one of this config's phases {list(by_name)}"
                )
            return {"state": by_name[name].abstract_state()}

        restored = self.ckpt.restore_latest(target, log=log)
        if restored is None:
            log(f"--resume: no checkpoint in {self.ckpt.directory} yet; starting fresh")
            return
        step, tree, extra = restored
        if jax.process_index() == 0:
            for path in self.ckpt.set_aside_newer_than(step):
                log(f"moved the unreadable checkpoint to {path} (kept for inspection)")
        loop = LoopState(**extra["loop"])
        first, phase = self.phase, by_name[loop.phase]
        if phase is not first:
            phase.enter(first.state.params, first.state.rng)
            first.state = None
        phase.state = tree["state"]
        for p in self.phases:
            p.position = loop.steps.get(p.name, 0)
        phase.load_state_dict(loop.position)
        self.loop = loop
        log(f"resumed from checkpoint step {step} (phase {loop.phase})")

    def _advance(self, phase: base.Phase) -> None:
        """Enters the phase after ``phase`` from its parameters (a fresh optimiser state)."""
        nxt = self.phases[self.phases.index(phase) + 1]
        nxt.enter(phase.state.params, phase.state.rng)
        phase.state = None
        self.loop.phase = nxt.name

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        self.progress = tqdm(
            total=sum(p.total_steps for p in self.phases),
            initial=self.global_step,
            disable=not self.cfg.run.progress,
            desc="train",
            dynamic_ncols=True,
        )
        t_start = time.perf_counter()
        stopping = False
        if ahead := self.cfg.run.compile_ahead:
            self._ahead = ahead_lib.CompileAhead(self.ctx, self.cfg, self.phases)
        with interrupt.GracefulStop() as stop:
            first = self.phases[0]
            if self.global_step == 0 and self.cfg.eval.at_start and first.eval_every is not None:
                self.loop.phase_evals["start"] = ev = self.evaluate()
                self._log_hook(base.StepInfo(first, 0, ev))
            while not stopping:
                phase = self.phase
                if not phase.done:
                    phase.begin()
                while not phase.done and not stopping:
                    if ahead:
                        self._ahead.before_first_step(phase)
                    m = phase.step()
                    if ahead:
                        ahead = False
                        self._ahead.after_first_step(phase)
                    if phase.done:
                        phase.finish()  # the sampler gets the phase's final weights
                        if phase is not self.phases[-1]:
                            self._advance(phase)
                    stopping = stop.should_stop(self.global_step)
                    info = base.StepInfo(phase, self.global_step, m, stopping)
                    for hook in self.hooks_for(phase):
                        if hook.due(info):
                            hook.fn(info)
                if phase is self.phases[-1]:
                    break
        self.progress.close()
        if stopping:
            log(
                f"{stop.requested}: saved checkpoint step {self.global_step} and stopped; "
                "continue with --resume"
            )
            return {"interrupted": stop.requested, "step": self.global_step}
        return self._summary(time.perf_counter() - t_start)

    def _last_accuracy(self) -> str:
        evals = self.loop.eval_history or list(self.loop.phase_evals.values())
        acc = evals[-1].get("eval/accuracy") if evals else None
        return "n/a" if acc is None else f"{acc:.2f}"

    def _summary(self, wall_s: float) -> dict[str, Any]:
        loop = self.loop
        final = loop.eval_history[-1] if loop.eval_history else self.evaluate()
        # Every phase a run may have gives its fields' values for a run without it
        # (``Phase.summary_defaults``); the run's phases fill theirs (``Phase.summary``).
        fields: dict[str, Any] = {}
        for cls in dict.fromkeys(cls for _, cls in phases.PLAN):
            fields.update(cls.summary_defaults(loop.phase_evals))
        for p in self.phases:
            fields.update(p.summary(loop.phase_evals))
        summary = {
            "run_dir": os.path.abspath(self.run_dir),
            "algo": fields.pop("algo"),
            "steps": {p.name: p.position for p in self.phases},
            **fields,
            "eval_accuracy_final": final.get("eval/accuracy"),
            "eval_format_rate_final": final.get("eval/format_rate"),
            "eval_history": loop.eval_history,
            "wall_s": wall_s,
            "checkpoints": os.path.abspath(self.ckpt.directory),
            # XLA compiles and persistent-cache loads of this process so far (compile_cache).
            "compile": compile_cache.process_counter().as_dict(),
        }
        started = self._ahead is not None and self._ahead.thread is not None
        if started and (ahead := self.ctx.compiled_ahead(self.phases)):
            summary["compile"]["ahead"] = ahead  # what ``run.compile_ahead`` compiled, and ran
        if self.metrics is not None:
            self.metrics.write_summary(summary)
        return summary

    def close(self) -> None:
        if self._ahead is not None:  # a compile in flight ends before the sampler closes
            self._ahead.close()
        closers = [p.close for p in self.phases] + ([self.ctx.close] if self._owns_ctx else [])
        if self.metrics is not None:
            closers.append(self.metrics.close)
        for close in closers:
            with contextlib.suppress(Exception):
                close()


def run(
    cfg: config_lib.TrainConfig, *, resume: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Runs a training job end to end and prints where its outputs are.

    Everything the run will read is checked first (``preflight``): an ``out_dir`` that already
    holds a run is refused unless ``resume`` (continue it) or ``overwrite`` (move it aside).
    """
    with assembly.open_run(cfg, mode="train", resume=resume, overwrite=overwrite) as opened:
        cfg = opened.cfg
        trainer = Trainer(cfg, resume=resume, run=opened)
        try:
            summary = trainer.run()
        finally:
            trainer.close()
    distributed.finish()  # a clean end: the other processes do not report this one as lost
    if "interrupted" in summary:
        return summary
    plots_dir = os.path.join(cfg.run.out_dir, "plots")
    with contextlib.suppress(Exception):
        from jaxrlvr import plots

        plots.plot_runs([cfg.run.out_dir], plots_dir)
    for phase in trainer.phases:  # each phase's own lines (``Phase.report``)
        for line in phase.report(summary):
            print(line)
    print(f"metrics: {os.path.join(cfg.run.out_dir, 'metrics.jsonl')}")
    print(f"plots: {plots_dir}")
    print(f"checkpoints: {summary['checkpoints']}")
    return summary
