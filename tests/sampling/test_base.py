"""The sampler interface: parameter validation, completion invariants, the thinking budget."""

import dataclasses

import pytest

from jaxrlvr.sampling import base


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"thinking_budget": 0}, "thinking_budget"),
        ({"thinking_budget": 128, "max_tokens": 128}, "thinking_budget"),
        ({"thinking_end_text": "no closing tag"}, "thinking_end_text"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        base.SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    p = base.SamplingParams(stop_token_ids=[3, 4], stop=["</answer>"])
    assert p.stop_token_ids == (3, 4) and p.stop == ("</answer>",)
    assert hash(p) == hash(base.SamplingParams(stop_token_ids=(3, 4), stop=("</answer>",)))
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 128)
    assert not hasattr(p, "n")  # samples per prompt is `generate`'s argument only
    assert p.logprobs and not p.ignore_eos and p.thinking_budget is None
    assert p.thinking_end_text.endswith("</think>")
    assert base.SamplingParams(temperature=0.0).greedy and not p.greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0
    with pytest.raises(TypeError):
        base.SamplingParams(1.0)  # keyword-only


def test_completion_checks_lengths_and_finish_reason():
    ok = base.Completion(
        prompt_index=0, token_ids=[1, 2], logprobs=[-0.5, -1.0], text="ab", finish_reason="stop"
    )
    assert ok.forced_mask == [False, False]
    with pytest.raises(ValueError, match="finish_reason"):
        dataclasses.replace(ok, finish_reason="abort")
    with pytest.raises(ValueError, match="logprobs"):
        dataclasses.replace(ok, logprobs=[-0.5])
    with pytest.raises(ValueError, match="forced"):
        dataclasses.replace(ok, forced=[True])
    # No logprobs requested: an empty list is allowed.
    assert dataclasses.replace(ok, logprobs=[]).logprobs == []


def _c(i, ids, reason="length"):
    return base.Completion(
        prompt_index=i, token_ids=ids, logprobs=[-1.0] * len(ids), text="", finish_reason=reason
    )


def test_check_prompt_major():
    base.check_prompt_major([_c(0, [1]), _c(0, [2]), _c(1, [3]), _c(1, [4])], 2, 2)
    with pytest.raises(RuntimeError, match="prompt-major"):
        base.check_prompt_major([_c(0, [1]), _c(1, [2]), _c(0, [3]), _c(1, [4])], 2, 2)
    with pytest.raises(RuntimeError, match="expected 2 prompts x 2"):
        base.check_prompt_major([_c(0, [1]), _c(0, [2]), _c(1, [3])], 2, 2)


class _CharTokenizer:
    """A real (if tiny) tokenizer: one token per character, ids = code points."""

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class _ScriptedSampler:
    """A deterministic sampler: continues every sequence with a fixed script per prompt.

    Prompt p (first token) picks its script; the sampler emits the script's characters that follow
    what the sequence already holds beyond the original prompt (or, after forced tokens,
    "answer: " + the script), with logprob -0.25 each, and stops on "." (a stop id).
    """

    def __init__(self, scripts):
        self.scripts = scripts
        self.calls = []

    def __call__(self, prompts, n, params):
        self.calls.append((len(prompts), n, params.max_tokens))
        out = []
        for i, p in enumerate(prompts):
            script = self.scripts[p[0]]
            done = "".join(chr(t) for t in p[1:])
            # Forced tokens are already in the prefix; the script resumes after them.
            rest = script[len(done) :] if script.startswith(done) else "answer: " + script
            for _ in range(n):
                ids, reason = [], "length"
                for ch in rest[: params.max_tokens]:
                    ids.append(ord(ch))
                    if ch == ".":
                        reason = "stop"
                        break
                text = "".join(chr(t) for t in ids)
                out.append(
                    base.Completion(
                        prompt_index=i,
                        token_ids=ids,
                        logprobs=[-0.25] * len(ids),
                        text=text,
                        finish_reason=reason,
                    )
                )
        return out


