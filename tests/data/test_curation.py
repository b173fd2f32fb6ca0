"""``jaxrlvr curate`` on the shipped MATH- and GSM8K-layout samples: what it drops and why, the
curated files (input rows, loadable by the same ``data.*``), the report, one-line errors; and the
sampling steps with a real tiny policy."""

import json

import pytest
import yaml

from jaxrlvr import builders, cli, curate
from jaxrlvr import config as config_lib
from jaxrlvr.data import curation, filters, loading, sample_path


def _main(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture
def math_config(tmp_path):
    math_rows = [json.loads(line) for line in open(sample_path("math_sample.jsonl"))]
    gsm_rows = _rows(sample_path("gsm8k_sample.jsonl"))
    # The held-out split: two MATH training problems copied (one with its numbers reformatted),
    # and problems of its own.
    held_out = [
        {"problem": math_rows[4]["problem"], "answer": "36"},  # What is $15\%$ of $240$?
        {"problem": math_rows[11]["problem"].replace("10", "10.0"), "answer": "1024"},
        {"problem": "What is $9 \\times 9$?", "answer": "81"},
    ]
    # A benchmark in the GSM8K layout holding one MATH problem as a long paraphrase.
    bench = [
        {"question": gsm_rows[0]["question"], "answer": "#### 29"},
        {
            "question": "Here is one for you. " + math_rows[9]["problem"].replace("40", "40.00"),
            "answer": "#### 30",
        },
    ]
    train_cfg = {
        "data": {
            "train": sample_path("math_sample.jsonl"),
            "eval": _write_jsonl(tmp_path / "held_out.jsonl", held_out),
        },
        "reward": {"fn": "r1_zero"},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(train_cfg))
    curate_cfg = {
        "base": "run.yaml",
        "curate": {
            "guessable": {"enabled": True},
            "decontam": {
                "against": [
                    {
                        "path": _write_jsonl(tmp_path / "bench.jsonl", bench),
                        "question_field": "question",
                        "name": "bench",
                    }
                ]
            },
        },
    }
    (tmp_path / "curate.yaml").write_text(yaml.safe_dump(curate_cfg))
    return tmp_path, math_rows


def test_curates_the_math_sample(math_config, capsys):
    tmp_path, math_rows = math_config
    out = tmp_path / "out"
    code, stdout, err = _main(capsys, "curate", str(tmp_path / "curate.yaml"), "--out", str(out))
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    src = report["sources"]["math_sample"]
    # 30 usable problems (4 rows lack a question or an answer); 3 overlaps, none guessable.
    assert (src["loaded"], src["kept"]) == (30, 27)
    assert src["dropped"] == {"decontam": 3, "guessable": 0, "no_cot": 0, "difficulty": 0}
    assert report["decontam"]["by_source"]["math_sample"] == {
        "exact": 2,
        "ngram": 1,
        "exact:math_sample:held_out": 2,
        "ngram:bench": 1,
    }
    dropped = {r["id"]: r for r in _rows(out / "dropped.jsonl")}
    assert set(dropped) == {"math_sample-4", "math_sample-11", "math_sample-9"}
    assert dropped["math_sample-9"]["detail"].startswith("5 shared 13-grams with bench[1]")
    # The curated file holds the input rows unchanged, minus the dropped ones.
    kept = _rows(out / "math_sample.jsonl")
    # (rows 30-33 lack a question or an answer: test_loading)
    assert kept == [r for i, r in enumerate(math_rows[:30]) if i not in (4, 9, 11)]
    # The printed report: a line per step, the table, and the data.* override.
    assert "decontam    dropped 3 (default 3)" in stdout
    assert "guessable   dropped 0 (default 0)" in stdout and "no_cot      off" in stdout
    assert f"data.train={out / 'math_sample.jsonl'}" in stdout
    # data.train pointed at the output: the run loads the 27 problems, the same answers.
    cfg = config_lib.load_config(
        str(tmp_path / "run.yaml"), [f"data.train={out / 'math_sample.jsonl'}"]
    )
    train, held_out = builders.load_splits(cfg)
    assert len(train) == 27 and len(held_out) == 3
    original = {
        p.question: p.answer
        for p in builders.load_splits(config_lib.load_config(str(tmp_path / "run.yaml")))[0]
    }
    assert all(original[p.question] == p.answer for p in train)


def test_curates_the_gsm8k_sample(tmp_path, capsys):
    gsm_rows = _rows(sample_path("gsm8k_sample.jsonl"))
    # A guessable yes/no problem and a multiple-choice one added to the training file.
    extra = [
        {"question": "Is 1,001 divisible by 7? Answer yes or no.", "answer": "#### yes"},
        {"question": "How many legs?\n(A) 2\n(B) 4\n(C) 6", "answer": "#### B"},
    ]
    train = _write_jsonl(tmp_path / "gsm_train.jsonl", gsm_rows + extra)
    # The benchmark holds two training questions with their numbers reformatted.
    bench = [
        {"question": gsm_rows[3]["question"].replace(" ", "  ") + " "},
        {"question": gsm_rows[5]["question"]},
    ]
    bench[1]["question"] = gsm_rows[5]["question"].replace("3.5", "3.50").replace("80", "80.0")
    cfg = {
        "data": {
            "train": train,
            "question_field": "question",
            "answer_field": "answer",
            "solution_field": None,
            "domain": "gsm8k",
        },
        "reward": {"fn": "gsm8k"},
        "curate": {
            "guessable": {"enabled": True},
            "decontam": {
                "against": [
                    {
                        "path": _write_jsonl(tmp_path / "b.jsonl", bench),
                        "question_field": "question",
                    }
                ]
            },
        },
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    code, stdout, err = _main(capsys, "curate", str(tmp_path / "c.yaml"), "--out", str(out))
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    dom = report["domains"]["gsm8k"]
    usable = gsm_rows[:22]  # the sample's last 3 rows lack a question or an answer
    assert dom["loaded"] == len(usable) + 2
    assert dom["dropped"]["decontam"] == 2 and dom["dropped"]["guessable"] == 2
    assert dom["kept"] == len(usable) - 2
    reasons = {r["id"]: r["detail"] for r in _rows(out / "dropped.jsonl")}
    n = len(gsm_rows)
    assert reasons[f"gsm_train-{n}"] == "yes_no" and reasons[f"gsm_train-{n + 1}"] == (
        "multiple_choice"
    )
    assert reasons["gsm_train-3"] == "exact match with b[0]"
    assert reasons["gsm_train-5"] == "exact match with b[1]"
    kept = _rows(out / "gsm_train.jsonl")
    assert kept == [r for i, r in enumerate(usable) if i not in (3, 5)]
    assert "guessable   dropped 2 (gsm8k 2)" in stdout


def test_generated_task_writes_train_and_held_out(tmp_path, capsys):
    cfg = {
        "data": {
            "train": "synthetic",
            "synthetic": {"num_steps": 1, "max_operand": 19, "max_value": 40},
            "synthetic_train_size": 200,
            "synthetic_eval_size": 50,
        },
        "reward": {"fn": "synthetic"},
        "curate": {"guessable": {"enabled": True}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    code, stdout, err = _main(capsys, "curate", str(tmp_path / "c.yaml"), "--out", str(out))
    assert code == 0, err
    # The disjoint splits: nothing dropped; both written, loadable as MATH-layout files.
    assert len(_rows(out / "synthetic.jsonl")) == 200
    assert len(_rows(out / "synthetic_held_out.jsonl")) == 50
    assert f"data.eval={out / 'synthetic_held_out.jsonl'}" in stdout
    problems, _ = loading.load_problems(loading.DataConfig.math(str(out / "synthetic.jsonl")))
    train, _ = builders.load_splits(curate.load_dict(cfg)[0])
    assert [(p.question, p.answer) for p in problems] == [(p.question, p.answer) for p in train]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"data": {"train": "/no/such/file.jsonl"}},
            "jaxrlvr curate: error: data.train='/no/such/file.jsonl': no such file (curate "
            "reads local files)",
        ),
        (
            {"curate": {"decontam": {"against": [{"path": "/no/bench.jsonl"}]}}},
            "jaxrlvr curate: error: curate.decontam.against[0].path='/no/bench.jsonl': no such "
            "file",
        ),
        (
            {"curate": {"decontam": {"against": [{"path": sample_path("gsm8k_sample.jsonl")}]}}},
            "jaxrlvr curate: error: curate.decontam.against[0].question_field='problem' is not a "
            f"text column of {sample_path('gsm8k_sample.jsonl')!r} (columns: ['answer', "
            "'question'])",
        ),
        (
            {"data": {"question_field": "question"}},
            "jaxrlvr curate: error: DataConfig.question_field 'question' is not a column of",
        ),
        (
            {"curate": {"no_cot": {"threshold": 2.0}}},
            "jaxrlvr curate: config error: curate.no_cot: no_cot.threshold=2.0: expected a share "
            "in (0, 1]",
        ),
        (
            {"curate": {"dedup": True}},
            "jaxrlvr curate: config error: unknown config key 'curate.dedup'",
        ),
    ],
    ids=["train-missing", "bench-missing", "field-absent", "train-field", "bad-value", "bad-key"],
)
def test_bad_input_is_one_line(tmp_path, capsys, edit, message):
    cfg = {"data": {"train": sample_path("math_sample.jsonl")}, "curate": {}}
    for section, values in edit.items():
        cfg[section] = {**cfg[section], **values}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code, stdout, err = _main(capsys, "curate", str(tmp_path / "c.yaml"), "--out", str(tmp_path))
    assert code == 2 and stdout == ""
    assert err.startswith(message) and err.count("\n") == 1, err


