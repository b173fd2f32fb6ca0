"""Equivalence: each normalisation scores its equivalent forms correct and its near-misses wrong."""

import pytest

from jaxrlvr.rewards import math_equiv

# (pred, gold) pairs that must be equivalent, grouped by the normalisation they exercise.
EQUIVALENT = {
    "fractions": [
        ("\\frac12", "1/2"),
        ("\\dfrac{1}{2}", "0.5"),
        ("\\tfrac{1}{2}", "\\frac{1}{2}"),
        ("1/2", "0.5"),
        ("0.5", "\\frac12"),
    ],
    "assignment": [("x = 5", "5"), ("5", "x=5"), ("4", "x = 4")],
    "text_and_units": [
        ("\\text{5 cm}", "5"),
        ("5\\text{ cm}", "5"),
        ("5 dollars", "5"),
        ("6\\text{ cm}", "6"),
        ("\\text{Thursday}", "Thursday"),
    ],
    "percent": [("50\\%", "50"), ("50%", "50")],
    "degrees": [("90^\\circ", "90"), ("90^{\\circ}", "90"), ("720", "720^\\circ")],
    "dollars": [("\\$5", "5"), ("\\$30", "30"), ("30", "\\$30")],
    "thousands": [
        ("10,000", "10000"),
        ("1{,}000", "1000"),
        ("10\\,000", "10000"),
        ("9000", "9{,}000"),
        ("1,000,000", 1000000),
    ],
    "intervals": [("(1,2]", "(1, 2]"), ("(2,9]", "(2, 9]"), ("[0, \\infty)", "[0,\\infty)")],
    "tuples": [("(3,1)", "(3, 1)"), ("(1,2,3)", "(1, 2, 3)")],
    "sets": [("\\{1,2\\}", "\\{2,1\\}"), ("\\{3, -3\\}", "\\{-3, 3\\}"), ("3, 2", "2, 3")],
    "repeating_decimals": [
        ("0.\\overline{3}", "\\frac{1}{3}"),
        ("0.1\\overline{6}", "1/6"),
        ("0.1(6)", "1/6"),
        ("0.\\overline{45}", "\\frac{5}{11}"),
        ("\\frac{1}{3}", "0.\\overline{3}"),
    ],
    "number_words": [
        ("five", 5),
        ("Twenty-five", "25"),
        ("\\text{five}", "5"),
        ("one hundred and five", 105),
    ],
    "gold_types": [
        ("0.5", 0.5),
        ("1/2", 0.5),
        ("7", 7),
        ("7.0", 7),
        ("-3", -3),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}"),
        ("5", "The answer is $\\boxed{5}$."),
    ],
    "expressions": [("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}"), ("5\\sqrt{2}", "\\sqrt{50}")],
}

# Near-misses: one change away from an equivalent form above; must be scored wrong.
NOT_EQUIVALENT = {
    "fractions": [("\\frac13", "1/2"), ("0.51", "\\dfrac{1}{2}"), ("2/1", "1/2")],
    "assignment": [("x = 6", "5"), ("6", "x=5")],
    "text_and_units": [("\\text{6 cm}", "5"), ("6 dollars", "5"), ("\\text{Friday}", "Thursday")],
    "percent": [("5\\%", "50"), ("51%", "50")],
    "degrees": [("45^\\circ", "90"), ("360", "720^\\circ")],
    "dollars": [("\\$6", "5"), ("\\$3", "30")],
    "thousands": [("10,001", "10000"), ("1{,}001", "1000"), ("100,000", "10000")],
    "intervals": [("[1,2)", "(1,2]"), ("(2, 9)", "(2, 9]"), ("(0, \\infty)", "[0,\\infty)")],
    "tuples": [("(1,3)", "(3, 1)"), ("(1,3,2)", "(1, 2, 3)")],
    "sets": [("\\{1,3\\}", "\\{1,2\\}"), ("\\{3\\}", "\\{-3, 3\\}")],
    "repeating_decimals": [
        ("0.\\overline{3}", "0.3"),
        ("0.\\overline{6}", "\\frac{1}{3}"),
        ("0.\\overline{3}", "0.33"),
    ],
    "number_words": [("six", 5), ("twenty-six", 25), ("five apples and two", 5)],
    "gold_types": [("0.25", 0.5), ("8", 7), ("3", -3), ("\\frac{1}{3}", "\\boxed{\\frac{1}{2}}")],
    "expressions": [("\\pi", "3.14"), ("\\sqrt{3}/2", "\\frac{\\sqrt2}{2}")],
}


def _cases(table):
    return [
        pytest.param(p, g, id=f"{k}-{i}") for k, v in table.items() for i, (p, g) in enumerate(v)
    ]


@pytest.mark.parametrize(("pred", "gold"), _cases(EQUIVALENT))
def test_equivalent_forms_are_correct(pred, gold):
    assert math_equiv.is_equivalent(pred, gold)


@pytest.mark.parametrize(("pred", "gold"), _cases(NOT_EQUIVALENT))
def test_near_misses_are_wrong(pred, gold):
    assert not math_equiv.is_equivalent(pred, gold)


def test_every_normalisation_has_both_directions():
    assert EQUIVALENT.keys() == NOT_EQUIVALENT.keys()


@pytest.mark.parametrize(
    ("pred", "gold"),
    [("", "5"), ("5", ""), ("5", "\\boxed{5"), ("   ", "5"), (None, "5"), ("???", "5")],
)
def test_empty_or_unparseable_never_correct(pred, gold):
    assert not math_equiv.is_equivalent(pred, gold)


def test_bool_gold_rejected():
    with pytest.raises(TypeError):
        math_equiv.gold_to_string(True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("10^{10^{10^{10}}}", "5", False),
        ("10^{10^{10^{10}}}", "10^{10^{10^{10}}}", True),  # identical strings, no sympy
        ("2^2^2^2^2^2", "5", False),
        ("9^{99999999}", "5", False),
        ("1000000!", "5", False),
        ("\\frac{1}{" * 200 + "2" + "}" * 200, "2", False),
        ("1" * 5000, "1" * 5000, True),
        ("1" * 5000, "1" * 4999 + "2", False),
        ("1" * 5000 + ".5", "5", False),
        ("x+" * 50_000 + "1", "5", False),
        ("5\ud800", "6", False),
        ("\udfff\ud800", "5", False),
    ],
    ids=["tower", "tower-same", "chain", "huge-power", "factorial", "frac200", "digits-same",
         "digits-diff", "digits-decimal", "long", "surrogate", "only-surrogates"],
)  # fmt: skip
def test_adversarial_answers_return_defined_results(pred, gold, expected):
    # In process, without the pool: the guards alone must keep these fast and exception-free
    # (pytest-timeout ends the test if a guard regressed and sympy runs away).
    assert math_equiv.is_equivalent(pred, gold) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}} and \\boxed{3}", "3"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed 5$", "5"),
        ("\\fbox{7}", "7"),
        ("\\boxed{5", None),
        ("no box", None),
    ],
)
def test_last_boxed_content(text, expected):
    assert math_equiv.last_boxed_content(text) == expected


def test_as_integer_is_exact_beyond_int_string_limit():
    big = "9" * 5000  # int(big) would raise under Python's default 4300-digit limit
    assert math_equiv.as_integer(big) == big
    assert math_equiv.as_integer("-0007") == "-7"
    assert math_equiv.as_integer("-0") == "0"
    assert math_equiv.as_integer("1,234") == "1234"
    assert math_equiv.as_integer("1,23") is None
    assert math_equiv.as_integer("1.5") is None
