"""Decontamination: every planted duplicate found (exact, reformatted numbers, paraphrased
around a long shared passage), no false positive on different problems or the generated tasks'
disjoint splits."""

import pytest

from jaxrlvr import data
from jaxrlvr.data import decontam, loading, multiplication, scratchpad, synthetic

# Evaluation problems written for this test: long enough for 13-grams, full of numbers.
EVAL = [
    "A farmer harvests 12500 apples and sells 3.50 dollars worth of them to each of 40 "
    "customers every day for a week. How many dollars does the farmer make in total?",
    "The ratio of boys to girls in a school of 1,200 students is 0.5. If 60 new girls join the "
    "school next year, what fraction of the students will be girls?",
    "Solve for $x$: $\\dfrac{3}{4}x + 2.0 = 11$.",
    "How many positive divisors does 72 have?",
    "A train leaves the station at 9:00 and travels at 80 kilometers per hour for 2.25 hours "
    "before it stops at a small town to refuel and wait for the next passengers to board.",
]


def planted() -> list[tuple[str, int, str]]:
    """(training text, the evaluation problem it copies, the rule expected to find it)."""
    return [
        # Exact copies up to whitespace and case.
        ("  " + EVAL[0].replace(" ", "  ").upper() + "\n", 0, "exact"),
        (EVAL[3].replace(" ", "\n"), 3, "exact"),
        # Numbers reformatted: thousands separators, trailing zeros, leading zeros, \frac forms.
        (EVAL[0].replace("12500", "12,500").replace("3.50", "3.5"), 0, "exact"),
        (EVAL[1].replace("1,200", "1200").replace("0.5", "0.50"), 1, "exact"),
        (EVAL[1].replace("1,200", "1{,}200").replace("0.5", ".5"), 1, "exact"),
        (EVAL[2].replace("\\dfrac", "\\frac").replace("2.0", "2"), 2, "exact"),
        (EVAL[2].replace("$", "").replace("11", "11.000"), 2, "exact"),
        (EVAL[3].replace("72", "$072$"), 3, "exact"),
        # Paraphrased around a long shared passage: n-gram overlap.
        ("Here is a word problem. " + EVAL[0].replace("12500", "12,500"), 0, "ngram"),
        (EVAL[4].replace("A train leaves", "Yesterday a freight train left"), 4, "ngram"),
        (EVAL[1].split(" If ")[0] + ". Give the number of boys.", 1, "ngram"),
    ]


# Different problems: the same shape with other numbers or words, and other tasks.
DIFFERENT = [
    "Solve for $x$: $\\dfrac{3}{4}x + 2.0 = 12$.",
    "How many positive divisors does 48 have?",
    "How many positive divisors does 720 have?",
    "A farmer harvests 1250 apples.",
    EVAL[3] + " How many of them are even?",  # a short problem inside a longer one
]


@pytest.fixture(scope="module")
def index():
    return decontam.EvalIndex({"bench": EVAL}, decontam.DecontamConfig())


def test_finds_every_planted_duplicate(index):
    for text, source, rule in planted():
        m = index.match(text)
        assert m is not None, text
        assert (m.eval_set, m.eval_index, m.rule) == ("bench", source, rule), text
        assert m.rule == "exact" or m.shared >= 1


def test_no_false_positive_on_different_problems(index):
    for text in DIFFERENT:
        assert index.match(text) is None, text
    gsm8k, _ = loading.load_problems(data.DataConfig.gsm8k(data.sample_path("gsm8k_sample.jsonl")))
    math, _ = loading.load_problems(data.DataConfig.math(data.sample_path("math_sample.jsonl")))
    assert [index.match(p.question) for p in gsm8k + math] == [None] * (len(gsm8k) + len(math))
    # The shipped MATH sample does hold "How many positive divisors does $36$ have?".
    assert index.match("How many positive divisors does 36 have?") is None
    own = decontam.EvalIndex({"math": [p.question for p in math]})
    assert own.match("How many positive divisors does 36 have?").rule == "exact"


@pytest.mark.parametrize(
    "make",
    [
        lambda: synthetic.make_splits(  # the demo's task (configs/demo.yaml)
            0, 500, 100, synthetic.SyntheticConfig(num_steps=1, max_operand=19, max_value=40)
        ),
        lambda: synthetic.make_splits(0, 2000, 200, 3),
        lambda: scratchpad.make_splits(0, 2000, 200, scratchpad.ScratchpadConfig()),
        lambda: multiplication.make_splits(0, 2000, 200),
    ],
    ids=["synthetic-demo", "synthetic-level3", "scratchpad", "multiplication"],
)
def test_no_false_positive_on_generated_splits(make):
    train, held_out = make()
    index = decontam.EvalIndex({"held_out": [p.question for p in held_out]})
    matches = decontam.find_overlaps([p.question for p in train], index)
    assert matches == [None] * len(train)
    # ...while a held-out problem copied into the training split is found.
    copies = [held_out[0].question, held_out[-1].question.replace(" ", "  ")]
    assert [m.rule for m in decontam.find_overlaps(copies, index)] == ["exact", "exact"]


def test_normalisation_rules():
    assert decontam.normalize("  What is 12,500 + 3.50?  ") == "what is 12500 + 3.5"
    assert decontam.normalize("$\\dfrac{1}{2}$ of 1{,}000.00") == "\\frac 1 2 of 1000"
    assert decontam.normalize("\\left( x \\right) = .5") == "( x ) = 0.5"
    assert decontam.normalize("\\text{cm} and 007") == "cm and 7"
    # Not numbers of the same value: 1,2 is a pair and 12.05 keeps its inner zero.
    assert decontam.normalize("(1,2) and 12.05") == "( 1 2 ) and 12.05"
    assert decontam.ngrams(["a", "b", "c"], 2) == {("a", "b"), ("b", "c")}
    assert decontam.ngrams(["a", "b"], 3) == set()


def test_boilerplate_ngrams_do_not_count():
    tail = " Express your answer as a common fraction in lowest terms and show all of your work."
    sets = {"bench": [f"Problem {i} asks for a sum of {i} and {i + 1}." + tail for i in range(12)]}
    train = "Find the product of twelve and thirty." + tail
    # In 12 evaluation problems (> max_ngram_docs = 10): the shared tail is not counted.
    assert decontam.EvalIndex(sets).match(train) is None
    loose = decontam.DecontamConfig(max_ngram_docs=20)
    assert decontam.EvalIndex(sets, loose).match(train).rule == "ngram"


def test_config_checks():
    with pytest.raises(ValueError, match="decontam.n=0"):
        decontam.DecontamConfig(n=0)
