"""Tool-use RL end to end (``configs/tool_demo.yaml`` on a tiny model): SFT on written tool traces,
then GRPO with asynchronous rollouts or PPO on multi-turn rollouts that run the Python tool in the
sandbox; metrics, checkpoints and an exact resume on multi-turn rows."""

import json
import signal

import numpy as np
import pytest
import runs

pytestmark = pytest.mark.slow

TOOL_TINY = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "data.synthetic_train_size=200",
    "data.synthetic_eval_size=8",
    # Long enough for the constant parts of a call (``<python>print(``) to be learned, so the
    # rollouts reach the tool; the digits it copies may still be wrong.
    "sft.steps=150",
    "sft.batch_size=16",
    "sft.optim.learning_rate=5e-3",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "optim.schedule=constant",
    "eval.max_problems=8",
    "eval.every=2",
    "checkpoint.every=2",
    "reward.num_workers=1",
    "run.progress=false",
    "run.tensorboard=false",
]


GRPO = ["train", "configs/tool_demo.yaml", *TOOL_TINY, "rl.steps=4", "rl.max_staleness=1"]
PPO = [
    "train",
    "configs/tool_demo.yaml",
    *TOOL_TINY,
    "rl.algo=ppo",
    "rl.steps=2",
    # A reward for a closed answer block, so that returns (and the value loss) are not all
    # zero while the tiny model still gets the products wrong.
    "reward.format_weight=0.5",
]


def _metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    """The runs that nothing interrupts, started at once in the background (each mostly one
    core of Python): {"ref": (uninterrupted GRPO run dir, process), "ppo": (...)}."""
    root = tmp_path_factory.mktemp("tool_train")
    ref, ppo = root / "uninterrupted", root / "ppo"
    started = {
        "ref": (ref, runs.launch(*GRPO, f"run.out_dir={ref}", pipe=False)),
        "ppo": (ppo, runs.launch(*PPO, f"run.out_dir={ppo}", pipe=False)),
    }
    yield started
    for _, proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_grpo_with_async_tool_rollouts_trains_checkpoints_and_resumes(background, tmp_path):
    """Stopped by SIGTERM during GRPO with asynchronous multi-turn rollouts, then resumed: the
    same final parameters as a run never stopped (the batch in flight, trajectories included,
    comes back from the checkpoint)."""
    run = tmp_path / "run"
    common = GRPO
    # The uninterrupted reference runs meanwhile (``background``).
    proc = runs.start_until_lines([*common, f"run.out_dir={run}"], run, 151)  # 150 SFT + 1 RL
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "SIGTERM: saved checkpoint step" in err
    runs.jaxrlvr(*common, f"run.out_dir={run}", "--resume")
    ref, ref_proc = background["ref"]
    runs.wait(ref_proc)
    runs.assert_same_params(runs.final_params(ref), runs.final_params(run))
    rows = _metrics(run)
    rl_rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rl_rows] == [151, 152, 153, 154]  # after 150 SFT steps, none twice
    for r in rl_rows:
        assert r["async/staleness"] in (0.0, 1.0)
        assert r["tool/turns_mean"] >= 1.0
        ends = sum(r[f"tool/end/{k}"] for k in ("done", "max_turns", "turn_tokens", "total_tokens"))
        assert ends == pytest.approx(1.0)
        assert np.isfinite(r["loss"]) and r["token_count"] > 0
        # The tool's output tokens are never trained on: the loss counts fewer tokens than the
        # rollouts hold whenever a tool answered.
        if r["tool/calls_per_rollout"] > 0:
            assert r["tool/env_tokens_mean"] > 0
    assert max(r["tool/calls_per_rollout"] for r in rl_rows) > 0
    assert any("eval/accuracy" in r for r in rows)
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps))


def test_ppo_trains_on_multi_turn_rollouts(background):
    run, proc = background["ppo"]
    runs.wait(proc)
    rl_rows = [r for r in _metrics(run) if "reward_mean" in r]
    assert len(rl_rows) == 2
    for r in rl_rows:
        assert np.isfinite(r["loss"]) and np.isfinite(r["vf_loss"])
        assert r["tool/turns_mean"] >= 1.0
    assert max(r["reward_mean"] for r in rl_rows) > 0
    assert max(r["vf_loss"] for r in rl_rows) > 0
