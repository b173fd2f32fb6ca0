"""Loaders on the shipped sample files: field mapping, boxed extraction, bad rows, formats."""

import json

import pytest

from jaxrlvr import data
from jaxrlvr.data import loading
from jaxrlvr.rewards import math_equiv, verifiers


@pytest.fixture(scope="module")
def math_jsonl():
    return data.load_problems(
        data.DataConfig.math(data.sample_path("math_sample.jsonl"), id_field="unique_id")
    )


def test_math_jsonl_counts_and_drops_bad_rows(math_jsonl):
    problems, stats = math_jsonl
    assert (stats.kept, stats.dropped) == (30, 4)
    assert stats.reasons == {"missing_question": 2, "missing_answer": 2}
    assert len(problems) == 30
    # The bad rows (ids 30-33) are not among the problems.
    assert {p.id for p in problems} == {f"math-sample-{i:02d}" for i in range(30)}


def test_math_field_mapping_and_boxed_extraction(math_jsonl):
    by_id = {p.id: p for p in math_jsonl[0]}
    # The answer field wins when present: the solution boxes "\$30", the answer field says "30".
    assert by_id["math-sample-09"].answer == "30"
    # Without an answer field the last \boxed{} of the solution is the answer.
    assert by_id["math-sample-03"].answer == "720^\\circ"
    assert by_id["math-sample-16"].answer == "9{,}000"
    assert by_id["math-sample-23"].answer == "\\{-3, 3\\}"
    assert by_id["math-sample-01"].answer == "6"
    assert by_id["math-sample-00"].question == "What is the value of $\\frac{3}{4} + \\frac{1}{8}$?"


def test_solution_only_mapping():
    problems, _ = data.load_problems(
        data.DataConfig.math(data.sample_path("math_sample.jsonl"), answer_field=None)
    )
    assert problems[9].answer == "\\$30"
    assert problems[9].id == "math_sample-9"  # default id: file stem and row index


def test_parquet_matches_jsonl(math_jsonl):
    problems, stats = data.load_problems(
        data.DataConfig.math(data.sample_path("math_sample.parquet"), id_field="unique_id")
    )
    assert problems == math_jsonl[0]
    assert stats == math_jsonl[1]


def test_gsm8k_layout():
    problems, stats = data.load_problems(
        data.DataConfig.gsm8k(data.sample_path("gsm8k_sample.jsonl"))
    )
    assert (stats.kept, stats.dropped) == (22, 3)
    assert stats.reasons == {"missing_question": 1, "missing_answer": 2}
    answers = [p.answer for p in problems]
    assert answers[:5] == ["29", "166", "16", "875", "14400"]  # "#### 14,400" -> "14400"
    assert "-7" in answers and "3.25" in answers


def test_every_kept_answer_is_gradable(math_jsonl):
    # A response that boxes the solution's own answer must score 1 with the R1-Zero reward.
    rows = [json.loads(line) for line in open(data.sample_path("math_sample.jsonl"))]
    by_id = {r["unique_id"]: r for r in rows}
    for problem in math_jsonl[0]:
        boxed = math_equiv.last_boxed_content(by_id[problem.id]["solution"])
        response = f"work </think> <answer>\\boxed{{{boxed}}}</answer>"
        assert verifiers.r1_zero_reward_fn(response, problem.answer)["reward"] == 1.0, problem.id


def test_raise_on_bad_row_names_the_index():
    cfg = data.DataConfig.math(data.sample_path("math_sample.jsonl"), on_bad_row="raise")
    with pytest.raises(ValueError, match="row 30: missing_question"):
        data.load_problems(cfg)


