"""Off-policy correction (jaxrlvr.algos.importance) against an independent NumPy reference.

Every level (token, sequence, geometric) x mode (none, truncate, mask, icepop) x source (engine,
staleness, both) is checked against a float64 loop over sequences, on unpacked and packed rows
and on masks with holes (multi-turn: environment tokens inside a response are masked out).
Hypothesis checks the invariants: identity when the policies agree, masking monotone in the
band, sequence level = token level = geometric level on one-token sequences.
"""

import itertools
import math
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlvr.algos import importance, loss_config

CC = loss_config.CorrectionConfig
LEVELS = typing.get_args(loss_config.CorrectionLevel)
MODES = typing.get_args(loss_config.CorrectionMode)
SOURCES = typing.get_args(loss_config.CorrectionSource)
CLAMP = 20.0


def _data(seed=0, b=6, t=7, gap=0.4, packed=False, holes=True):
    """old / behaviour / sampler log-probs, a mask with an empty row and (``holes``) masked
    tokens inside a response, and (``packed``) two or three segments per row."""
    rng = np.random.default_rng(seed)
    base = -rng.uniform(0.1, 3.0, (b, t))
    behaviour = base + rng.normal(0, gap, (b, t))
    old = behaviour + rng.normal(0, gap, (b, t))
    sampler = behaviour + rng.normal(0, gap, (b, t))
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    mask[1] = 0.0
    if holes:
        mask[0, 1:3] = 0.0  # environment tokens between two model turns
    seg = None
    if packed:
        seg = np.zeros((b, t), np.int32)
        for i in range(b):
            cuts = sorted(rng.choice(np.arange(1, t), size=int(rng.integers(1, 3)), replace=False))
            ids = np.searchsorted(cuts, np.arange(t), side="right") + 1
            seg[i] = ids
        mask = np.where(seg > 0, mask, 0.0).astype(np.float32)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return dict(old=f32(old), behaviour=f32(behaviour), sampler=f32(sampler), mask=mask, seg=seg)


def _sequences(mask, seg):
    """[(row, [token positions])] of every sequence (segment), masked-in tokens only."""
    out = []
    for i in range(mask.shape[0]):
        ids = np.ones(mask.shape[1], int) if seg is None else seg[i]
        for s in sorted(set(ids[ids > 0].tolist())):
            out.append((i, [j for j in range(mask.shape[1]) if ids[j] == s and mask[i, j]]))
    return out


def _log_ratio_np(d, source):
    o, b, s = (d[k].astype(np.float64) for k in ("old", "behaviour", "sampler"))
    return {"engine": b - s, "staleness": o - b, "both": o - s}[source]


def _reference(d, cfg, source):
    """float64 loop: (w, masked, truncated, r) per token, and the diagnostics as means."""
    lr = _log_ratio_np(d, source)
    mask, seg = d["mask"], d["seg"]
    shape = mask.shape
    w, masked, trunc, r = np.ones(shape), np.zeros(shape), np.zeros(shape), np.zeros(shape)
    low, high = cfg.band
    seq_m = seq_t = n_seq = 0
    for i, toks in _sequences(mask, seg):
        if not toks:
            continue
        n_seq += 1
        total = sum(lr[i, j] for j in toks)
        for j in toks:
            x = {"token": lr[i, j], "sequence": total, "geometric": total / len(toks)}[cfg.level]
            ratio = math.exp(min(max(x, -CLAMP), CLAMP))
            out = ratio > high or ratio < low
            r[i, j] = ratio
            if cfg.mode == "truncate":
                w[i, j], trunc[i, j] = min(max(ratio, low), high), out
            elif cfg.mode == "mask":
                w[i, j], masked[i, j] = (0.0 if out else 1.0), out
            elif cfg.mode == "icepop":
                w[i, j], masked[i, j] = (0.0 if out else ratio), out
        seq_m += any(masked[i, j] for j in toks)
        seq_t += any(trunc[i, j] for j in toks)
    v = mask > 0
    n = v.sum()
    d_t = np.clip(np.where(v, lr, 0.0), -CLAMP, CLAMP)
    diag = {
        "k1": (-d_t)[v].sum() / n,
        "k3": (np.exp(d_t) - 1 - d_t)[v].sum() / n,
        "ess": r[v].sum() ** 2 / (n * (r[v] ** 2).sum()),
        "masked": masked[v].sum() / n,
        "truncated": trunc[v].sum() / n,
        "seq_masked": seq_m / n_seq,
        "seq_truncated": seq_t / n_seq,
        "ratio_max": r[v].max(),
        "ratio_min": r[v].min(),
    }
    return (w, masked, trunc, r), diag


