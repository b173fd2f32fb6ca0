"""Sequence packing is exact: the same rollouts packed several per row (segment ids, per-segment
positions) give the same loss, metrics and gradients as one rollout per padded row, for every
aggregation mode, GSPO, KL in the loss and in the reward, sequence-level truncation and
geometric IcePop, expert iteration, SFT and PPO with GAE; and attention never crosses a
segment. Packed with shared prompts (each group's prompt once, ``rl.share_prompts``) the same
holds for GRPO, expert iteration and PPO, and a completion sees its prompt and nothing else."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr import rollout
from jaxrlvr.algos import aggregation, algorithm, gae, grpo, loss_config, ppo, segments, sft, value
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.sampling.base import Completion

G = 4  # samples per prompt
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    cfg = M.ModelConfig.tiny(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1
    )
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    # A second point: the update runs at params1 against old/ref log-probs of params0, so ratios,
    # clipping and KL are not trivial.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    params1 = jax.tree.unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )
    return cfg, graphdef, params, params1


def _rollouts(vocab: int, seed: int = 0):
    """3 prompts x G completions of heavy-tailed lengths (1..20 tokens), some truncated."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, vocab, n)) for n in (3, 5, 4)]
    completions, scores = [], []
    for i in range(len(prompts) * G):
        n = int(np.clip(rng.lognormal(np.log(5), 0.8), 1, 20))
        completions.append(
            Completion(
                prompt_index=i // G,
                token_ids=[int(t) for t in rng.integers(1, vocab, n)],
                # near log(1/V), so sequence-level TIS weights stay O(1)
                logprobs=[float(x) for x in np.log(1 / vocab) + rng.normal(0, 0.05, n)],
                text="",
                finish_reason="length" if n == 20 else "stop",
            )
        )
        r = float(rng.integers(0, 2))
        scores.append({"reward": r, "answer_reward": r, "format_reward": 1.0})
    return prompts, completions, scores


def _both(vocab, share_prompts=False, **shaping):
    """(padded, packed) host batches of the same rollouts through ``rollout.shape``; with
    ``share_prompts`` the packed one holds each group's prompt once."""
    prompts, completions, scores = _rollouts(vocab)
    out = []
    for packing in (False, True):
        cfg = rollout.ShapingConfig(
            group_size=G,
            packing=packing,
            share_prompts=packing and share_prompts,
            row_multiple=2,
            **shaping,
        )
        batch, _ = rollout.shape(prompts, completions, scores, cfg, pad_id=0)
        out.append(batch)
    padded, packed = out
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]  # really packed
    assert packed.segment_ids.max() > 1
    if share_prompts:  # each prompt laid out once, but its last token
        assert int(np.sum((packed.segment_ids == 0) & (packed.attention_mask == 1))) == 2 + 4 + 3
        saved = int(padded.attention_mask.sum()) - int(packed.attention_mask.sum())
        assert saved == SHARED_SAVING
    return padded, packed


def _step(algo, params0, params1, rollouts, value_params=None):
    """prepare at params0, update at params1 with plain SGD(lr=1): params1 - new = gradient.
    One jit for both (one compilation per layout)."""
    state = algo.init(jax.tree.map(jnp.copy, params0), 0)
    if value_params is not None:
        state = state.replace(value_params=value_params)
    fields = algorithm.select_fields(rollouts, algo.rollout_spec)

    @jax.jit
    def run(state, fields, params1):
        batch, prep_m = algo.prepare(state, fields)
        new, metrics = algo.update(state.replace(params=params1), batch)
        return new, {**prep_m, **metrics}

    new, metrics = run(state, jax.tree.map(jnp.asarray, fields), params1)
    grads = jax.tree.map(lambda a, b: a - b, params1, new.params)
    if value_params is not None:
        grads = (grads, jax.tree.map(lambda a, b: a - b, value_params, new.value_params))
    return grads, metrics


# Positions a shared-prompt batch does not compute: each of the 3 prompts (3, 5 and 4 tokens)
# once per group instead of G times, all but its last token (which every completion repeats).
SHARED_SAVING = (G - 1) * (2 + 4 + 3)


def _assert_same(padded_out, packed_out, tokens_saved=0):
    (g_pad, m_pad), (g_pack, m_pack) = padded_out, packed_out
    assert m_pad.keys() == m_pack.keys()
    for k in m_pad:
        want = m_pad[k] - tokens_saved if k == "tokens" else m_pad[k]  # positions attended
        np.testing.assert_allclose(m_pack[k], want, rtol=TOL, atol=TOL, err_msg=k)
    for a, b in zip(jax.tree.leaves(g_pad), jax.tree.leaves(g_pack)):
        np.testing.assert_allclose(b, a, rtol=TOL, atol=TOL)
    assert float(m_pad["grad_norm"]) > 1e-3  # a real gradient was compared


