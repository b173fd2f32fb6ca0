"""Rows filled by a token budget (``rl.max_tokens_per_microbatch``): the pure choice of rows and
microbatch count (``rollout.budget_rows``), its config checks, and a run whose update follows the
budget and ends where one microbatch ends (microbatching is exact gradient accumulation)."""

import json
import os

import jax
import numpy as np
import pytest
import runs
from runs import TINY

from jaxrlvr import config as config_lib
from jaxrlvr import configlib, preflight, rollout, train
from jaxrlvr import model as M

# The microbatch counts the budget may choose, written out (rollout.row_bucket's k values).
COUNTS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]


def _expected_count(rows: int, length: int, budget: int, shards: int) -> int:
    """The fewest microbatches from COUNTS whose full microbatches hold ``rows`` rows."""
    most = (budget // length) // shards * shards
    return next(k for k in COUNTS if k * most >= rows)


@pytest.mark.parametrize("shards", [1, 2, 8])
@pytest.mark.parametrize("length", [15, 64, 256])
def test_every_microbatch_fits_the_budget_and_splits_over_the_shards(shards, length):
    for budget in range(shards * length, shards * length * 24, 3 * length // 2 + 1):
        for rows in range(0, 400):
            total, n = rollout.budget_rows(rows, length, budget, shards=shards)
            per = total // n
            assert total == n * per and total >= rows
            assert per % shards == 0 and per >= shards
            assert per * length <= budget
            assert n == _expected_count(rows, length, budget, shards)
            if rows >= 4 * shards:  # the buckets leave at most a third of the rows as padding
                assert total - rows <= total / 3


def test_few_distinct_shapes_over_many_row_counts():
    # A run compiles one update per (rows, microbatches): over 1..2000 packed rows, few pairs.
    for length, budget, shards in [(64, 64 * 16, 1), (256, 256 * 64, 8), (15, 15 * 300, 1)]:
        shapes = {rollout.budget_rows(r, length, budget, shards=shards) for r in range(1, 2001)}
        assert len(shapes) <= 30, (length, budget, shards, len(shapes))


def test_a_budget_of_full_rows_keeps_the_fewest_microbatches():
    # The bench's use: at most 4 rows of 256 per microbatch, 16 rollouts: ceil(rows / 4)
    # microbatches, rows split as evenly as they go (the bench's numbers are unchanged).
    for rows in range(1, 17):
        n = -(-rows // 4)
        assert rollout.budget_rows(rows, 256, 4 * 256) == (n * -(-rows // n), n)


def test_an_impossible_budget_is_a_one_line_error_naming_the_key():
    with pytest.raises(ValueError) as info:
        rollout.budget_rows(8, 64, 255, shards=4, key="rl.max_tokens_per_microbatch")
    assert str(info.value) == (
        "rl.max_tokens_per_microbatch=255 is less than one microbatch of 4 row(s) x T=64 "
        "positions = 256: raise it or lower the rows' length"
    )
    rollout.budget_rows(8, 64, 256, shards=4)  # one row per shard fits


def test_used_rows_counts_up_to_the_last_row_with_tokens():
    packed = rollout.pack([[1, 2]] * 3, [[3, 4, 5]] * 3, pad_id=0, segments=True, batch_size=6)
    assert rollout.used_rows(packed) == 1  # 3 x 4 positions in one row of T = 15
    assert rollout.used_rows(rollout.pack([[1]], [[]], pad_id=0, segments=True)) == 0


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["rl.max_tokens_per_microbatch=0"], "expected an int >= 1 or null"),
        (["rl.max_tokens_per_microbatch=256", "rl.packing=false"], "needs rl.packing=true"),
        (["rl.max_tokens_per_microbatch=256", "rl.algo=dpo"], "needs rl.packing=true"),
        (["rl.max_tokens_per_microbatch=256", "rl.microbatches=2"], "leave rl.microbatches"),
        (
            ["rl.max_tokens_per_microbatch=100", "rl.max_tokens_per_row=128"],
            "less than one row of rl.max_tokens_per_row=128",
        ),
    ],
)
def test_budget_config_errors_name_the_key(overrides, fragment):
    with pytest.raises(configlib.ConfigKeyError) as info:
        config_lib.load_config("configs/demo.yaml", overrides)
    msg = str(info.value)
    assert "rl.max_tokens_per_microbatch=" in msg and fragment in msg and "\n" not in msg


def test_budget_below_one_row_per_batch_shard_is_refused_at_start():
    cfg = config_lib.load_config(
        "configs/demo.yaml", ["rl.max_tokens_per_microbatch=256", "rl.max_tokens_per_row=64"]
    )
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=4, tensor=1), jax.devices()[:8])
    with pytest.raises(configlib.ConfigKeyError, match=r"^rl.max_tokens_per_microbatch=256 is"):
        preflight.check_microbatches_fit_mesh(cfg, mesh)  # 8 shards x 64 positions = 512
    preflight.check_microbatches_fit_mesh(cfg, M.make_mesh(M.MeshConfig(fsdp=4), jax.devices()[:4]))


