"""The training loop with rollouts from a real CPU vLLM server (a few GRPO steps).

Needs the vLLM environment (`scripts/setup_vllm.sh`) named by env JAXRLVR_VLLM_PYTHON; skipped
without it locally, failed without it in CI (env CI set).
"""

import json

import pytest
import runs


@pytest.fixture(scope="module")
def crashing_run(tmp_path_factory):
    """The run of ``test_a_crashed_vllm_engine_is_one_line_quoting_its_log``, started in the
    background when the module starts: it mostly waits for its server's two starts, so the
    other test's run shares the machine with it. Yields (run dir, process)."""
    python = runs.vllm_python()
    run_dir = tmp_path_factory.mktemp("crashed_engine") / "run"
    cmd = ["train", "configs/demo.yaml"]
    cmd += [
        f"run.out_dir={run_dir}",
        "run.progress=false",
        "run.tensorboard=false",
        "sampler.kind=vllm",
        f"sampler.vllm_python={python}",
        "model.hidden_size=32",  # 2 heads: head_dim 16, which vLLM's CPU attention refuses
        "model.num_attention_heads=2",
        "model.num_key_value_heads=1",
        "model.intermediate_size=64",
        "model.num_hidden_layers=1",
        "data.synthetic_train_size=100",
        "data.synthetic_eval_size=8",
        "eval.max_problems=8",
        "sft.steps=0",
        "rl.steps=2",
        "reward.num_workers=1",
    ]
    proc = runs.launch(*cmd, pipe=False)
    yield run_dir, proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_loop_with_vllm_sampler(crashing_run, tmp_path):  # crashing_run goes on alongside
    python = runs.vllm_python()
    run_dir = tmp_path / "run"
    cmd = [
        "train",
        "configs/demo.yaml",
        f"run.out_dir={run_dir}",
        "run.progress=false",
        "run.tensorboard=false",
        "sampler.kind=vllm",
        f"sampler.vllm_python={python}",
        # head_dim 32: the smallest the CPU attention backend of vLLM supports
        "model.hidden_size=64",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=1",
        "model.intermediate_size=128",
        "model.num_hidden_layers=1",
        "data.synthetic_train_size=100",
        "data.synthetic_eval_size=8",
        "eval.max_problems=8",
        "sft.steps=3",
        "sft.batch_size=8",
        "rl.steps=3",
        "rl.prompts_per_step=4",
        "rl.group_size=4",
        "eval.every=3",
        "checkpoint.every=3",
        "reward.num_workers=1",
    ]
    proc = runs.jaxrlvr(*cmd, timeout=1500, check=False)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n" + (
        (run_dir / "vllm_server.log").read_text()[-3000:]
        if (run_dir / "vllm_server.log").exists()
        else ""
    )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in lines if "reward_mean" in x]
    assert len(rl) == 3
    for line in rl:
        # The weights reached the server after every update, and its logprobs match the
        # trainer's own for the same tokens within 1e-4 (float32 on both sides; measured ~5e-7).
        # The demo model has tied embeddings: this also guards the untied serving export.
        assert line["sync/total_s"] > 0
        assert line["sampler_trainer_logprob_gap_max"] < 1e-4, line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == 3


@pytest.mark.vllm
@pytest.mark.slow
def test_a_crashed_vllm_engine_is_one_line_quoting_its_log(crashing_run):
    """A model whose attention vLLM's CPU build cannot run (head_dim 16): the engine dies of a
    fatal error at the first request. The server is restarted once; when it dies of the same
    error again the run stops with one line that quotes the root cause from the server's log and
    names the log, exit 1, no traceback; the checkpoint-free run directory holds no metrics."""
    run_dir, proc = crashing_run
    out, err = runs.wait(proc, check=False)
    log = run_dir / "vllm_server.log"
    assert proc.returncode == 1, f"{out}\n{err}"
    errors = [x for x in err.splitlines() if not x.startswith("[jaxrlvr] ")]
    assert errors == [
        "jaxrlvr train: error: vLLM server at "
        + errors[0].split("vLLM server at ")[1].split(" ")[0]
        + " died again of the same fatal error, so it is not restarted: RuntimeError: "
        "Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0 "
        f"(log: {log})"
    ], err
    assert "Traceback" not in err
    assert log.read_text().count("=== jaxrlvr: starting") == 2  # started, restarted once
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "checkpoints").exists()
