"""Benchmark loaders (jaxrlvr.data.benchmarks): the shipped samples, and one-line refusals."""

import json

import pytest

from jaxrlvr.data import benchmarks, sample_path
from jaxrlvr.rewards import code, verifiers


def _load(name, **kw):
    return benchmarks.load_benchmark(name, sample_path(benchmarks.SAMPLES[name]), **kw)


def test_math500_and_gsm8k_samples_give_prompts_and_gold_answers():
    problems, stats = _load("math500", on_bad_row="skip")
    assert stats.dropped == 4 and len(problems) == 30  # rows 30-33: the broken ones
    first = problems[0]
    assert (
        first.id == "math-sample-00" and first.answer == "\\frac{7}{8}" and first.domain == "math"
    )
    assert first.question.endswith(benchmarks.MATH_INSTRUCTION)
    assert problems[1].answer == "6"  # from the solution's \boxed{} (answer is null)
    assert verifiers.question_only_reward_fn("so \\boxed{7/8}", first.answer)["reward"] == 1.0
    gsm, stats = _load("gsm8k", on_bad_row="skip", instruction=False)
    assert gsm[0].answer == "29" and gsm[0].question.endswith("left?") and stats.dropped == 3
    assert verifiers.gsm8k_reward_fn("... so 29 pencils", gsm[0].answer)["reward"] == 1.0
    with pytest.raises(benchmarks.BenchmarkError, match=r"row 30: not a math500 problem"):
        _load("math500")  # a benchmark is graded whole unless told to skip


@pytest.mark.parametrize("name", ["humaneval", "mbpp"])
def test_code_samples_reference_solutions_pass(name):
    problems, stats = _load(name)
    assert stats.dropped == 0 and problems and all(p.domain == "code" for p in problems)
    pairs = [(p.solution, code.CodeTask.from_json(p.answer)) for p in problems]
    assert code.reference_pass_rate(pairs) == 1.0


def test_missing_file_and_wrong_layout_are_one_line_errors(tmp_path):
    with pytest.raises(benchmarks.BenchmarkError) as e:
        benchmarks.load_benchmark("gsm8k", str(tmp_path / "nope.jsonl"))
    assert str(e.value) == (
        f"benchmark gsm8k: {tmp_path / 'nope.jsonl'}: no such file (expected a jsonl or parquet "
        "file with fields question, answer)"
    )
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"prompt": "x", "test": "y"}) + "\n")
    with pytest.raises(benchmarks.BenchmarkError) as e:
        benchmarks.load_benchmark("humaneval", str(wrong))
    assert "\n" not in str(e.value)
    assert "no field task_id, canonical_solution, entry_point (columns: prompt, test)" in str(
        e.value
    )
    with pytest.raises(benchmarks.BenchmarkError, match="unknown benchmark 'aime'"):
        benchmarks.load_benchmark("aime", str(wrong))
