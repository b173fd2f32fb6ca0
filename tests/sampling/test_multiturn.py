"""Multi-turn rollouts (``jaxrlvr.envs.MultiTurnSampler``) through the real samplers.

- Re-scoring: a finished trajectory's model tokens, run through the model's own forward over
  prompt + trajectory, get the sampler's log-probs back within 1e-5 (float32 on both sides; the
  sampler's incremental KV-cache decode and the one-shot forward sum in different orders, which
  gave gaps up to ~7e-6 here), and the environment's tokens are exactly the observation's
  one-time tokenization, flagged as not sampled, log-prob 0 and out of the loss mask.
- The JAX sampler and a real vLLM server give identical greedy trajectories (token ids and masks).
"""

import numpy as np
import pytest
from flax import nnx

from jaxrlvr import envs, rollout
from jaxrlvr.phases import producer
from jaxrlvr.sampling import base, jax_sampler, vllm_sampler

PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [300, 301, 302, 303, 304, 305]]
# A quarter of the vocabulary ends a model turn, so turns are short and rollouts reach the
# environment several times.
STOP_IDS = tuple(range(4, 512, 4))


class ScriptedEnv:
    """An environment that answers every turn with a numbered observation and ends the episode
    at its third step (a real ``envs.Environment``; the tools have tests of their own)."""

    stop = ()

    def __init__(self):
        self.k = 0

    def reset(self, prompt, problem=None):
        return None

    def step(self, action):
        self.k += 1
        return envs.EnvStep(
            observation=f" the {self.k} ",
            done=self.k >= 3,
            info={"tool": "scripted", "error": self.k == 2, "seconds": 0.0},
        )

    def close(self):
        pass


def _multi_turn(sampler, tokenizer, **limits):
    kw = dict(max_turns=4, max_tokens_per_turn=8, max_total_tokens=48) | limits
    return envs.MultiTurnSampler(sampler, tokenizer, ScriptedEnv, envs.TurnLimits(**kw))


@pytest.fixture(scope="module")
def jax_setup(tiny_export):
    model = nnx.merge(tiny_export["graphdef"], tiny_export["params"])
    sampler = jax_sampler.JaxSampler(model, tiny_export["tokenizer"], eos_token_ids=(0,))
    return sampler, tiny_export


def _check_env_tokens(c, tokenizer):
    """Every environment run in ``c`` is one observation's own tokenization, log-prob 0."""
    forced = np.asarray(c.forced)
    ids = np.asarray(c.token_ids)
    runs, start = [], None
    for i, f in enumerate(list(forced) + [False]):
        if f and start is None:
            start = i
        if not f and start is not None:
            runs.append((start, i))
            start = None
    assert len(runs) == c.turns - 1 or c.end_reason in ("max_turns", "total_tokens")
    for k, (a, b) in enumerate(runs, start=1):
        expected = tokenizer(f" the {k} ", add_special_tokens=False)["input_ids"]
        assert ids[a:b].tolist() == expected
    assert np.all(np.asarray(c.logprobs)[forced] == 0.0)
    # The model turns are exactly the non-forced tokens, in order.
    spans = [i for a, b in c.turn_spans for i in range(a, b)]
    assert spans == np.flatnonzero(~forced).tolist()


def test_rescored_trajectory_matches_sampler_logprobs_on_model_tokens(jax_setup, helpers):
    sampler, export = jax_setup
    tok = export["tokenizer"]
    mt = _multi_turn(sampler, tok)
    params = base.SamplingParams(max_tokens=48, temperature=1.0, seed=0, stop_token_ids=STOP_IDS)
    out = mt.generate(PROMPTS, 3, params)
    assert [c.prompt_index for c in out] == [0] * 3 + [1] * 3 + [2] * 3
    assert max(c.turns for c in out) >= 3 and any(c.end_reason == "done" for c in out)
    ref = helpers.reference_logprobs(export["graphdef"], export["params"], PROMPTS, out)
    for c, r in zip(out, ref):
        _check_env_tokens(c, tok)
        model_tokens = ~np.asarray(c.forced)
        gap = np.max(np.abs(np.asarray(c.logprobs)[model_tokens] - r[model_tokens]))
        assert gap < 1e-5, (c.turn_spans, gap)
        # The scripted environment counts every step as a tool call and fails its second.
        if c.end_reason in ("done", "max_turns"):
            assert c.tool_calls == c.turns
        elif c.end_reason == "turn_tokens":
            assert c.tool_calls == c.turns - 1
        assert c.tool_errors == int(c.tool_calls >= 2)
    # Packing puts the loss on model tokens only: the mask at each label position is 1 exactly
    # where the trajectory's token was sampled.
    weights = [rollout.completion_weights(c, mask_forced=True, mask_truncated=False) for c in out]
    packed = rollout.pack(
        [PROMPTS[c.prompt_index] for c in out],
        [c.token_ids for c in out],
        pad_id=0,
        loss_weights=weights,
        sampler_logps=[c.logprobs for c in out],
    )
    for i, c in enumerate(out):
        p = len(PROMPTS[c.prompt_index])
        row = packed.loss_mask[i, p - 1 : p - 1 + len(c.token_ids)]
        assert row.tolist() == [0.0 if f else 1.0 for f in c.forced]
    m = envs.trajectory_metrics(out)
    assert m["turns_mean"] == np.mean([c.turns for c in out])
    assert m["errors_per_rollout"] == np.mean([c.tool_errors for c in out])
    assert sum(m[f"end/{r}"] for r in envs.multi_turn.END_REASONS) == pytest.approx(1.0)


