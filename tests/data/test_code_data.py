"""Code problems: the MBPP / HumanEval jsonl loaders on the shipped samples, and the synthetic
code task (seeded, disjoint splits, hidden tests, reference bodies that pass)."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from jaxrlvr import builders, configlib, data, sandbox
from jaxrlvr import config as config_lib
from jaxrlvr.data import code_loading, synthetic_code
from jaxrlvr.rewards import code

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None and os.environ.get("CI") != "1",
    reason="bubblewrap not installed (scripts/setup_env.sh installs it)",
)


def test_mbpp_sample_loads():
    problems, stats = code_loading.load_code_problems(data.sample_path("mbpp_sample.jsonl"), "mbpp")
    assert stats.kept == len(problems) == 5 and stats.dropped == 0
    p = problems[0]
    task = code.CodeTask.from_json(p.answer)
    assert p.id == "mbpp-1" and "sum_of_squares" in p.question
    assert task.tests[0] in p.question and len(task.tests) == 3
    assert code.CodeTask.from_json(problems[4].answer).setup == "import math"


def test_humaneval_sample_loads():
    path = data.sample_path("humaneval_sample.jsonl")
    problems, _ = code_loading.load_code_problems(path, "humaneval")
    assert len(problems) == 4
    task = code.CodeTask.from_json(problems[0].answer)
    assert task.prefix == problems[0].question and task.tests == ("check(running_max)",)
    assert "def check" in task.setup and problems[0].id == "JaxRLVR-0"


def test_bad_rows_are_dropped_or_raise(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [{"text": "t", "code": "", "test_list": []}, {"text": "ok", "test_list": ["f()"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    problems, stats = code_loading.load_code_problems(str(path), "mbpp")
    assert len(problems) == 1 and stats.dropped == 1
    with pytest.raises(ValueError, match="row 0"):
        code_loading.load_code_problems(str(path), "mbpp", on_bad_row="raise")
    with pytest.raises(ValueError, match="data.code_layout"):
        code_loading.load_code_problems(str(path), "apps")


@needs_bwrap
def test_reference_solutions_of_the_samples_pass():
    cfg = sandbox.SandboxConfig()
    for name, layout in (("mbpp_sample.jsonl", "mbpp"), ("humaneval_sample.jsonl", "humaneval")):
        problems, _ = code_loading.load_code_problems(data.sample_path(name), layout)
        pairs = [(p.solution, code.CodeTask.from_json(p.answer)) for p in problems]
        assert code.reference_pass_rate(pairs, cfg) == 1.0, name


def test_synthetic_code_splits_are_seeded_and_disjoint():
    cfg = synthetic_code.SyntheticCodeConfig()
    train, held = synthetic_code.make_splits(3, 300, 50, cfg)
    again, _ = synthetic_code.make_splits(3, 300, 50, cfg)
    assert [p.question for p in train] == [p.question for p in again]
    assert not {p.question for p in train} & {p.question for p in held}
    assert len(train) == 300 and len(held) == 50
    p = train[0]
    task = code.CodeTask.from_json(p.answer)
    assert p.question.endswith("def f(x): return") and task.prefix == "def f(x): return "
    shown = p.question.split("\n")[0].split()
    assert len(shown) == cfg.num_examples
    assert len(task.tests) == cfg.num_examples + cfg.num_hidden
    for x_eq_y, test in zip(shown, task.tests):  # the shown examples are the first tests
        x, y = x_eq_y[2:].split(")=")
        assert test == f"assert f({x}) == {y}"
        assert synthetic_code.evaluate(p.solution, int(x)) == int(y)


def test_synthetic_code_config_validation():
    with pytest.raises(ValueError, match="data.synthetic_code.families"):
        synthetic_code.SyntheticCodeConfig(families=("exp",))
    with pytest.raises(ValueError, match="data.synthetic_code.max_input"):
        synthetic_code.SyntheticCodeConfig(max_input=2, num_examples=4)
    for family in ("add", "sub", "mul", "mod", "max", "min", "square", "div", "affine"):
        one = synthetic_code.SyntheticCodeConfig(families=(family,))
        body = synthetic_code.draw_function(random.Random(0), one)
        assert "x" in body


@needs_bwrap
def test_synthetic_reference_bodies_pass_and_a_constant_fails():
    train, _ = synthetic_code.make_splits(0, 40, 0)
    fn = code.make_code_reward_fn(code.CodeRewardConfig(mode="all_pass"))
    assert all(fn(f" <answer>{p.solution}</answer>", p.answer)["reward"] == 1.0 for p in train)
    assert sum(fn(" <answer>x</answer>", p.answer)["reward"] for p in train) < 20


def test_builders_load_splits_for_code_data(tmp_path):
    cfg = configlib.build(
        config_lib.TrainConfig,
        {
            "data": {
                "train": "synthetic_code",
                "synthetic_train_size": 20,
                "synthetic_eval_size": 5,
            }
        },
    )
    train, held = builders.load_splits(cfg)
    assert len(train) == 20 and len(held) == 5 and train[0].id.startswith("code-")
    path = data.sample_path("mbpp_sample.jsonl")
    cfg = configlib.build(
        config_lib.TrainConfig,
        {"data": {"train": path, "eval": path, "code_layout": "mbpp"}},
    )
    train, held = builders.load_splits(cfg)
    assert len(train) == len(held) == 5
    with pytest.raises(ValueError, match="data.code_layout"):
        configlib.build(config_lib.TrainConfig, {"data": {"code_layout": "apps"}})