SGD = optax.sgd(1.0)
POLICY_CASES = {
    "token_mean": dict(aggregation="token_mean"),
    "seq_mean_token_mean": dict(aggregation="seq_mean_token_mean"),
    "seq_mean_token_sum": dict(aggregation="seq_mean_token_sum"),
    "seq_mean_token_sum_norm": dict(aggregation="seq_mean_token_sum_norm", norm_constant=16.0),
    "gspo": dict(ratio_level="sequence", clip_eps_low=3e-3, clip_eps_high=4e-3),
    "kl_in_loss_entropy": dict(kl_coef=0.1, kl_in="loss", entropy_coef=0.01),
    "truncate_sequence_dual_clip": dict(
        correction=loss_config.CorrectionConfig(mode="truncate", level="sequence"), dual_clip=3.0
    ),
    "icepop_geometric": dict(
        correction=loss_config.CorrectionConfig(mode="icepop", level="geometric", high=1.05)
    ),
}


# Two cases run by default; the rest (like every full-update test here, ~10 s each on a quiet
# machine) are marked slow.
FAST = ("seq_mean_token_mean", "gspo")


@pytest.mark.parametrize(
    "case",
    [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in sorted(POLICY_CASES)],
)
def test_grpo_packed_equals_padded(model, case):
    cfg, graphdef, params0, params1 = model
    loss = loss_config.PolicyLossConfig(**POLICY_CASES[case])
    algo = grpo.grpo_algorithm(graphdef, SGD, grpo.GRPOUpdateConfig(loss=loss, num_microbatches=2))
    padded, packed = _both(cfg.vocab_size)
    _assert_same(_step(algo, params0, params1, padded), _step(algo, params0, params1, packed))


@pytest.mark.parametrize(
    "case",
    [
        c if c == "seq_mean_token_mean" else pytest.param(c, marks=pytest.mark.slow)
        for c in ("seq_mean_token_mean", "token_mean", "kl_in_loss_entropy", "gspo")
    ],
)
def test_grpo_with_shared_prompts_equals_padded(model, case):
    cfg, graphdef, params0, params1 = model
    loss = loss_config.PolicyLossConfig(**POLICY_CASES[case])
    algo = grpo.grpo_algorithm(graphdef, SGD, grpo.GRPOUpdateConfig(loss=loss, num_microbatches=2))
    padded, shared = _both(cfg.vocab_size, share_prompts=True)
    _assert_same(
        _step(algo, params0, params1, padded),
        _step(algo, params0, params1, shared),
        SHARED_SAVING,
    )


@pytest.mark.slow
@pytest.mark.parametrize("kl_in", ["reward", "loss"])
@pytest.mark.parametrize("share_prompts", [False, True])
def test_ppo_gae_packed_equals_padded(model, kl_in, share_prompts):
    cfg, graphdef, params0, params1 = model
    loss = loss_config.PolicyLossConfig(kl_coef=0.05, kl_in=kl_in)
    ppo_cfg = ppo.PPOUpdateConfig(loss=loss, gamma=0.99, lam=0.9, num_microbatches=2)
    algo = ppo.ppo_algorithm(graphdef, SGD, ppo_cfg)
    head = value.init_value_head(cfg.hidden_size, 3, std=0.3)
    padded, packed = _both(cfg.vocab_size, share_prompts=share_prompts)
    _assert_same(
        _step(algo, params0, params1, padded, head),
        _step(algo, params0, params1, packed, head),
        SHARED_SAVING * share_prompts,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,share_prompts", [("sft", False), ("expert_iteration", False), ("expert_iteration", True)]
)
def test_sft_and_expert_iteration_packed_equal_padded(model, kind, share_prompts):
    cfg, graphdef, params0, params1 = model
    sft_cfg = sft.SFTUpdateConfig(normalize_constant=8.0, num_microbatches=2)
    algo = getattr(sft, f"{kind}_algorithm")(graphdef, SGD, sft_cfg)
    padded, packed = _both(cfg.vocab_size, share_prompts=share_prompts)
    _assert_same(
        _step(algo, params0, params1, padded),
        _step(algo, params0, params1, packed),
        SHARED_SAVING * share_prompts,
    )