def test_steps_report_and_order_without_sampling():
    cfg = curation.CurateConfig()
    assert curation.STEPS == ("decontam", "guessable", "no_cot", "difficulty")
    assert not cfg.samples
    with pytest.raises(ValueError, match="need the policy's pass rates"):
        curation.curate([], curation.CurateConfig(no_cot=filters.NoCoTConfig(enabled=True)), {})


@pytest.mark.slow  # ~25 s of CPU: the JaxSampler compiles for the two steps' lengths
def test_sampling_steps_with_a_real_policy(tmp_path, capsys):
    # A random tiny policy on the demo's task, sampled by the JaxSampler and graded by the
    # question-only verifier (an <answer> block or a \boxed{}; the synthetic verifier would take
    # any integer in the text). Random characters never write an answer block, so every
    # difficulty pass rate is 0 (all dropped); the no-CoT step's forced text is graded as the
    # start of the response, so forcing " <answer>7</answer>" "solves" exactly the problems
    # whose answer is 7, at rate 1.
    cfg = {
        "run": {"seed": 0},
        "model": {
            "tokenizer": "char",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 64,
        },
        "data": {
            "train": "synthetic",
            "template": "question_only",
            "synthetic": {"num_steps": 1, "max_operand": 9, "max_value": 18},
            "synthetic_train_size": 40,
            "synthetic_eval_size": 8,
        },
        "reward": {"fn": "question_only", "num_workers": 1},
        "sampler": {"max_tokens": 6, "stop": ["</answer>"]},
        "curate": {
            "batch_size": 64,
            "no_cot": {"enabled": True, "k": 2, "forced_text": " <answer>7</answer>"},
            "difficulty": {"enabled": True, "k": 2},
        },
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    code, stdout, err = _main(capsys, "curate", str(tmp_path / "c.yaml"), "--out", str(out))
    assert code == 0, err
    train, _ = builders.load_splits(curate.load_dict(cfg)[0])
    sevens = {p.id for p in train if p.answer == "7"}
    assert 0 < len(sevens) < len(train)
    dropped = _rows(out / "dropped.jsonl")
    by_step = {s: {r["id"] for r in dropped if r["step"] == s} for s in curation.STEPS}
    assert by_step["no_cot"] == sevens
    assert by_step["difficulty"] == {p.id for p in train} - sevens
    assert {r["detail"] for r in dropped if r["step"] == "no_cot"} == {
        "solved in 1.00 of 2 samples without thinking"
    }
    assert {r["detail"] for r in dropped if r["step"] == "difficulty"} == {
        "pass rate 0.00 over 2 samples"
    }
    assert _rows(out / "synthetic.jsonl") == []
    assert f"no_cot      dropped {len(sevens)} (default {len(sevens)})" in stdout


def test_mixture_sources_report_per_domain(tmp_path, capsys):
    gsm_rows = _rows(sample_path("gsm8k_sample.jsonl"))
    # The MATH source's held-out split holds one GSM8K training question: the report counts it
    # under the gsm8k domain, found against the math source's held-out split.
    held = _write_jsonl(
        tmp_path / "math_eval.jsonl", [{"problem": gsm_rows[2]["question"], "answer": "1"}]
    )
    gsm_fields = {"question_field": "question", "answer_field": "answer", "solution_field": None}
    cfg = {
        "data": {
            "mixture": [
                {
                    "domain": "math",
                    "data": {"train": sample_path("math_sample.jsonl"), "eval": held},
                    "reward": {"fn": "r1_zero"},
                },
                {
                    "domain": "gsm8k",
                    "data": {"train": sample_path("gsm8k_sample.jsonl"), **gsm_fields},
                    "reward": {"fn": "gsm8k"},
                },
            ]
        },
        "curate": {"guessable": {"enabled": True}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    code, stdout, err = _main(capsys, "curate", str(tmp_path / "c.yaml"), "--out", str(out))
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert {d: (v["loaded"], v["kept"]) for d, v in report["domains"].items()} == {
        "math": (30, 30),
        "gsm8k": (22, 21),
    }
    assert report["decontam"]["by_source"] == {
        "gsm8k": {"exact": 1, "ngram": 0, "exact:math:held_out": 1}
    }
    assert "decontam    dropped 1 (math 0, gsm8k 1)" in stdout
    assert f"data.mixture[1].data.train={out / 'gsm8k.jsonl'}" in stdout
    assert len(_rows(out / "math.jsonl")) == 30 and len(_rows(out / "gsm8k.jsonl")) == 21


def test_parquet_source_without_eval_sets(tmp_path, capsys):
    cfg = {
        "data": {"train": sample_path("math_sample.parquet")},
        "curate": {"decontam": {"held_out": False}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    code, stdout, err = _main(capsys, "curate", str(tmp_path / "c.yaml"), "--out", str(out))
    assert code == 0, err
    assert "decontamination: no evaluation set (no held-out split, no against)" in stdout
    # Parquet rows come out as jsonl rows with the same fields, loadable as the run loads them.
    kept, _ = loading.load_problems(loading.DataConfig.math(str(out / "math_sample.jsonl")))
    original, _ = loading.load_problems(loading.DataConfig.math(sample_path("math_sample.parquet")))
    assert [(p.question, p.answer) for p in kept] == [(p.question, p.answer) for p in original]