def test_thinking_budget_forces_the_early_exit_only_where_thinking_did_not_close():
    tok = _CharTokenizer()
    end = "\n</think>"
    scripts = {
        0: "ab.",  # stops before the budget: untouched
        1: "xy</think>answer-long-enough",  # closes within the budget: continued, nothing forced
        2: "thinking forever and ever and ever and ever",  # budget hit: forced early exit
    }
    sampler = _ScriptedSampler(scripts)
    params = base.SamplingParams(max_tokens=24, thinking_budget=10, thinking_end_text=end)
    out = base.generate_with_thinking_budget(sampler, [[0], [1], [2]], 2, params, tok)

    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
    # Prompt 0: stopped early, as the first segment returned it.
    assert out[0].token_ids == [ord(c) for c in "ab."] and out[0].finish_reason == "stop"
    assert out[0].forced is None
    # Prompt 1: closed its thinking inside the budget, so it continues without forced tokens.
    c1 = out[2]
    assert "".join(map(chr, c1.token_ids)) == scripts[1][:24]
    assert c1.forced == [False] * 24 and c1.finish_reason == "length"
    # Prompt 2: 10 sampled tokens, then the forced end text (logprob 0.0), then the answer.
    c2 = out[4]
    forced_ids = [ord(ch) for ch in end]
    assert c2.token_ids[:10] == [ord(ch) for ch in scripts[2][:10]]
    assert c2.token_ids[10 : 10 + len(end)] == forced_ids
    assert len(c2.token_ids) == 24
    assert c2.forced == [False] * 10 + [True] * len(end) + [False] * (24 - 10 - len(end))
    assert c2.logprobs == [-0.25] * 10 + [0.0] * len(end) + [-0.25] * (24 - 10 - len(end))
    assert c2.text.startswith(scripts[2][:10] + end)
    # First call: everything up to the budget; continuations get the remaining room.
    assert sampler.calls[0] == (3, 2, 10)
    assert sorted(c[2] for c in sampler.calls[1:]) == [24 - 10 - len(end), 24 - 10]


def test_thinking_budget_truncates_forced_text_that_does_not_fit():
    tok = _CharTokenizer()
    end = "\nmuch too long an ending </think>"
    sampler = _ScriptedSampler({0: "z" * 50})
    params = base.SamplingParams(max_tokens=16, thinking_budget=10, thinking_end_text=end)
    (c,) = base.generate_with_thinking_budget(sampler, [[0]], 1, params, tok)
    assert len(c.token_ids) == 16 and c.finish_reason == "length"
    assert c.token_ids[10:] == [ord(ch) for ch in end[:6]]
    assert c.forced == [False] * 10 + [True] * 6
    assert len(sampler.calls) == 1  # nothing left to generate


def test_thinking_budget_detects_a_special_close_token_by_id():
    """Detokenisers drop special tokens, so ``</think>`` may be absent from the text."""
    c = base.Completion(
        prompt_index=0, token_ids=[5, 2, 7], logprobs=[], text="ab", finish_reason="length"
    )
    assert base.thinking_closed(c, [2])
    assert not base.thinking_closed(c, [9])
    assert base.thinking_closed(dataclasses.replace(c, text="x</think>"), [9])


def test_sampler_protocol_is_structural():
    class Good:
        def generate(self, prompt_token_ids, n, sampling_params):
            return []

        def update_weights(self, weights, *, version=None):
            return {}

        def close(self):
            pass

    assert isinstance(Good(), base.Sampler)
    assert not isinstance(object(), base.Sampler)


def test_generate_holds_the_checks_every_sampler_shares():
    """``base.generate``: n and prompts checked, no prompt gives no completion, the tokenizer is
    asked for only under a thinking budget, and the plain generator gets lists of ints."""
    from jaxrlvr.sampling import base as base_lib

    calls = []

    def plain(prompts, n, params):
        calls.append((prompts, n))
        return [
            base_lib.Completion(
                prompt_index=i // n, token_ids=[7], logprobs=[-0.5], text="x", finish_reason="stop"
            )
            for i in range(len(prompts) * n)
        ]

    def no_tokenizer():
        raise ValueError("needs a tokenizer")

    params = base_lib.SamplingParams(max_tokens=4)
    for bad_n in (0, 1.5, -2):
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            base_lib.generate(plain, [[1]], bad_n, params, no_tokenizer)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        base_lib.generate(plain, [[1], []], 1, params, no_tokenizer)
    assert base_lib.generate(plain, [], 2, params, no_tokenizer) == [] and calls == []
    out = base_lib.generate(plain, [(1, 2), [3]], 2, params, no_tokenizer)
    assert calls == [([[1, 2], [3]], 2)] and len(out) == 4
    budget = base_lib.SamplingParams(max_tokens=4, thinking_budget=2)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        base_lib.generate(plain, [[1]], 1, budget, no_tokenizer)