def _params(run_dir, step):
    from jaxrlvr import checkpoint as checkpoint_lib

    ckpt = checkpoint_lib.Checkpointer(os.path.join(run_dir, "checkpoints"))
    params = ckpt.read_arrays(step)["state"]["params"]
    ckpt.close()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


# SFT 4 steps, then 3 GRPO steps on rows of 64 positions; the entropy bonus makes every step's
# gradient non-zero whatever the rewards, the format reward gives the groups some variance.
BUDGET_RUN = [
    "configs/demo.yaml",
    "sft.steps=4",
    "rl.steps=3",
    "rl.max_tokens_per_row=64",
    "rl.loss.entropy_coef=0.01",
    "reward.format_weight=1.0",
    "optim.learning_rate=1e-2",  # steps that move the parameters well past the tolerance
    "optim.warmup_steps=0",
    "eval.every=100",
    "eval.at_start=false",
    "checkpoint.every=100",
    *TINY,
    "eval.max_problems=4",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "share_prompts, budget",
    [
        (False, 128),  # rows of rollouts: 2 rows of 64 per microbatch
        (True, 64),  # rows of whole groups (a prompt and its 4 completions): 1 row of 64
    ],
)
def test_a_budgeted_run_equals_one_microbatch(tmp_path, share_prompts, budget):
    ref_dir, run_dir = tmp_path / "one", tmp_path / "budget"
    run = [*BUDGET_RUN, f"rl.share_prompts={str(share_prompts).lower()}"]
    runs.jaxrlvr("train", *run, f"run.out_dir={ref_dir}", "rl.microbatches=1")
    runs.jaxrlvr("train", *run, f"run.out_dir={run_dir}", f"rl.max_tokens_per_microbatch={budget}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in lines if "policy_loss" in x]
    assert len(rl) == 3
    for line in rl:
        rows, n = line["tokens/batch_shape_B"], line["tokens/microbatches"]
        assert n > 1 and rows % n == 0 and rows // n * line["tokens/batch_shape_T"] <= budget
    ref_lines = [json.loads(x) for x in (ref_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["tokens/microbatches"] for x in ref_lines if "policy_loss" in x] == [1, 1, 1]
    # Not a vacuous comparison: the RL steps moved the parameters.
    start, ref, got = _params(run_dir, 4), _params(ref_dir, 7), _params(run_dir, 7)
    assert max(np.abs(got[k] - start[k]).max() for k in got) > 1e-2
    assert ref.keys() == got.keys()
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-5, err_msg=k)


@pytest.mark.slow  # two tiny in-process trainers on the 8 fake devices
def test_budget_on_eight_batch_shards_runs_the_record_of_its_count(tmp_path):
    """mesh.data=8: every microbatch's rows a multiple of the 8 shards; two epochs per step, so
    prepare's old log-prob pass runs, in the budget's microbatches too. The count's record is
    built once and shares the trainer's state, and the run equals one with that count fixed.
    (Against one microbatch, 4 Adam steps at lr 1e-2 on 8 shards differ by up to ~1e-5: the
    float32 summation order of any two-microbatch update, fixed or budgeted; the CLI run above
    checks one microbatch on one device.)"""
    results = {}
    for name, override in [
        ("fixed", "rl.microbatches=2"),
        ("budget", "rl.max_tokens_per_microbatch=504"),  # 8 rows of <= 63 positions
    ]:
        cfg = config_lib.load_config(
            "configs/demo.yaml",
            [
                *TINY,
                f"run.out_dir={tmp_path / name}",
                "sft.steps=0",
                "rl.steps=2",
                "rl.epochs_per_step=2",
                "rl.max_tokens_per_row=32",  # about one rollout per row: 16 rows
                "rl.share_prompts=false",
                "rl.loss.entropy_coef=0.01",
                "optim.learning_rate=1e-2",
                "optim.warmup_steps=0",
                "mesh.data=8",
                override,
            ],
        )
        trainer = train.Trainer(cfg)
        try:
            start = jax.device_get(trainer.state.params)
            metrics = [trainer.phase.step() for _ in range(2)]
            if name == "budget":
                rl = trainer.phase.learner
                assert rl.compiled_for(2) is rl.compiled_for(2)
                assert rl.compiled_for(2) is not rl.compiled  # the configured 1's
                assert rl.compiled_for(2).state_shardings is rl.compiled.state_shardings
            params = jax.device_get(trainer.state.params)
        finally:
            trainer.close()
        results[name] = (metrics, params)
    (fixed, p_fixed), (budgeted, p_budget) = results["fixed"], results["budget"]
    assert [m["tokens/microbatches"] for m in fixed] == [2, 2]
    for m in budgeted:
        rows, n = m["tokens/batch_shape_B"], m["tokens/microbatches"]
        assert n == 2 and rows % (8 * n) == 0 and rows // n * m["tokens/batch_shape_T"] <= 504
    moved = max(
        np.abs(a - b).max() for a, b in zip(jax.tree.leaves(p_budget), jax.tree.leaves(start))
    )
    assert moved > 1e-2
    for a, b in zip(jax.tree.leaves(p_fixed), jax.tree.leaves(p_budget), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
