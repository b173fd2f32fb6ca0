"""``run.compile_ahead`` in the run's loop: which programs the run compiles on a background
thread while its first phase trains, and when they are lowered and compiled.

What: the sampler calls of the run's next steps and evaluations, in the order it needs them (the
current phase's, the evaluation's, the later phases'), then the next phase's first-step programs
(``Phase.programs_ahead``). On the demo the RL phase's rollouts, the evaluations and the GRPO
update compile while SFT trains (``RunContext.compile_ahead`` lowers and starts them).

When: they compile after the run's first step, whose own programs compile alone (on two cores
two compiles at once slowed each other as much as they gained). Tracing and lowering them holds
the GIL, XLA's compile does not: a first step that samples nothing (SFT) runs beside their
lowering (``compile_cache.beside``), so the lowering fills the core that the step's compile
leaves idle. A first step that samples could wait for a program compiling ahead
(``JaxSampler.precompile_in_background``): there they are lowered after the step.
"""

from __future__ import annotations

import contextlib
import threading

from jaxrlvr import compile_cache
from jaxrlvr.data import loading
from jaxrlvr.phases import base


class CompileAhead:
    """``before_first_step(phase)`` and ``after_first_step(phase)`` around the run's first step;
    ``thread``: the thread compiling (None until started, or where nothing compiles ahead);
    ``close()`` waits for a compile in flight (before the sampler closes)."""

    def __init__(self, ctx: base.RunContext, cfg, phases: list[base.Phase]):
        self.ctx, self.cfg, self.phases = ctx, cfg, phases
        self.thread: threading.Thread | None = None
        self._first_step_done = threading.Event()  # the compiles wait for it
        self._lowering = None

    def calls(self, current: base.Phase) -> tuple[list, base.Phase | None]:
        """(sampler calls, the phase whose first-step programs follow them) from the phase
        ``current`` on: ``RunContext.compile_ahead``'s arguments."""
        c = self.cfg
        pending = [p for p in self.phases[self.phases.index(current) :] if not p.done]
        per_phase = [p.sampler_calls() for p in pending]
        if any(p.eval_every is not None for p in pending):
            problems = loading.held_out_share(self.ctx.eval_problems, c.eval.max_problems)
            # ``eval.at_start``'s evaluation ran before the first step: the next one is later.
            per_phase.insert(1, [(problems, c.eval.samples_per_problem, c.sampler, True)])
        return [call for calls in per_phase for call in calls], pending[1] if pending[1:] else None

    def before_first_step(self, phase: base.Phase) -> None:
        if not phase.samples_train_prompts:
            self._lowering = compile_cache.beside(
                self.ctx.compile_ahead, *self.calls(phase), after=self._first_step_done
            )

    def after_first_step(self, phase: base.Phase) -> None:
        """``phase``: the one whose step ran (the loop has not moved on yet)."""
        self._first_step_done.set()
        if self._lowering is not None:
            self.thread = self._lowering.result()
        else:
            self.thread = self.ctx.compile_ahead(*self.calls(phase))

    def close(self) -> None:
        self._first_step_done.set()  # a first step that failed has ended too
        if self._lowering is not None and self.thread is None:
            with contextlib.suppress(Exception):  # its error, if any, is not the run's
                self.thread = self._lowering.result()
        if self.thread is not None:
            self.thread.join()