def _finalize(m, mask, seg):
    """The contract's finalisation for one source's metrics, done here by hand."""
    n = float(np.sum(mask))
    n_seq = sum(1 for _, toks in _sequences(mask, seg) if toks)
    out = {}
    for key, value in m.items():
        name = key.split("/")[-1]
        if name.endswith("_seqsum"):
            out[name[: -len("_seqsum")]] = float(value) / n_seq
        elif name.endswith("_sum"):
            out[name[: -len("_sum")]] = float(value) / n
        else:
            out[name] = float(value)
    out["ess"] = out["is_w"] ** 2 / out["is_w2"]
    return out


CASES = list(itertools.product(LEVELS, MODES))


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("level, mode", CASES)
def test_every_level_and_mode_matches_numpy(level, mode, packed):
    # Bands chosen so that every mode both keeps and rejects tokens on this data: the sequence
    # level's product ratios spread widely, so its band is wider.
    high = {"token": 1.3, "geometric": 1.2, "sequence": 2.5}[level]
    cfg = CC(mode=mode, level=level, high=high)
    flagged_total = kept_total = 0
    for k, source in enumerate(SOURCES):
        d = _data(seed=10 * CASES.index((level, mode)) + k, packed=packed)
        lr = importance.source_log_ratio(source, d["old"], d["behaviour"], d["sampler"])
        got = importance.correction_weights(lr, d["mask"], cfg, segment_ids_bt=d["seg"])
        (w, masked, trunc, r), diag = _reference(d, cfg, source)
        v = d["mask"] > 0
        # float32 log-ratio sums of <= 7 terms of size ~1, exp'd: 1e-5 relative
        for name, a, b in [("w", got[0], w), ("masked", got[1], masked), ("trunc", got[2], trunc)]:
            np.testing.assert_allclose(np.asarray(a)[v], b[v], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(got[3])[v], r[v], rtol=1e-5)
        assert np.all(np.asarray(got[0])[~v] == 1.0)  # outside the loss mask: untouched
        flagged = masked if mode != "truncate" else trunc
        flagged_total += flagged[v].sum()
        kept_total += (1 - flagged)[v].sum()
        m = importance.correction_metrics("x/", lr, d["mask"], cfg, segment_ids_bt=d["seg"])
        assert set(m) == set(importance.metric_keys("x/"))
        fin = _finalize(m, d["mask"], d["seg"])
        for key, want in diag.items():
            assert fin[key] == pytest.approx(want, rel=1e-5, abs=1e-6), (source, key)
    if mode != "none":  # the band bites on this data: some tokens flagged, some kept
        assert flagged_total > 0 and kept_total > 0


def test_band_defaults_follow_the_peers():
    assert CC(mode="truncate", high=3.0).band == (0.0, 3.0)  # one-sided cap (TRL, Yao et al.)
    assert CC(mode="mask", high=2.0).band == (0.5, 2.0)  # verl: lower = 1 / upper
    assert CC(mode="icepop", high=5.0, low=0.5).band == (0.5, 5.0)  # IcePop's [0.5, 5]
    assert not CC(mode="truncate", source="staleness").uses_sampler
    assert CC(mode="icepop", source="engine").uses_sampler


def test_weights_carry_no_gradient_and_clamp_extremes():
    d = _data(1)
    cfg = CC(mode="icepop", level="sequence", high=1e9, low=0.0)

    def total(lr):
        return jnp.sum(importance.correction_weights(lr, d["mask"], cfg)[0])

    lr = jnp.asarray(d["old"] - d["sampler"])
    assert np.all(np.asarray(jax.grad(total)(lr)) == 0.0)
    huge = importance.correction_weights(lr + 100.0, d["mask"], cfg)[3]
    assert float(jnp.max(huge)) == pytest.approx(math.exp(CLAMP), rel=1e-5)  # clamp at e^20


def test_unavailable_source_reports_zeros_with_the_same_keys():
    d = _data(2)
    m = importance.correction_metrics("x/", None, d["mask"], CC())
    assert set(m) == set(importance.metric_keys("x/"))
    assert all(float(v) == 0.0 for v in m.values())
    assert importance.source_log_ratio("engine", d["old"], d["behaviour"], None) is None


def test_composed_ratio_is_the_product_of_engine_and_staleness():
    d = _data(3)
    parts = {
        s: np.asarray(importance.source_log_ratio(s, d["old"], d["behaviour"], d["sampler"]))
        for s in SOURCES
    }
    # float32 differences of values ~3: 1e-6
    np.testing.assert_allclose(parts["both"], parts["engine"] + parts["staleness"], atol=1e-6)


# --- properties -----------------------------------------------------------------------------

