"""MoE routing replay (``algos.routing``): routes recorded by the JaxSampler, carried through
packing, shared prompts and microbatches as ``Batch.routes``, replayed in the forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr import rollout
from jaxrlvr.algos import engine
from jaxrlvr.sampling import base, jax_sampler

CFG = M.ModelConfig(
    vocab_size=64,
    model_type="qwen3_moe",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
N = 2


@pytest.fixture(scope="module")
def lm():
    return M.CausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def completions(lm):
    sampler = jax_sampler.JaxSampler(lm, eos_token_ids=[])
    params = base.SamplingParams(max_tokens=6, temperature=1.0, seed=0, logprobs=True)
    return sampler.generate(PROMPTS, N, params)


def _live_routes(lm, ids):
    _, _, router = lm.backbone(jnp.asarray([ids]), with_router=True)
    return np.transpose(np.asarray(router.expert_ids), (1, 2, 0, 3))[0]


def test_sampler_routes_equal_one_forward(lm, completions):
    """Prefill (grouped) and decode record the experts a single forward over prompt +
    completion chooses, in the compact dtype."""
    for c in completions:
        full = PROMPTS[c.prompt_index] + c.token_ids
        assert c.routes.dtype == np.int8
        assert c.routes.shape == (len(full) - 1, CFG.num_hidden_layers, 2)
        np.testing.assert_array_equal(c.routes, _live_routes(lm, full[:-1]))


def _rows(completions, routes=None, **kw):
    packed = rollout.pack(
        [PROMPTS[c.prompt_index] for c in completions],
        [c.token_ids for c in completions],
        pad_id=0,
        routes=routes if routes is not None else [c.routes for c in completions],
        **kw,
    )
    return packed, rollout.to_batch(packed, routes=packed.routes)


def _logp(lm, batch, microbatches=1):
    graphdef, params = nnx.split(lm, nnx.Param)
    fn = jax.jit(engine.make_logprob_fn(graphdef, num_microbatches=microbatches))
    return np.asarray(fn(params, jax.tree.map(jnp.asarray, batch))[0])


def test_replay_of_live_routes_is_bit_identical(lm, completions):
    _, batch = _rows(completions)
    replayed = _logp(lm, batch)
    live = _logp(lm, batch.replace(routes=None))
    np.testing.assert_array_equal(replayed, live)


def _other_routes(completions, seed=0):
    """Routes that differ from the live ones: random distinct expert pairs, the prompt's the
    same for every completion of a prompt (as one sampler's prefill records them)."""
    rng = np.random.default_rng(seed)

    def draw(n):
        return np.stack([rng.permutation(8)[:2] for _ in range(n * 2)]).reshape(n, 2, 2)

    prompt = {i: draw(len(p) - 1) for i, p in enumerate(PROMPTS)}
    return [
        np.concatenate([prompt[c.prompt_index], draw(len(c.token_ids))]).astype(np.int8)
        for c in completions
    ]


def _by_sequence(packed, logp, completions):
    """Each completion's label log-probs, by its placement (or row)."""
    out = []
    for i, c in enumerate(completions):
        if packed.placement is None:
            start = len(PROMPTS[c.prompt_index]) - 1
            out.append(logp[i, start : start + len(c.token_ids)])
        else:
            row, _, end = packed.placement[i]
            out.append(logp[row, end - len(c.token_ids) : end])
    return np.concatenate(out)


def test_forced_routes_exact_under_packing_shared_prompts_and_microbatches(lm, completions):
    routes = _other_routes(completions)
    padded, batch = _rows(completions, routes)
    ref = _by_sequence(padded, _logp(lm, batch), completions)
    live = _by_sequence(padded, _logp(lm, batch.replace(routes=None)), completions)
    assert np.max(np.abs(ref - live)) > 1e-3  # forcing other experts changes the output
    for kw, mb in (
        (dict(segments=True, row_tokens=16), 1),
        (dict(segments=True, row_tokens=32, share_prompts=N), 1),
        (dict(batch_size=4), 2),
    ):
        packed, b = _rows(completions, routes, **kw)
        got = _by_sequence(packed, _logp(lm, b, mb), completions)
        np.testing.assert_allclose(got, ref, atol=1e-5, err_msg=str(kw))


def test_replay_gradient_reaches_router(lm, completions):
    """Under replay the router's gradient is that of the live-gate reference: the gate weights
    recomputed from the live softmax at the forced experts (a NumPy-free reference: the dense
    expert block with a one-hot combine of those weights, via ``moe.dense_experts``)."""
    routes = _other_routes(completions, seed=1)
    _, batch = _rows(completions, routes)
    batch = jax.tree.map(jnp.asarray, batch)
    graphdef, params = nnx.split(lm, nnx.Param)

    def loss(p):
        model = nnx.merge(graphdef, p)
        logp, _, _ = engine.token_logprobs(model, batch)
        return jnp.sum(logp * batch.attention_mask)

    grads = jax.grad(loss)(params)
    router_grad = grads["model"]["layers"]["mlp"]["gate"]["kernel"].get_value()
    assert float(jnp.max(jnp.abs(router_grad))) > 1e-6