def test_gae_restarts_at_every_segment():
    """Two sequences packed in one row get exactly the GAE of each alone."""
    rng = np.random.default_rng(0)
    r, v = rng.normal(size=(2, 6)).astype(np.float32), rng.normal(size=(2, 6)).astype(np.float32)
    m = np.asarray([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]], np.float32)
    alone = gae.compute_gae(jnp.asarray(r), jnp.asarray(v), m, 0.9, 0.8)
    packed_r = np.concatenate([r[0], r[1]])[None]
    packed_v = np.concatenate([v[0], v[1]])[None]
    packed_m = np.concatenate([m[0], m[1]])[None]
    seg = np.asarray([[1] * 6 + [2] * 6], np.int32)
    together = gae.compute_gae(packed_r, packed_v, packed_m, 0.9, 0.8, segment_ids_bt=seg)
    for a, b in zip(alone, together):
        np.testing.assert_allclose(np.asarray(b).reshape(2, 6), a, rtol=1e-6, atol=1e-6)
    task = np.asarray([[1.0] * 6 + [2.0] * 6], np.float32)
    rew = gae.ppo_token_rewards(task, jnp.zeros((1, 12)), packed_m, 0.0, segment_ids_bt=seg)
    assert np.flatnonzero(np.asarray(rew)[0]).tolist() == [3, 10]


def test_attention_does_not_cross_segments(model):
    """Changing one segment's tokens leaves the other segments' logits bit-identical, and a
    segment's logits in a packed row equal its logits alone in a row (positions from 0)."""
    cfg, graphdef, params0, _ = model
    lm = nnx.merge(graphdef, params0)
    rng = np.random.default_rng(1)
    lengths = (5, 7, 4)
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(3)])
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(3)])
    ids = rng.integers(0, cfg.vocab_size, seg.size)
    t = seg.size
    seg, pos = seg.astype(np.int32)[None], pos.astype(np.int32)[None]
    mask = (seg > 0).astype(np.int32)

    def logits(x):
        return np.asarray(lm(jnp.asarray(x[None], jnp.int32), mask, pos, segment_ids=seg))[0]

    base = logits(ids)
    changed = ids.copy()
    changed[5:12] = (changed[5:12] + 1 + rng.integers(0, 5, 7)) % cfg.vocab_size  # segment 2
    other = logits(changed)
    keep = (seg[0] == 1) | (seg[0] == 3)
    np.testing.assert_array_equal(other[keep], base[keep])
    assert np.abs(other[seg[0] == 2] - base[seg[0] == 2]).max() > 1e-3
    # Each segment alone, positions from 0, in a row of its own.
    start = 0
    for n in lengths:
        alone = np.asarray(lm(jnp.asarray(ids[None, start : start + n], jnp.int32)))[0]
        np.testing.assert_allclose(base[start : start + n], alone, rtol=1e-5, atol=1e-5)
        start += n
    assert t == sum(lengths) + 3