_logps = st.lists(st.floats(-6.0, -0.01), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(_logps, min_size=1, max_size=4),
    level=st.sampled_from(LEVELS),
    mode=st.sampled_from(MODES),
    high=st.floats(1.0, 5.0),
)
def test_identity_when_the_policies_agree(rows, level, mode, high):
    lp = np.full((4, 6), -1.0, np.float32)  # one shape for every example: no recompiles
    mask = np.zeros_like(lp)
    for i, r in enumerate(rows):
        lp[i, : len(r)], mask[i, : len(r)] = r, 1.0
    cfg = CC(mode=mode, level=level, high=high)
    w, masked, trunc, r = importance.correction_weights(jnp.asarray(lp - lp), mask, cfg)
    assert np.all(np.asarray(w) == 1.0) and np.all(np.asarray(r)[mask > 0] == 1.0)
    assert float(jnp.sum(masked)) == 0 and float(jnp.sum(trunc)) == 0
    m = importance.correction_metrics("x/", jnp.asarray(lp - lp), mask, cfg)
    assert float(m["x/k1_sum"]) == 0 and float(m["x/k3_sum"]) == 0
    fin = importance.finalize({**m, "token_count": jnp.sum(mask)})
    assert float(fin["x/ess"]) == pytest.approx(1.0, rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    level=st.sampled_from(LEVELS),
    mode=st.sampled_from(("mask", "icepop")),
    lows=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    highs=st.tuples(st.floats(1.0, 4.0), st.floats(1.0, 4.0)),
)
def test_masking_is_monotone_in_the_band(seed, level, mode, lows, highs):
    d = _data(seed, gap=0.6, packed=seed % 2 == 1)
    lr = d["old"] - d["sampler"]
    wide = CC(mode=mode, level=level, low=min(lows), high=max(highs))
    narrow = CC(mode=mode, level=level, low=max(lows), high=min(highs))

    def kept(cfg):
        flags = importance.correction_weights(lr, d["mask"], cfg, segment_ids_bt=d["seg"])[1]
        return np.asarray(flags) == 0

    kept_wide, kept_narrow = kept(wide), kept(narrow)
    # Every token the narrow band keeps, the wide band keeps too.
    assert np.all(kept_wide[kept_narrow])


@settings(max_examples=25, deadline=None)
@given(
    logps=st.lists(st.tuples(st.floats(-8, -0.01), st.floats(-8, -0.01)), min_size=1, max_size=8),
    mode=st.sampled_from(MODES),
    high=st.floats(1.0, 5.0),
)
def test_levels_agree_on_one_token_sequences(logps, mode, high):
    a, b, mask = np.zeros((8, 1), np.float32), np.zeros((8, 1), np.float32), np.zeros((8, 1))
    for i, (x, y) in enumerate(logps):  # one shape for every example; unused rows masked
        a[i, 0], b[i, 0], mask[i, 0] = x, y, 1.0
    outs = [
        importance.correction_weights(jnp.asarray(a - b), mask, CC(mode=mode, level=lv, high=high))
        for lv in LEVELS
    ]
    for other in outs[1:]:
        chex.assert_trees_all_close(other, outs[0], rtol=1e-6)


class CorrectionVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        d = _data(4, packed=True)
        for level, mode in [("token", "icepop"), ("geometric", "mask"), ("sequence", "truncate")]:
            cfg = CC(mode=mode, level=level, high=1.4)

            def fn(lr, mask, seg, cfg=cfg):
                w = importance.correction_weights(lr, mask, cfg, segment_ids_bt=seg)
                return w, importance.correction_metrics("x/", lr, mask, cfg, segment_ids_bt=seg)

            args = (d["old"] - d["sampler"], d["mask"], d["seg"])
            # float32 reductions over ~40 tokens; XLA may reorder them under jit
            chex.assert_trees_all_close(self.variant(fn)(*args), fn(*args), rtol=1e-6, atol=1e-7)


def test_k3_metric_is_not_negative_at_float32_level_mismatch():
    # log ratios of a few float32 ulps, as two engines that agree up to rounding produce:
    # the k3 sum is >= 0 (exp(d) - 1 - d summed here reads negative in float32).
    d = (np.arange(-32, 32, dtype=np.float32) * np.float32(1e-6)).reshape(4, 16)
    dj = jnp.asarray(d)
    assert float(jnp.sum(jnp.exp(dj) - 1.0 - dj)) < 0  # the old formula, in XLA's float32
    mask = np.ones_like(d)
    m = importance.correction_metrics("x/", jnp.asarray(d), mask, CC(mode="none"))
    assert float(m["x/k3_sum"]) >= 0
