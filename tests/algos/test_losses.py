"""Tests of the CS336 assignment-5 function set (jaxrlvr.algos.losses) against NumPy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import models, pre_tokenizers, processors, trainers

import jaxrlvr.algos
from jaxrlvr.algos import losses

# float32 arithmetic against a float64 NumPy reference: sums of <= 100 terms of size O(10) keep
# relative error well under 1e-5.
RTOL, ATOL = 1e-5, 1e-5


def _rng(seed=0):
    return np.random.default_rng(seed)


def _mask(rng, b, t):
    """Right-padded 0/1 mask with lengths 1..t, float32."""
    lengths = rng.integers(1, t + 1, size=b)
    return (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)


def test_exports_course_set():
    names = [
        "masked_mean",
        "masked_normalize",
        "compute_entropy",
        "get_response_log_probs",
        "tokenize_prompt_and_output",
        "compute_group_normalized_rewards",
        "compute_naive_policy_gradient_loss",
        "compute_grpo_clip_loss",
        "compute_policy_gradient_loss",
        "sft_microbatch_loss",
        "grpo_microbatch_loss",
    ]
    for name in names:
        assert getattr(jaxrlvr.algos, name) is getattr(losses, name)


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_masked_mean_and_normalize_match_numpy(axis):
    rng = _rng(1)
    x = rng.normal(size=(4, 7)).astype(np.float32)
    m = _mask(rng, 4, 7)
    want = (x * m).sum(axis=axis) / m.sum(axis=axis)
    np.testing.assert_allclose(losses.masked_mean(jnp.asarray(x), m, axis), want, RTOL, ATOL)
    got = losses.masked_normalize(jnp.asarray(x), m.astype(bool), 3.5, axis)
    np.testing.assert_allclose(got, (x * m).sum(axis=axis) / 3.5, RTOL, ATOL)


def test_masked_mean_empty_slice_is_nan_like_reference():
    x = jnp.ones((2, 3))
    m = jnp.array([[1, 1, 0], [0, 0, 0]], bool)
    out = losses.masked_mean(x, m, axis=1)
    assert out[0] == 1.0 and np.isnan(out[1])


def _np_log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_entropy_matches_numpy_and_is_stable():
    rng = _rng(2)
    z = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
    lp = _np_log_softmax(z)
    want = -(np.exp(lp) * lp).sum(-1)
    np.testing.assert_allclose(losses.compute_entropy(jnp.asarray(z)), want, RTOL, ATOL)
    # Huge logits: a naive softmax overflows; the logsumexp form gives the same entropy as the
    # shifted logits (entropy is shift-invariant).
    big = losses.compute_entropy(jnp.asarray(z) + 1e4)
    assert np.all(np.isfinite(big))
    np.testing.assert_allclose(big, want, rtol=0, atol=5e-3)  # 1e4 shift costs ~1e-3 in f32
    # uniform over V gives log V; one-hot-like gives ~0
    np.testing.assert_allclose(losses.compute_entropy(jnp.zeros((11,))), np.log(11), 1e-6)
    assert float(losses.compute_entropy(jnp.array([0.0, -1e4, -1e4]))) == pytest.approx(0, abs=1e-6)
    assert losses.compute_entropy(jnp.asarray(z, jnp.bfloat16)).dtype == jnp.float32


def test_entropy_gradient_is_finite_with_masked_out_logits():
    # A vocabulary entry masked with -inf (e.g. a filtered token) has probability 0: the entropy
    # and its gradient must ignore it rather than turn the whole row's gradient into NaN.
    z = jnp.array([[1.0, -jnp.inf, 0.5, -0.3]])
    value, grad = jax.value_and_grad(lambda x: losses.compute_entropy(x).sum())(z)
    finite = np.array([1.0, 0.5, -0.3])
    p = np.exp(finite - finite.max())
    p /= p.sum()
    np.testing.assert_allclose(value, -(p * np.log(p)).sum(), rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(grad)))
    assert float(grad[0, 1]) == 0.0
    # dH/dz_i = -p_i (log p_i + H) on the finite entries
    h = -(p * np.log(p)).sum()
    np.testing.assert_allclose(np.asarray(grad)[0, [0, 2, 3]], -p * (np.log(p) + h), atol=1e-6)


def test_get_response_log_probs_matches_numpy():
    rng = _rng(3)
    z = rng.normal(size=(2, 4, 9)).astype(np.float32) * 2
    labels = rng.integers(0, 9, size=(2, 4)).astype(np.int32)
    lp = _np_log_softmax(z)
    want = np.take_along_axis(lp, labels[..., None], -1)[..., 0]
    out = losses.get_response_log_probs(jnp.asarray(z), jnp.asarray(labels))
    assert set(out) == {"log_probs"}
    np.testing.assert_allclose(out["log_probs"], want, RTOL, ATOL)
    out = losses.get_response_log_probs(jnp.asarray(z), jnp.asarray(labels), True)
    np.testing.assert_allclose(out["token_entropy"], -(np.exp(lp) * lp).sum(-1), RTOL, ATOL)
    assert out["log_probs"].dtype == jnp.float32


def _word_tokenizer(with_bos=False):
    vocab = {"[PAD]": 0, "a": 1, "b": 2, "c": 3, "d": 4, "[BOS]": 5}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] $A", special_tokens=[("[BOS]", 5)]
        )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]")


@pytest.mark.parametrize("with_bos", [False, True])
def test_tokenize_prompt_and_output_hand_example(with_bos):
    tok = _word_tokenizer(with_bos)
    if with_bos:  # the tokenizer really would add BOS; the function must not
        assert tok("a")["input_ids"][0] == 5
    out = losses.tokenize_prompt_and_output(["a b c", "d"], ["d", "a b"], tok)
    # full = [[1, 2, 3, 4], [4, 1, 2, PAD]]
    np.testing.assert_array_equal(out["input_ids"], [[1, 2, 3], [4, 1, 2]])
    np.testing.assert_array_equal(out["labels"], [[2, 3, 4], [1, 2, 0]])
    np.testing.assert_array_equal(out["response_mask"], [[0, 0, 1], [1, 1, 0]])
    assert out["response_mask"].dtype == jnp.bool_


def test_tokenize_prompt_and_output_trained_bpe_roundtrip():
    corpus = ["the answer is 42", "think step by step", "<answer> 7 </answer>"] * 20
    bpe = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["[PAD]", "[UNK]"])
    )
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="[PAD]")
    prompts, outputs = ["think step", "the"], [" by step", " answer is 42 and more"]
    out = losses.tokenize_prompt_and_output(prompts, outputs, tok)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        ids_p, ids_o = tok.encode(p), tok.encode(o)
        labels = np.asarray(out["labels"][i])
        mask = np.asarray(out["response_mask"][i])
        assert labels[mask].tolist() == ids_o
        assert int(mask.sum()) == len(ids_o)
        n = len(ids_p) + len(ids_o)
        assert np.asarray(out["input_ids"][i][: n - 1]).tolist() == (ids_p + ids_o)[:-1]
        assert np.all(labels[n - 1 :] == tok.pad_token_id)


def test_group_normalized_rewards_match_loop():
    rng = _rng(4)
    g = 4
    rewards = rng.integers(0, 3, size=12).astype(float).tolist()
    rewards[4:8] = [1.0] * 4  # one all-equal group
    responses = [str(i) for i in range(12)]

    def reward_fn(response, truth):
        return {"reward": rewards[int(response)], "format_reward": 1.0}

    for by_std in (True, False):
        adv, raw, meta = losses.compute_group_normalized_rewards(
            reward_fn, responses, ["t"] * 12, g, 1e-6, by_std
        )
        want = []
        for k in range(0, 12, g):
            grp = np.asarray(rewards[k : k + g])
            centred = grp - grp.mean()
            want.extend(centred / (grp.std(ddof=1) + 1e-6) if by_std else centred)
        np.testing.assert_allclose(adv, want, RTOL, ATOL)
        np.testing.assert_allclose(raw, rewards)
        assert np.all(np.isfinite(adv))
    np.testing.assert_allclose(adv[4:8], 0.0)
    r = np.asarray(rewards)
    assert meta["reward_mean"] == pytest.approx(r.mean())
    assert meta["reward_std"] == pytest.approx(r.std(ddof=1), rel=1e-5)
    assert meta["reward_min"] == r.min() and meta["reward_max"] == r.max()
    equal = sum(len(set(rewards[k : k + g])) == 1 for k in range(0, 12, g))
    assert meta["frac_groups_all_equal"] == pytest.approx(equal / 3)


def _pg_inputs(seed=5, b=4, t=6):
    rng = _rng(seed)
    lp = -rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
    old = lp + rng.normal(scale=0.4, size=(b, t)).astype(np.float32)
    adv = rng.normal(size=(b, 1)).astype(np.float32)
    return lp, old, adv, _mask(rng, b, t)


def test_naive_and_grpo_clip_match_numpy():
    lp, old, adv, _ = _pg_inputs()
    np.testing.assert_allclose(
        losses.compute_naive_policy_gradient_loss(jnp.asarray(adv), jnp.asarray(lp)), -adv * lp
    )
    eps = 0.2
    loss, meta = losses.compute_grpo_clip_loss(
        jnp.asarray(adv), jnp.asarray(lp), jnp.asarray(old), eps
    )
    ratio = np.exp(lp.astype(np.float64) - old)
    want = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv)
    np.testing.assert_allclose(loss, want, RTOL, ATOL)
    want_clipped = np.clip(ratio, 1 - eps, 1 + eps) * adv < ratio * adv
    np.testing.assert_array_equal(meta["clipped"], want_clipped)
    assert 0 < want_clipped.sum() < want_clipped.size  # the data exercises both branches


def test_grpo_clip_gradient_zero_exactly_on_clipped_tokens():
    lp, old, adv, _ = _pg_inputs(6)

    def total(lp_):
        loss, _ = losses.compute_grpo_clip_loss(jnp.asarray(adv), lp_, jnp.asarray(old), 0.2)
        return loss.sum()

    grad = np.asarray(jax.grad(total)(jnp.asarray(lp)))
    _, meta = losses.compute_grpo_clip_loss(adv, jnp.asarray(lp), old, 0.2)
    clipped = np.asarray(meta["clipped"])
    assert clipped.any() and (~clipped).any()
    assert np.all(grad[clipped] == 0.0)
    # Unclipped: d(-ratio*A)/dlp = -ratio*A, nonzero.
    ratio = np.exp(lp - old)
    np.testing.assert_allclose(grad[~clipped], (-ratio * adv)[~clipped], RTOL, ATOL)


def test_compute_policy_gradient_loss_dispatch_and_errors():
    lp, old, adv, _ = _pg_inputs(7)
    raw = np.abs(adv)
    a, _ = losses.compute_policy_gradient_loss(jnp.asarray(lp), "no_baseline", raw_rewards=raw)
    np.testing.assert_allclose(a, -raw * lp)
    a, _ = losses.compute_policy_gradient_loss(
        jnp.asarray(lp), "reinforce_with_baseline", advantages=adv
    )
    np.testing.assert_allclose(a, -adv * lp)
    a, meta = losses.compute_policy_gradient_loss(
        jnp.asarray(lp), "grpo_clip", advantages=adv, old_log_probs=old, cliprange=0.1
    )
    np.testing.assert_allclose(
        a, losses.compute_grpo_clip_loss(jnp.asarray(adv), jnp.asarray(lp), old, 0.1)[0]
    )
    assert "clipped" in meta
    with pytest.raises(ValueError, match="raw_rewards"):
        losses.compute_policy_gradient_loss(jnp.asarray(lp), "no_baseline", advantages=adv)
    with pytest.raises(ValueError, match="advantages"):
        losses.compute_policy_gradient_loss(jnp.asarray(lp), "reinforce_with_baseline")
    with pytest.raises(ValueError, match="old_log_probs"):
        losses.compute_policy_gradient_loss(
            jnp.asarray(lp), "grpo_clip", advantages=adv, cliprange=0.2
        )
    with pytest.raises(ValueError, match="cliprange"):
        losses.compute_policy_gradient_loss(
            jnp.asarray(lp), "grpo_clip", advantages=adv, old_log_probs=old
        )
    with pytest.raises(ValueError, match="loss_type must be one of"):
        losses.compute_policy_gradient_loss(jnp.asarray(lp), "ppo", advantages=adv)


def test_sft_microbatch_loss_value_and_gradient():
    lp, _, _, m = _pg_inputs(8)
    b, gas, c = lp.shape[0], 4, 7.0
    loss, meta = losses.sft_microbatch_loss(jnp.asarray(lp), m, gas, c)
    want = (-(lp * m).sum(-1) / c).mean() / gas
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(meta["num_response_tokens"]) == m.sum()
    grad = jax.grad(lambda x: losses.sft_microbatch_loss(x, m, gas, c)[0])(jnp.asarray(lp))
    np.testing.assert_allclose(grad, -m / (c * b * gas), rtol=1e-6)


def test_grpo_microbatch_loss_value_and_naive_gradient():
    lp, old, adv, m = _pg_inputs(9)
    b, gas = lp.shape[0], 2
    loss, _ = losses.grpo_microbatch_loss(
        jnp.asarray(lp), m, gas, "reinforce_with_baseline", advantages=adv
    )
    count = m.sum(-1, keepdims=True)
    want = ((-adv * lp * m).sum(-1, keepdims=True) / count).mean() / gas
    assert float(loss) == pytest.approx(want, rel=1e-5)

    def f(x):
        return losses.grpo_microbatch_loss(x, m, gas, "reinforce_with_baseline", advantages=adv)[0]

    # d loss / d lp = -A * mask / normalizer, normalizer = count_b * B * gas.
    np.testing.assert_allclose(jax.grad(f)(jnp.asarray(lp)), -adv * m / (count * b * gas), 1e-6)
    loss, meta = losses.grpo_microbatch_loss(
        jnp.asarray(lp), m, gas, "grpo_clip", advantages=adv, old_log_probs=old, cliprange=0.2
    )
    per_tok = losses.compute_grpo_clip_loss(jnp.asarray(adv), jnp.asarray(lp), old, 0.2)[0]
    want = (np.asarray(per_tok) * m).sum(-1) / m.sum(-1)
    assert float(loss) == pytest.approx(want.mean() / gas, rel=1e-5)
    assert 0.0 <= float(meta["clip_fraction"]) <= 1.0


class CourseVariantsTest(chex.TestCase):
    """Each course loss gives the same result with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_losses_jit_and_eager_agree(self):
        lp, old, adv, m = _pg_inputs(10)
        rng = _rng(10)
        z = jnp.asarray(rng.normal(size=(4, 6, 13)).astype(np.float32))
        labels = jnp.asarray(rng.integers(0, 13, size=(4, 6)).astype(np.int32))
        fns = {
            "masked_mean": lambda: losses.masked_mean(lp, m, 1),
            "masked_normalize": lambda: losses.masked_normalize(lp, m, 3.0, None),
            "entropy": lambda: losses.compute_entropy(z),
            "log_probs": lambda: losses.get_response_log_probs(z, labels, True),
            "naive": lambda: losses.compute_naive_policy_gradient_loss(adv, lp),
            "clip": lambda: losses.compute_grpo_clip_loss(adv, lp, old, 0.2),
            "pg": lambda: losses.compute_policy_gradient_loss(
                lp, "grpo_clip", advantages=adv, old_log_probs=old, cliprange=0.2
            ),
            "sft": lambda: losses.sft_microbatch_loss(lp, m, 2, 3.0),
            "grpo": lambda: losses.grpo_microbatch_loss(
                lp, m, 2, "grpo_clip", advantages=adv, old_log_probs=old, cliprange=0.2
            ),
        }
        for name, fn in fns.items():
            eager = fn()
            got = self.variant(fn)()
            # XLA may fuse/reorder float32 reductions under jit: allow a few ulps (1e-6 rel).
            chex.assert_trees_all_close(got, eager, rtol=1e-6, atol=1e-7, custom_message=name)
