"""``jaxrlvr pairs`` and the offline preference phase of ``jaxrlvr train``: pair selection, the
config, and (slow) SFT -> pairs -> DPO end to end on a tiny model."""

import json
import pathlib

import numpy as np
import pytest

from jaxrlvr import config as config_lib
from jaxrlvr import configlib, pairs

REPO = pathlib.Path(__file__).parent.parent


def test_make_pairs_pairs_correct_with_incorrect_per_prompt():
    texts = ["a1", "a2", "a3", "b1", "b2", "b3", "c1", "c2", "c3"]
    correct = np.asarray([1, 0, 1, 0, 0, 0, 1, 0, 0], bool)
    rows = pairs.make_pairs(["A", "B", "C"], ["a", "b", "c"], texts, correct, 3, 2)
    assert rows == [
        {"prompt": "A", "chosen": "a1", "rejected": "a2", "id": "a"},
        {"prompt": "C", "chosen": "c1", "rejected": "c2", "id": "c"},
    ]
    rows = pairs.make_pairs(["C"], ["c"], texts[6:], correct[6:], 3, 5)
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("c1", "c2")]


def test_pairs_config_is_validated():
    with pytest.raises(ValueError, match="k=1"):
        pairs.PairsConfig(k=1)


def test_preference_algos_in_the_config():
    cfg = config_lib.load_config(
        "configs/demo.yaml", ["rl.algo=simpo", "pref.data=x.jsonl", "pref.beta=2.0"]
    )
    assert cfg.rl.algo == "simpo" and cfg.pref.beta == 2.0
    with pytest.raises((configlib.ConfigKeyError, ValueError), match="kto"):
        config_lib.load_config("configs/demo.yaml", ["rl.algo=kto"])


@pytest.mark.slow
def test_sft_pairs_dpo_end_to_end(tmp_path):
    from runs import TINY, jaxrlvr

    sft_dir, dpo_dir, data = tmp_path / "sft", tmp_path / "dpo", tmp_path / "pairs.jsonl"
    jaxrlvr("sft", "configs/demo.yaml", f"run.out_dir={sft_dir}", "sft.steps=4", *TINY)
    proc = jaxrlvr(
        "pairs",
        "configs/demo.yaml",
        *TINY,
        "--checkpoint",
        str(sft_dir),
        "--out",
        str(data),
        "--k",
        "4",
        "--max-problems",
        "32",
    )
    assert "wrote" in proc.stdout
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert rows and all({"prompt", "chosen", "rejected", "id"} <= set(r) for r in rows)
    jaxrlvr(
        "train",
        "configs/demo.yaml",
        f"run.out_dir={dpo_dir}",
        "sft.steps=4",
        "rl.algo=dpo",
        "rl.steps=2",
        f"pref.data={data}",
        "pref.batch_size=2",
        "eval.every=2",
        *TINY,
    )
    lines = [json.loads(x) for x in (dpo_dir / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    for key in ("loss", "reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp"):
        assert np.isfinite(last[key]), key
    assert "eval/accuracy" in last
    # Step 1 of DPO: the policy is its own reference.
    np.testing.assert_allclose(lines[-2]["loss"], np.log(2.0), rtol=1e-4)


def _pair_rows(n):
    """``n`` pairs in the demo task's text (the char tokenizer's alphabet): a correct answer
    against a wrong one, of different lengths, some rejected responses without the format."""
    rows = []
    for i in range(n):
        a, b = 3 + i, 2 * i % 17
        wrong = [f" <answer>{a + b + 1}</answer>", f" <answer>{a + b - 1}", " 0", " <answer>"][
            i % 4
        ]
        rows.append(
            {"prompt": f"{a} + {b} =", "chosen": f" <answer>{a + b}</answer>", "rejected": wrong}
        )
    return rows


@pytest.mark.slow  # two tiny in-process trainers, about 20-40 s on the 2-core CI machine
def test_cached_reference_gives_the_same_updates_with_one_reference_pass(tmp_path):
    """pref.cache_reference: the reference's log-probs are computed once for the data set (one
    pass, in batches of pref.batch_size through the record's prepare) and the steps' prepare
    runs no reference forward; the three updates equal those with a reference pass per batch."""
    import jax
    from runs import TINY

    from jaxrlvr import train

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _pair_rows(12)))
    results = {}
    for cache in (False, True):
        cfg = config_lib.load_config(
            "configs/demo.yaml",
            [
                *TINY,
                f"run.out_dir={tmp_path / str(cache)}",
                "sft.steps=0",
                "rl.algo=dpo",
                "rl.steps=3",
                "pref.beta=0.5",
                f"pref.data={data}",
                "mesh.data=8",  # the 8 fake devices: rows sharded, the cache gathered
                "pref.batch_size=8",
                f"pref.cache_reference={str(cache).lower()}",
                "optim.learning_rate=1e-2",
            ],
        )
        trainer = train.Trainer(cfg)
        phase = trainer.phase
        reference_passes = []  # per prepare call: did it run the reference forward?
        prepare = phase.compiled.prepare

        def counting_prepare(state, batch, prepare=prepare, seen=reference_passes):
            seen.append(batch.ref_logp is None)
            return prepare(state, batch)

        phase.compiled.prepare = counting_prepare
        try:
            phase.begin()  # reads the pairs (and, cached, computes the reference's log-probs)
            metrics = [phase.step() for _ in range(3)]
            params = jax.device_get(trainer.state.params)
        finally:
            trainer.close()
        results[cache] = (reference_passes, metrics, params)
    (per_batch, m0, p0), (cached, m1, p1) = results[False], results[True]
    assert per_batch == [True, True, True]  # one reference forward per step
    # One pass over the 12 pairs (2 batches of 8, the last filled up), then none per step.
    assert cached == [True, True, False, False, False]
    # Same reference values, so the same losses and updates. Tolerance: the cached values come
    # from batches of other pairs (other padding length), which changes float32 summation order
    # in the forward by a few ulp; three Adam steps at lr 1e-2 keep that far below 1e-5.
    for a, b in zip(m0, m1, strict=True):
        for key in ("loss", "reward_margin", "chosen_reward", "rejected_reward"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert m0[0]["loss"] == pytest.approx(np.log(2.0), rel=1e-5)
    assert m0[-1]["reward_margin"] != 0.0
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
