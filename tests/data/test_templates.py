"""Prompt templates: the R1-Zero text verbatim, braces kept, chat via the tokenizer."""

import importlib.resources

import pytest

from jaxrlvr.data import templates, tokenizer

R1_ZERO = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <think> "
    "</think> and answer is enclosed within <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: What is $\\frac{1}{2} + {x}$?\n"
    "Assistant: <think>"
)


def test_r1_zero_verbatim_and_braces_kept():
    prompt = templates.render_prompt("r1_zero", "What is $\\frac{1}{2} + {x}$?")
    assert prompt == R1_ZERO
    assert prompt.endswith("Assistant: <think>")


def test_question_only_is_the_question():
    assert templates.render_prompt("question_only", "7 + 5 - 3 =") == "7 + 5 - 3 ="


def test_templates_are_package_files():
    root = importlib.resources.files("jaxrlvr.data") / "templates"
    assert (root / "r1_zero.txt").is_file() and (root / "question_only.txt").is_file()


def test_chat_uses_the_tokenizer_template():
    tok = tokenizer.build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    assert templates.render_prompt("chat", "1 + 1 =", tok) == "[user]1 + 1 =\n[assistant]"


def test_errors():
    with pytest.raises(ValueError, match="template must be one of.*r1_zero"):
        templates.render_prompt("alpaca", "q")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        templates.render_prompt("chat", "q")
