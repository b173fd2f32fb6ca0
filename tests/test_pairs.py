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
    from test_train import TINY, _jaxrlvr

    sft_dir, dpo_dir, data = tmp_path / "sft", tmp_path / "dpo", tmp_path / "pairs.jsonl"
    _jaxrlvr("sft", "configs/demo.yaml", f"run.out_dir={sft_dir}", "sft.steps=4", *TINY)
    proc = _jaxrlvr(
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
    _jaxrlvr(
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
