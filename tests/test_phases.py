"""The driver as a loop over phases: which phases a config gets (``phases.plan``), and the loop's
hooks (evaluation, checkpoints, metrics, the agreed stop, resume) driven with two phases written
here, which the loop runs knowing nothing of them: the shape a new phase plugs into."""

import json
import pathlib
import threading

import jax
import pytest
import runs

from jaxrlvr import config as config_lib
from jaxrlvr import interrupt, phases, train
from jaxrlvr.algos import registry
from jaxrlvr.phases import base, preference, rl, sft, tool

# The tiny run of tests/runs.py, on the 8 fake devices of tests/conftest.py.
TINY = [*runs.TINY, "mesh.data=8"]


def _cfg(*overrides):
    return config_lib.load_config("configs/demo.yaml", [*TINY, *overrides])


@pytest.mark.parametrize(
    "overrides, want",
    [
        (["sft.steps=3", "rl.algo=grpo"], [sft.SFTPhase, rl.RLPhase]),
        (["sft.steps=0", "rl.algo=ppo"], [rl.RLPhase]),
        (["sft.steps=2", "rl.algo=expert_iteration"], [sft.SFTPhase, rl.RLPhase]),
        (["sft.steps=0", "rl.algo=dpo", "pref.data=x.jsonl"], [preference.PreferencePhase]),
        (["sft.steps=3", "rl.algo=none"], [sft.SFTPhase]),
        (["sft.steps=0", "rl.algo=none"], [sft.SFTPhase]),  # an SFT-only run of 0 steps
        # Tool use: its own phases (warm start on written traces, RL on multi-turn rollouts).
        (
            ["sft.steps=3", "rl.algo=grpo", "env.tools=[python]"],
            [tool.ToolSFTPhase, tool.ToolPhase],
        ),
        (["sft.steps=0", "rl.algo=ppo", "env.tools=[python]"], [tool.ToolPhase]),
    ],
)
def test_plan_chooses_the_phases_from_the_config(overrides, want):
    assert phases.plan(_cfg(*overrides)) == want


CALLS = []


class _Counting(base.Phase):
    """A phase that trains nothing: it records what the loop asks of it. Its state is the SFT
    record's (a real TrainState, so checkpoints save and restore it)."""

    sections = ("sft",)
    steps = 0
    every = None

    @classmethod
    def method(cls, cfg):
        return registry.SFT

    @property
    def total_steps(self):
        return self.steps

    @property
    def eval_every(self):
        return self.every

    def enter(self, params, rng):
        CALLS.append((self.name, "enter"))
        super().enter(params, rng)

    def begin(self):
        CALLS.append((self.name, "begin", self.position))

    def step(self):
        self.position += 1
        CALLS.append((self.name, "step", self.position))
        return {f"{self.name}/position": float(self.position)}

    def finish(self):
        CALLS.append((self.name, "finish"))

    def state_dict(self):
        return {"at": self.position}

    def load_state_dict(self, state):
        CALLS.append((self.name, "load", state["at"]))


class _First(_Counting):
    name, steps = "first", 3


class _Second(_Counting):
    name, steps, every = "second", 4, 2


@pytest.fixture
def two_phases(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(phases, "plan", lambda cfg: [_First, _Second])
    evals = []

    def evaluate(self):
        evals.append(self.global_step)
        return {"eval/accuracy": 0.1 * len(evals)}

    monkeypatch.setattr(train.Trainer, "evaluate", evaluate)
    return evals


def test_the_loop_runs_phases_it_knows_nothing_of(tmp_path, two_phases):
    evals = two_phases
    cfg = _cfg(
        f"run.out_dir={tmp_path}", "checkpoint.every=2", "checkpoint.keep=10", "eval.at_start=false"
    )
    trainer = train.Trainer(cfg)
    try:
        summary = trainer.run()
        saved = trainer.ckpt.all_steps()
    finally:
        trainer.close()
    assert CALLS == [
        ("first", "enter"),
        ("first", "begin", 0),
        *[("first", "step", i) for i in (1, 2, 3)],
        ("first", "finish"),
        ("second", "enter"),  # after the first's last step, from its parameters
        ("second", "begin", 0),
        *[("second", "step", i) for i in (1, 2)],
        *[("second", "step", i) for i in (3, 4)],
        ("second", "finish"),
    ]
    # Evaluations: after the first phase (no eval_every) and every 2 steps of the second.
    assert evals == [3, 5, 7]
    assert [(e["phase"], e["step"]) for e in summary["eval_history"]] == [
        ("first", 3),
        ("second", 2),
        ("second", 4),
    ]
    assert summary["steps"] == {"first": 3, "second": 4}
    assert summary["eval_accuracy_final"] == pytest.approx(0.3)
    # Checkpoints every 2 steps of a phase and at each phase's end.
    assert saved == [2, 3, 5, 7]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 8))
    assert lines[2]["first/position"] == 3 and lines[2]["eval/accuracy"] == pytest.approx(0.1)