def test_a_completion_sees_its_shared_prompt_and_nothing_else(model):
    """Two groups in one row, each prompt laid out once: every completion's logits equal those
    of its own prompt + completion alone in a row, and changing one completion's tokens leaves
    every other token's logits bit-identical."""
    cfg, graphdef, params0, _ = model
    lm = nnx.merge(graphdef, params0)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, n)] for n in (4, 6)]
    comps = [[int(t) for t in rng.integers(1, cfg.vocab_size, n)] for n in (3, 5, 1, 4, 2, 6)]
    per_completion = [prompts[i // 3] for i in range(6)]
    p = rollout.pack(per_completion, comps, pad_id=0, segments=True, share_prompts=3, length=40)
    assert p.shape == (1, 40)
    groups = p.prompt_group_ids[0]
    assert sorted(set(groups[p.attention_mask[0] == 1].tolist())) == [1, 2]
    span_group = [int(groups[start]) for _, start, _ in p.placement]
    assert [span_group[i] == span_group[j] for i in range(6) for j in range(6)] == [
        i // 3 == j // 3 for i in range(6) for j in range(6)
    ]
    for i, (row, start, end) in enumerate(p.placement):  # a completion's span predicts it
        assert p.labels[row, start:end].tolist() == comps[i]
        assert p.input_ids[row, start] == per_completion[i][-1]
        assert p.loss_mask[row, start:end].tolist() == [1.0] * len(comps[i])
        first = len(per_completion[i]) - 1
        assert p.positions[row, start:end].tolist() == list(range(first, first + len(comps[i])))

    def logits(ids):
        out = lm(
            jnp.asarray(ids[None], jnp.int32),
            p.attention_mask,
            p.positions,
            segment_ids=p.segment_ids,
            prompt_group_ids=p.prompt_group_ids,
        )
        return np.asarray(out)[0]

    base = logits(p.input_ids[0])
    for i, (_, start, end) in enumerate(p.placement):
        full = per_completion[i] + comps[i]
        alone = np.asarray(lm(jnp.asarray([full[:-1]], jnp.int32)))[0]
        np.testing.assert_allclose(base[start:end], alone[-len(comps[i]) :], rtol=1e-5, atol=1e-5)
    _, start, end = p.placement[1]
    changed = p.input_ids[0].copy()
    changed[start + 1 : end] = (changed[start + 1 : end] + 1) % cfg.vocab_size
    other = logits(changed)
    keep = p.attention_mask[0] == 1  # padding queries attend nowhere: their values are unread
    keep[start:end] = False
    np.testing.assert_array_equal(other[keep], base[keep])
    assert np.abs(other[start + 1 : end] - base[start + 1 : end]).max() > 1e-3


def test_shared_prompts_refuse_what_they_cannot_pack():
    with pytest.raises(ValueError, match="do not all continue one prompt"):
        rollout.pack([[1, 2], [1, 3]], [[5], [6]], pad_id=0, segments=True, share_prompts=2)
    with pytest.raises(ValueError, match="not groups of share_prompts=2"):
        rollout.pack([[1, 2]] * 3, [[5]] * 3, pad_id=0, segments=True, share_prompts=2)
    with pytest.raises(ValueError, match="needs the packed layout"):
        rollout.pack([[1, 2]] * 2, [[5]] * 2, pad_id=0, share_prompts=2)
    with pytest.raises(
        ValueError, match="a group sharing its prompt of 8 tokens does not fit length T=6"
    ):
        rollout.pack(
            [[1, 2]] * 2, [[5] * 3] * 2, pad_id=0, segments=True, share_prompts=2, length=6
        )
    ids = np.zeros((2, 4), np.int32)
    base = dict(input_ids=ids, attention_mask=ids, labels=ids, loss_mask=ids)
    with pytest.raises(batch_lib.BatchError, match="prompt_group_ids .* need batch.segment_ids"):
        batch_lib.validate_batch(
            batch_lib.Batch(**base, prompt_group_ids=ids), batch_lib.BatchSpec()
        )


def test_pack_layout_and_row_buckets():
    prompts = [[1, 2, 3], [4, 5]] * 3
    comps = [[7] * 10, [8] * 3, [9] * 20, [6], [5] * 7, [4] * 2]
    p = rollout.pack(prompts, comps, pad_id=0, segments=True, row_multiple=2)
    b, t = p.shape
    assert t == 31 and b % 2 == 0
    # Every sequence sits whole in one row, ids 1..k in order, positions restart per segment.
    for i, (row, start, end) in enumerate(p.placement):
        full = prompts[i] + comps[i]
        assert p.input_ids[row, start:end].tolist() == full[:-1]
        assert p.labels[row, start:end].tolist() == full[1:]
        assert p.positions[row, start:end].tolist() == list(range(end - start))
        assert len(set(p.segment_ids[row, start:end].tolist())) == 1
    for row in range(b):
        ids = [s for s in p.segment_ids[row].tolist() if s]
        assert ids == sorted(ids) and set(ids) == set(range(1, len(set(ids)) + 1))
    assert p.num_tokens == sum(len(c) for c in comps)
    assert [rollout.row_bucket(n, 4) for n in (1, 5, 9, 13, 17, 25, 33)] == [
        4, 8, 12, 16, 24, 32, 48,
    ]  # fmt: skip


def test_groups_longer_than_a_sequence_may_be_share_few_row_lengths():
    # A group sharing its prompt may outgrow max_length (max_position_embeddings): its rows'
    # length is still bucketed (T + 1 at 64 x 1, 1.5, 2, 3, ...), so steps whose longest group
    # is 70, 80 or 94 positions share one update program (before: T = 70, 80, 94 exactly).
    lengths = set()
    for n in (8, 10, 11):  # 8 completions of n tokens after a 7-token prompt: 6 + 8n positions
        prompts, comps = [list(range(1, 8))] * 8, [[9] * n] * 8
        p = rollout.pack(
            prompts, comps, pad_id=0, segments=True, share_prompts=8, row_tokens=63, max_length=64
        )
        assert 6 + 8 * n > 63 and p.shape[0] == 1
        lengths.add(p.shape[1])
        assert p.num_tokens == 8 * n
    assert lengths == {95}
    assert rollout.packed_length(63, max_length=64, row_tokens=63) == 63
    assert [rollout.packed_length(n, max_length=64, row_tokens=63) for n in (64, 96, 128)] == [
        95, 127, 191,
    ]  # fmt: skip
    assert rollout.packed_length(100, max_length=128, row_tokens=63) == 127  # within the cap


def test_segment_helpers_and_batch_validation():
    seg = jnp.asarray([[1, 1, 2, 2, 2, 0]], jnp.int32)
    x = jnp.asarray([[1.0, 2.0, 3.0, 4.0, 5.0, 9.0]])
    np.testing.assert_allclose(segments.segment_sums(x, seg)[0, :5], [3, 3, 12, 12, 12])
    assert float(segments.num_sequences(seg, x)) == 2.0
    m = jnp.asarray([[1, 1, 0, 1, 0, 0]])
    assert np.asarray(segments.last_valid(m, seg)).tolist() == [[0, 1, 0, 1, 0, 0]]
    ids = np.zeros((2, 4), np.int32)
    base = dict(input_ids=ids, attention_mask=ids, labels=ids, loss_mask=ids)
    spec = batch_lib.BatchSpec(required=("advantages",))
    with pytest.raises(batch_lib.BatchError, match="give both or neither"):
        batch_lib.validate_batch(
            batch_lib.Batch(**base, advantages=np.zeros(2, np.float32), segment_ids=ids), spec
        )
    with pytest.raises(batch_lib.BatchError, match=r"advantages must have shape \(2, 4\)"):
        batch_lib.validate_batch(
            batch_lib.Batch(
                **base, advantages=np.zeros(2, np.float32), segment_ids=ids, positions=ids
            ),
            spec,
        )
    ok = batch_lib.Batch(
        **base, advantages=np.zeros((2, 4), np.float32), segment_ids=ids, positions=ids
    )
    assert batch_lib.validate_batch(ok, spec) == (2, 4)


def test_grpo_prompt_mean_with_shared_prompts_equals_reweighted_padded(model):
    # ScaleRL's prompt-level averaging on a shared-prompt batch in 2 microbatches, against an
    # independent form of the same objective: the padded batch's seq_mean_token_sum (sum of
    # token terms / B) with each advantage scaled by B / (P * N_g), N_g its group's loss tokens.
    # A positive scale of A scales GRPO's clipped token term by the same factor (clipping
    # decisions depend only on A's sign), so the two gradients are equal.
    cfg, graphdef, params0, params1 = model
    padded, shared = _both(cfg.vocab_size, share_prompts=True)
    mask = np.asarray(padded.loss_mask, np.float64)
    n_seq = mask.shape[0]
    n_g = np.repeat(mask.reshape(-1, G, mask.shape[1]).sum((1, 2)), G)
    scale = n_seq / (n_g.size // G * n_g)
    reweighted = padded.replace(advantages=(padded.advantages * scale).astype(np.float32))

    def algo(aggregation):
        loss = loss_config.PolicyLossConfig(aggregation=aggregation)
        update = grpo.GRPOUpdateConfig(loss=loss, num_microbatches=2)
        return grpo.grpo_algorithm(graphdef, SGD, update)

    g_ref, _ = _step(algo("seq_mean_token_sum"), params0, params1, reweighted)
    g_prompt, m = _step(algo("prompt_mean_token_mean"), params0, params1, shared)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_prompt)):
        np.testing.assert_allclose(b, a, rtol=TOL, atol=TOL)
    assert float(m["grad_norm"]) > 1e-3


def test_zero_variance_groups_leave_the_prompt_mean():
    # ScaleRL's zero-variance filtering (rl.drop_zero_variance_groups) on a shared-prompt batch:
    # a group whose rewards are all equal keeps no loss token, and the prompt-level denominator
    # counts only the other prompts.
    prompts, completions, scores = _rollouts(64)
    for s in scores[G : 2 * G]:  # the second prompt's group: every reward 1
        s.update(reward=1.0, answer_reward=1.0)
    cfg = rollout.ShapingConfig(
        group_size=G, packing=True, share_prompts=True, drop_zero_variance_groups=True
    )
    batch, metrics = rollout.shape(prompts, completions, scores, cfg, pad_id=0)
    assert metrics["zero_variance_group_fraction"] == pytest.approx(1 / 3)
    loss = loss_config.PolicyLossConfig(aggregation="prompt_mean_token_mean")
    den = aggregation.loss_denominator(
        batch.loss_mask, loss, batch.segment_ids, batch.prompt_group_ids
    )
    assert float(den) == pytest.approx(2.0, rel=1e-6)  # a float32 sum of 1 / N_g terms
    # Exactly the dropped group's tokens left the mask.
    kept = sum(len(c.token_ids) for i, c in enumerate(completions) if not G <= i < 2 * G)
    assert float(np.sum(batch.loss_mask)) == kept
