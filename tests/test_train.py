"""The training loop end to end on a tiny model: outputs, exact resume after SIGKILL, bad input."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).parent.parent

# A tiny run: 1-layer model, a handful of SFT and RL steps, small eval.
TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "data.synthetic_train_size=200",
    "data.synthetic_eval_size=16",
    "sft.batch_size=16",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "eval.max_problems=16",
    "reward.num_workers=1",
    "run.progress=false",
    "run.tensorboard=false",
]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, like a user's laptop
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _jaxrlvr(*args, timeout=900, check=True):
    cmd = [sys.executable, "-m", "jaxrlvr.cli", *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _final_params(run_dir):
    """The newest checkpoint's step and policy params as {path: numpy array}."""
    import jax

    from jaxrlvr import checkpoint as checkpoint_lib

    ckpt = checkpoint_lib.Checkpointer(os.path.join(run_dir, "checkpoints"))
    step = ckpt.latest_step()
    params = ckpt.read_arrays(step)["state"]["params"]
    ckpt.close()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return step, {jax.tree_util.keystr(k): v for k, v in flat}


@pytest.mark.slow
def test_demo_pipeline_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = _jaxrlvr(
        "train",
        "configs/demo.yaml",
        f"run.out_dir={run_dir}",
        "sft.steps=4",
        "rl.steps=3",
        "eval.every=2",
        "checkpoint.every=2",
        *TINY,
    )
    assert "held-out accuracy after SFT warm start" in proc.stdout
    assert "held-out accuracy after GRPO" in proc.stdout
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 8))
    rl_line = lines[-1]
    for key in (
        "reward_mean",
        "reward_std",
        "format_rate",
        "accuracy",
        "response_length_mean",
        "response_length_max",
        "zero_variance_group_fraction",
        "policy_loss",
        "kl",
        "entropy",
        "clip_frac",
        "grad_norm",
        "learning_rate",
        "sampler_trainer_logprob_gap_mean",
        "time/sample_s",
        "time/update_s",
        "throughput/sample_tokens_per_s",
        "eval/accuracy",
    ):
        assert key in rl_line, key
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sft_steps"] == 4 and summary["rl_steps"] == 3
    assert summary["eval_accuracy_after_sft"] is not None
    assert summary["eval_accuracy_final"] is not None
    assert (run_dir / "config.yaml").exists()
    assert sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert (run_dir / "checkpoints").is_dir()

    # export -> a folder transformers loads
    out = tmp_path / "hf"
    _jaxrlvr("export", str(run_dir), str(out))
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    step, params = _final_params(run_dir)
    emb = params["['model']['embed_tokens']['embedding']['value']"]
    np.testing.assert_array_equal(hf.model.embed_tokens.weight.detach().numpy(), emb)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|endoftext|>"
    # An older checkpoint exports too, and exporting leaves the run's metrics untouched.
    _jaxrlvr("export", str(run_dir), str(tmp_path / "hf6"), "--step", "6")
    assert json.loads((tmp_path / "hf6" / "jaxrlvr_export.json").read_text())["step"] == 6
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 7

    # eval on the run's checkpoint
    proc = _jaxrlvr(
        "eval", "configs/demo.yaml", f"run.out_dir={run_dir}", *TINY, "--checkpoint", str(run_dir)
    )
    assert "eval/accuracy" in proc.stdout

    # plot two runs overlaid
    proc = _jaxrlvr("plot", str(run_dir), str(run_dir), "--out", str(tmp_path / "plots"))
    assert (tmp_path / "plots" / "reward_mean.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, extra",
    [("ppo", ()), ("ppo", ("rl.ppo.trunk=separate",)), ("expert_iteration", ())],
    ids=["ppo", "ppo_separate_critic", "expert_iteration"],
)
def test_other_algorithms_run(tmp_path, algo, extra):
    run_dir = tmp_path / algo
    _jaxrlvr(
        "train",
        "configs/demo.yaml",
        f"run.out_dir={run_dir}",
        "sft.steps=2",
        "rl.steps=2",
        f"rl.algo={algo}",
        "eval.every=2",
        "checkpoint.every=2",
        *TINY,
        *extra,
    )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    if algo == "ppo":
        assert "vf_loss" in lines[-1]


@pytest.mark.slow
def test_field_options_run_and_report(tmp_path):
    """Difficulty filtering, curriculum sampling, zero-variance dropping, the Kimi length reward
    from step 1 and the DAPO overlong penalty, all in one short run."""
    run_dir = tmp_path / "options"
    _jaxrlvr(
        "train",
        "configs/demo.yaml",
        f"run.out_dir={run_dir}",
        "sft.steps=2",
        "rl.steps=3",
        "rl.difficulty_filter=true",
        "rl.difficulty_filter_k=2",
        "rl.curriculum=true",
        "rl.drop_zero_variance_groups=true",
        "rl.length_reward_weight=1.0",
        "rl.length_reward_from_step=1",
        "rl.overlong_cache_len=4",
        "eval.every=3",
        "checkpoint.every=3",
        *TINY,
    )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in lines if "reward_mean" in x]
    assert len(rl) == 3
    assert all("filter/informative_fraction" in x for x in rl)
    assert all("overlong_penalty_mean" in x for x in rl)
    # The length reward is off at RL step 0 and on from step 1.
    assert "length_reward_mean" not in rl[0] and "length_reward_mean" in rl[1]


@pytest.mark.slow
def test_sigkill_and_resume_gives_identical_params(tmp_path):
    args = [
        "configs/demo.yaml",
        "sft.steps=4",
        "rl.steps=6",
        "eval.every=3",
        "checkpoint.every=2",
        *TINY,
    ]
    ref_dir = tmp_path / "uninterrupted"
    _jaxrlvr("train", *args, f"run.out_dir={ref_dir}")

    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jaxrlvr.cli", "train", *args, f"run.out_dir={run_dir}"]
    proc = subprocess.Popen(
        cmd, env=_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 900
    # Kill once the run is in the RL phase, past a checkpoint (step 6 = SFT 4 + RL 2).
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 7:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _jaxrlvr("train", *args, f"run.out_dir={run_dir}", "--resume")

    step_a, a = _final_params(ref_dir)
    step_b, b = _final_params(run_dir)
    assert step_a == step_b == 10
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 11))  # no duplicated or missing steps


def test_bad_config_is_a_one_line_error(tmp_path):
    proc = _jaxrlvr("train", "configs/demo.yaml", "rl.group_sise=3", check=False, timeout=300)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "unknown config key 'rl.group_sise'" in err[0]


def test_missing_data_file_is_a_one_line_error(tmp_path):
    proc = _jaxrlvr(
        "train",
        "configs/demo.yaml",
        f"run.out_dir={tmp_path}",
        f"data.train={tmp_path}/nope.jsonl",
        *TINY,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    assert "nope.jsonl" in proc.stderr.strip().splitlines()[-1]