@pytest.mark.parametrize("first_samples", [False, True])
def test_compile_ahead_lowers_beside_a_first_step_that_samples_nothing(
    tmp_path, two_phases, monkeypatch, first_samples
):
    """``run.compile_ahead`` (``phases.ahead``): the programs compiled ahead are lowered on
    another thread while the run's first step runs, when that step samples nothing, and their
    compile waits for the step's end; a first step that samples has them lowered after it, on
    the loop's thread (it could wait for a program compiling ahead)."""
    monkeypatch.setattr(_First, "samples_train_prompts", first_samples)
    stepping = threading.Event()
    step = _First.step

    def first_step(self):
        stepping.set()
        return step(self)

    seen = []

    def compile_ahead(ctx, calls, then=None, *, after=None):
        # Beside the step, the lowering sees it running (it waits for it, up to 10 s).
        seen.append((threading.current_thread() is threading.main_thread(), stepping.wait(10)))
        seen.append((then.name, after))
        return None

    monkeypatch.setattr(_First, "step", first_step)
    monkeypatch.setattr(base.RunContext, "compile_ahead", compile_ahead)
    trainer = train.Trainer(_cfg(f"run.out_dir={tmp_path}", "eval.at_start=false"))
    try:
        trainer.run()
    finally:
        trainer.close()
    (on_main, saw_step), (then, after) = seen  # called once, for the next phase
    assert then == "second" and saw_step
    if first_samples:
        assert on_main and after is None
    else:
        assert not on_main and isinstance(after, threading.Event) and after.is_set()


def test_checkpoint_every_0_saves_at_each_phase_end_only(tmp_path, two_phases):
    """``checkpoint.every: 0``: no periodic checkpoints, one at each phase's end (it was a
    ZeroDivisionError after the first step); a negative value is refused in one line."""
    cfg = _cfg(
        f"run.out_dir={tmp_path}", "checkpoint.every=0", "checkpoint.keep=10", "eval.at_start=false"
    )
    trainer = train.Trainer(cfg)
    try:
        trainer.run()
        saved = trainer.ckpt.all_steps()
    finally:
        trainer.close()
    assert saved == [3, 7]
    with pytest.raises(ValueError, match=r"checkpoint.every=-1: expected an int >= 0"):
        _cfg(f"run.out_dir={tmp_path}", "checkpoint.every=-1")


def test_an_agreed_stop_saves_that_step_and_resume_continues_the_phase(
    tmp_path, two_phases, monkeypatch
):
    cfg = _cfg(f"run.out_dir={tmp_path}", "checkpoint.every=100", "eval.at_start=false")
    asked = []

    def should_stop(self, step):
        asked.append(step)
        self.requested = "SIGTERM" if step == 5 else None
        return step == 5

    monkeypatch.setattr(interrupt.GracefulStop, "should_stop", should_stop)
    trainer = train.Trainer(cfg)
    try:
        out = trainer.run()
        params = jax.device_get(trainer.state.params)
    finally:
        trainer.close()
    assert out == {"interrupted": "SIGTERM", "step": 5}
    assert asked == [1, 2, 3, 4, 5]  # once per step boundary, with the global step
    assert trainer.ckpt.all_steps() == [3, 5]

    CALLS.clear()
    monkeypatch.setattr(interrupt.GracefulStop, "should_stop", lambda self, step: False)
    resumed = train.Trainer(cfg, resume=True)
    try:
        restored = jax.device_get(resumed.state.params)
        summary = resumed.run()
    finally:
        resumed.close()
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        assert (a == b).all()
    assert CALLS == [
        ("first", "enter"),
        ("second", "enter"),
        ("second", "load", 2),
        ("second", "begin", 2),
        ("second", "step", 3),
        ("second", "step", 4),
        ("second", "finish"),
    ]
    assert summary["steps"] == {"first": 3, "second": 4}
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 8))  # no step logged twice


def test_a_checkpoint_of_a_phase_the_config_lacks_is_named(tmp_path, two_phases, monkeypatch):
    cfg = _cfg(f"run.out_dir={tmp_path}", "checkpoint.every=1", "eval.at_start=false")
    trainer = train.Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    monkeypatch.setattr(phases, "plan", lambda cfg: [_First])
    with pytest.raises(Exception, match="'second' is not one of this config's phases"):
        train.Trainer(cfg, resume=True)


def test_train_py_stays_a_thin_loop():
    """The loop has no per-method branch: train.py never names an algorithm or a phase kind."""
    source = (pathlib.Path(train.__file__)).read_text()
    assert len(source.splitlines()) <= 400
    for word in ("rl.algo ==", "grpo", "ppo", "dpo", "expert_iteration", '== "sft"', "== 'rl'"):
        assert word not in source, word
