"""Prompts as the policy sees them: a problem rendered in the run's template, text as token ids,
and the sampling parameters of ``sampler`` (training or evaluation).

Not here: the templates themselves (``data.templates``), tokenizers (``data.tokenizer``) and
sampling (``sampling``).
"""

from __future__ import annotations

import sys

from jaxrlvr import config as config_lib
from jaxrlvr.data import loading, templates
from jaxrlvr.sampling import base as sampling_base


def log(msg: str) -> None:
    """One line for the user on stderr, marked as the project's."""
    print(f"[jaxrlvr] {msg}", file=sys.stderr, flush=True)


def render(template: str, problem: loading.Problem, tokenizer) -> str:
    """``problem``'s prompt text in ``template`` (``data.template``)."""
    return templates.render_prompt(template, problem.question, tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """``encode`` of each text, in one batched tokenizer call (half the time of one call each for
    an SFT batch of 64 here)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def sampling_params(
    s: config_lib.SamplerSection, tokenizer, *, eval_mode=False, seed=None
) -> sampling_base.SamplingParams:
    """The ``sampler`` section's parameters for training rollouts or (``eval_mode``) held-out
    evaluation; a stop string that is one token becomes a stop token id."""
    stop_ids, stop_strings = [], []
    for text in s.stop:
        ids = encode(tokenizer, text)
        (stop_ids.append(ids[0]) if len(ids) == 1 else stop_strings.append(text))
    return sampling_base.SamplingParams(
        temperature=s.eval_temperature if eval_mode else s.temperature,
        top_p=s.eval_top_p if eval_mode else s.top_p,
        top_k=0 if eval_mode else s.top_k,
        max_tokens=(s.eval_max_tokens or s.max_tokens) if eval_mode else s.max_tokens,
        stop_token_ids=tuple(stop_ids),
        stop=tuple(stop_strings),
        seed=seed,
        thinking_budget=s.thinking_budget,
    )