def test_custom_fields_numbers_and_limit(tmp_path):
    path = tmp_path / "custom.jsonl"
    rows = [
        {"q": "1+1?", "final": 2, "work": None},
        {"q": "2+2?", "final": None, "work": "so \\boxed{4}"},
        {"q": "3+3?", "final": None, "work": "no box"},
        {"q": "  ", "final": 5, "work": None},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = data.DataConfig(
        path=str(path), question_field="q", answer_field="final", solution_field="work"
    )
    problems, stats = data.load_problems(cfg)
    assert [(p.question, p.answer) for p in problems] == [("1+1?", "2"), ("2+2?", "4")]
    assert stats.reasons == {"missing_answer": 1, "missing_question": 1}
    limited, _ = data.load_problems(
        data.DataConfig(path=str(path), question_field="q", answer_field="final", limit=1)
    )
    assert len(limited) == 1


def test_missing_question_column_is_an_error():
    cfg = data.DataConfig(path=data.sample_path("gsm8k_sample.jsonl"), question_field="problem")
    with pytest.raises(ValueError, match="question_field 'problem' is not a column"):
        data.load_problems(cfg)


def test_config_validation_and_format_inference(tmp_path):
    with pytest.raises(ValueError, match="DataConfig.format must be one of.*jsonl"):
        data.DataConfig(path="x", format="csv")
    with pytest.raises(ValueError, match="DataConfig.on_bad_row must be one of.*skip"):
        data.DataConfig(path="x", on_bad_row="ignore")
    with pytest.raises(ValueError, match="answer_field or solution_field"):
        data.DataConfig(path="x", answer_field=None, solution_field=None)
    assert data.DataConfig(path=data.sample_path("math_sample.parquet")).resolved_format == (
        "parquet"
    )
    assert data.DataConfig(path=data.sample_path("math_sample.jsonl")).resolved_format == "jsonl"
    assert data.DataConfig(path="someuser/some-dataset").resolved_format == "hub"
    odd = tmp_path / "rows.txt"
    odd.write_text("")
    with pytest.raises(ValueError, match="cannot infer the format"):
        _ = data.DataConfig(path=str(odd)).resolved_format


@pytest.mark.parametrize(
    ("value", "from_solution", "expected"),
    [
        ("step\n#### 1,234", False, "1234"),
        ("\\boxed{\\frac{1}{2}}", False, "\\frac{1}{2}"),
        ("plain", False, "plain"),
        (0.5, False, "0.5"),
        ("", False, None),
        (True, False, None),
        ("text with 5 but no box", True, None),
        ("a \\boxed{1} b \\boxed{2}", True, "2"),
        ("\\boxed{ }", True, None),
    ],
)
def test_extract_answer(value, from_solution, expected):
    assert loading.extract_answer(value, from_solution=from_solution) == expected


def test_a_mixtures_held_out_share_is_each_domains_own_and_scored_per_domain():
    """A task mixture is evaluated as each task alone: the first max_problems of each domain
    (not the first max_problems of the pooled list, which would be the first task's only), and
    the accuracy is reported per domain beside the pooled one."""
    from jaxrlvr import evaluation

    def p(i, d):
        return loading.Problem(question=f"q{i}", answer="1", id=str(i), domain=d)

    pooled = [p(i, "arith") for i in range(5)] + [p(i, "code") for i in range(5, 8)]
    share = loading.held_out_share(pooled, 2)
    assert [(q.id, q.domain) for q in share] == [
        ("0", "arith"),
        ("1", "arith"),
        ("5", "code"),
        ("6", "code"),
    ]
    single = [p(i, None) for i in range(5)]
    assert loading.held_out_share(single, 3) == single[:3]
    # 2 samples per problem: arith problems score 1, 0; code problems 0, 0 (sample by sample)
    rewards = [1, 1, 0, 0, 0, 1, 0, 0]
    scores = [{"answer_reward": r} for r in rewards]
    by_domain = evaluation.accuracy_by_domain([q.domain for q in share], scores, 2)
    assert by_domain == {
        "eval/arith/accuracy": 0.5,
        "eval/arith/n": 2,
        "eval/code/accuracy": 0.25,
        "eval/code/n": 2,
    }
    assert evaluation.accuracy_by_domain([None] * 3, scores[:6], 2) == {}


@pytest.mark.parametrize("task", ["synthetic", "scratchpad"])
def test_data_eval_replaces_a_generated_tasks_held_out_split(tmp_path, task):
    """A generated task draws its splits from run.seed; data.eval (e.g. curate's held-out file)
    replaces the held-out split instead of being ignored, and the training split is unchanged."""
    from jaxrlvr import builders
    from jaxrlvr import config as config_lib

    rows = [{"problem": f"{a} + 1 =", "answer": str(a + 1)} for a in range(3)]
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [f"data.train={task}", "data.synthetic_train_size=20", "data.synthetic_eval_size=5"]
    cfg = config_lib.load_config("configs/demo.yaml", base)
    train, held_out = builders.load_splits(cfg)
    assert len(held_out) == 5
    cfg = config_lib.load_config("configs/demo.yaml", [*base, f"data.eval={path}"])
    train2, held_out2 = builders.load_splits(cfg)
    assert [(p.question, p.answer) for p in held_out2] == [
        (r["problem"], r["answer"]) for r in rows
    ]
    assert [(p.question, p.answer) for p in train2] == [(p.question, p.answer) for p in train]
