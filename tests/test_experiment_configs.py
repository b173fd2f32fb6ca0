"""configs/experiments/ (docs/experiments/README.md): every file parses, each ablation differs
from grpo.yaml in exactly the settings it ablates, and the scratchpad task runs end to end
through `jaxrlvr train` with the length-by-outcome metrics the audit plots."""

import dataclasses
import json
import pathlib

import pytest

from jaxrlvr import config as config_lib
from jaxrlvr import configlib

REPO = pathlib.Path(__file__).parent.parent
EXPERIMENTS = REPO / "configs" / "experiments"
OUT_DIR_ONLY = {("run", "out_dir")}

# What each RL config changes relative to grpo.yaml (besides run.out_dir).
ABLATED = {
    "no_std": {("rl", "advantage", "scale")},
    "dr_grpo": {("rl", "advantage", "scale"), ("rl", "loss", "aggregation"),
                ("rl", "loss", "norm_constant")},
    "const_norm": {("rl", "loss", "aggregation"), ("rl", "loss", "norm_constant")},
    "epochs4_clip": {("rl", "epochs_per_step")},
    "epochs4_noclip": {("rl", "epochs_per_step"), ("rl", "loss", "clip")},
    "r1_zero": {("model", "path"), ("data", "template"), ("data", "gold_format"),
                ("reward", "fn")},
}  # fmt: skip


def _flat(d, prefix=()):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def _load(name):
    return config_lib.load_config(str(EXPERIMENTS / f"{name}.yaml"))


def test_every_experiment_config_parses():
    names = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))
    assert {"grpo", "scratchpad_base", "scratchpad_sft", "r1_zero_sft", *ABLATED} <= set(names)
    out_dirs = [_load(name).run.out_dir for name in names]
    assert all(d.startswith("runs/experiments/") for d in out_dirs)
    assert len(set(out_dirs)) == len(names)  # no two runs write the same directory
    assert all(_load(name).data.train == "scratchpad" for name in names)


@pytest.mark.parametrize("name", sorted(ABLATED))
def test_ablation_changes_only_what_it_ablates(name):
    base = _flat(config_lib.config_to_dict(_load("grpo")))
    other = _flat(config_lib.config_to_dict(_load(name)))
    changed = {k for k in base if base[k] != other[k]}
    assert changed == ABLATED[name] | OUT_DIR_ONLY


def test_rl_configs_start_from_the_exported_warm_start():
    sft = _load("scratchpad_sft")
    assert sft.rl.algo == "none" and sft.sft.steps > 0 and sft.model.path is None
    for name in ["grpo", *ABLATED]:
        cfg = _load(name)
        assert cfg.sft.steps == 0 and cfg.model.path.endswith("sft_hf"), name
    # The Dr. GRPO constant is the generation budget.
    dr = _load("dr_grpo")
    assert dr.rl.loss.norm_constant == dr.sampler.max_tokens


@pytest.mark.slow
def test_scratchpad_task_trains_end_to_end(tmp_path):
    from runs import TINY, jaxrlvr

    run_dir = tmp_path / "run"
    jaxrlvr(
        "train",
        str(EXPERIMENTS / "scratchpad_base.yaml"),
        f"run.out_dir={run_dir}",
        "sft.steps=3",
        "rl.steps=2",
        "rl.epochs_per_step=2",
        "rl.loss.clip=false",
        "sampler.max_tokens=24",
        "eval.every=2",
        "checkpoint.every=2",
        *TINY,
    )
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rl = [r for r in records if "reward_mean" in r]
    assert len(rl) == 2
    for r in rl:
        # Null (NaN) only when no rollout of the step is correct / incorrect.
        for key in ("response_length_correct_mean", "response_length_incorrect_mean"):
            assert key in r
        assert (
            r["response_length_incorrect_mean"] is None or r["response_length_incorrect_mean"] > 0
        )
        assert r["clip_frac"] == 0.0  # clip=false: no token is ever clipped
    evals = [r for r in records if "eval/accuracy" in r]
    assert evals and all("eval/response_length_incorrect_mean" in r for r in evals)
    saved = configlib.build(config_lib.TrainConfig, json.loads(json.dumps(_saved(run_dir))))
    assert dataclasses.asdict(saved.data.scratchpad) == dataclasses.asdict(
        _load("scratchpad_base").data.scratchpad
    )


def _saved(run_dir):
    import yaml

    return yaml.safe_load(open(run_dir / "config.yaml"))