def test_trajectories_survive_a_checkpoint_of_rollouts_in_flight(jax_setup):
    """Asynchronous rollouts save the batches in flight as JSON; trajectories come back whole."""
    import json

    sampler, export = jax_setup
    params = base.SamplingParams(max_tokens=48, temperature=1.0, seed=2, stop_token_ids=STOP_IDS)
    out = _multi_turn(sampler, export["tokenizer"]).generate(PROMPTS[:1], 2, params)
    ro = producer.Rollouts(3, [], [PROMPTS[0]], out, {"tool/turns_mean": 2.0})
    # The multi-turn rollout source restores its batches as trajectories.
    back = producer.Rollouts.from_json(json.loads(json.dumps(ro.to_json())), envs.Trajectory)
    assert back.completions == out and all(isinstance(c, envs.Trajectory) for c in back.completions)
    plain = base.Completion(
        prompt_index=0, token_ids=[1], logprobs=[-0.5], text="a", finish_reason="stop"
    )
    single = producer.Rollouts(3, [], [PROMPTS[0]], [plain], {})
    assert producer.Rollouts.from_json(json.loads(json.dumps(single.to_json()))).completions == [
        plain
    ]


def test_limits_end_rollouts_with_their_reason(jax_setup):
    sampler, export = jax_setup
    tok = export["tokenizer"]
    params = base.SamplingParams(max_tokens=48, temperature=1.0, seed=1, stop_token_ids=STOP_IDS)
    one_turn = _multi_turn(sampler, tok, max_turns=1).generate(PROMPTS, 2, params)
    for c in one_turn:
        assert c.turns == 1 and not any(c.forced)
        assert c.end_reason in ("max_turns", "turn_tokens") and c.finish_reason == "length"
    short = _multi_turn(sampler, tok, max_total_tokens=10).generate(PROMPTS, 2, params)
    for c in short:
        assert len(c.token_ids) <= 10
    assert any(c.end_reason == "total_tokens" for c in short)
    no_stop = base.SamplingParams(max_tokens=48, temperature=1.0, seed=1, ignore_eos=True)
    for c in _multi_turn(sampler, tok, max_tokens_per_turn=5).generate(PROMPTS, 1, no_stop):
        assert c.turns == 1 and c.end_reason == "turn_tokens" and len(c.token_ids) == 5


@pytest.mark.vllm
def test_jax_and_vllm_give_identical_greedy_trajectories(jax_setup, vllm_server):
    sampler, export = jax_setup
    server, state = vllm_server
    tok = export["tokenizer"]
    model = nnx.merge(export["graphdef"], state["params"])
    jax_side = jax_sampler.JaxSampler(model, tok, eos_token_ids=(0,))
    params = base.SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=STOP_IDS)
    with vllm_sampler.VLLMSampler(export["cfg"], server, tok) as vs:
        from_vllm = _multi_turn(vs, tok).generate(PROMPTS, 1, params)
    from_jax = _multi_turn(jax_side, tok).generate(PROMPTS, 1, params)
    assert max(c.turns for c in from_jax) >= 2
    for a, b in zip(from_jax, from_vllm):
        assert a.token_ids == b.token_ids
        assert a.forced == b.forced
        assert a.turn_spans == b.turn_spans and a.end_reason == b.end_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
