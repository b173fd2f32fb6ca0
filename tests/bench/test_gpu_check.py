"""scripts/gpu_check.sh: imports where the optional packages are missing, its table, and the
``--cpu-smoke`` run CI keeps alive (the GPU run itself needs a GPU machine)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxrlvr.bench import gpu_check

REPO = pathlib.Path(__file__).parent.parent.parent


def test_imports_and_grades_without_datasets_math_verify_or_vllm(tmp_path):
    # The GPU machine has none of the three: each is a package here that raises as a missing
    # module would, first on the path of this process and of the grading pool's workers (which
    # warm math-verify at startup: they must still start, and grade integer answers).
    for name in ("datasets", "math_verify", "vllm"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError({'No module named ' + name!r}, name={name!r})\n"
        )
    code = (
        "import jaxrlvr.train, jaxrlvr.cli, jaxrlvr.bench.gpu_check, jaxrlvr.placement\n"
        "from jaxrlvr.rewards import grading, verifiers\n"
        "fn = verifiers.make_reward_fn(verifiers.RewardConfig(name='synthetic'))\n"
        "with grading.GradingPool(num_workers=1, timeout_s=20.0) as pool:\n"
        "    scores, _ = pool.grade(fn, ['<answer>7</answer>', '<answer>8</answer>'], [7, 7])\n"
        "assert [s['answer_reward'] for s in scores] == [1.0, 0.0], scores\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_flops_count_the_lm_head_and_attention():
    cfg = gpu_check.model_config(False)
    assert cfg.num_params() == pytest.approx(1.544e9, rel=0.01)  # Qwen2.5-1.5B
    fwd = cfg.flops_per_token(1024, training=False)
    assert fwd == 2 * (cfg.num_non_embedding_params() + 151936 * 1536) + 4 * 28 * 12 * 128 * 1024
    assert cfg.flops_per_token(1024) == 3 * fwd


def test_table_computes_mfu_and_the_decode_bound():
    results = {
        "matmul": {"device_kind": "H200", "num_devices": 1, "jax": "0.11.2", "matmul_n": 8192,
                   "matmul_tflops": 800.0, "hbm_gbs": 4000.0},
        "update": {"forward_s": 0.1, "forward_flops": 40e12, "forward_tokens_per_s": 81920.0,
                   "forward_peak_gib": 20.0, "forward_compile_s": 30.0,
                   "update_s": 0.3, "update_flops": 120e12, "update_tokens_per_s": 27306.0,
                   "update_peak_gib": 40.0, "update_compile_s": 60.0},
        "sampler": {"prompts": 64, "new_tokens": 256, "tokens_per_s": 8000.0,
                    "decode_step_bytes": 4e9, "peak_gib": 10.0},
        "moe": {"kernels": {"tokens": 4096, "top_k": 8, "experts": 128, "routed_flops": 2e12,
                            "ragged_dot": {"fwd_bwd_ms": 10.0, "rel_err_out": 1e-7,
                                           "rel_err_grad": 2e-7},
                            "ep_ragged_a2a": {"error": "XlaRuntimeError: no"}}},
        "demo": {"error": "exit 1: boom"},
    }  # fmt: skip
    text = gpu_check.table(results)
    assert text.splitlines()[0] == "jaxrlvr GPU check: H200 x1, jax 0.11.2"
    assert "MFU 50.0%" in text and "peak mem 40.0 GiB" in text  # 120e12 / 0.3 s / 800e12
    assert "HBM bound 64,000 tok/s (8.0x below it)" in text  # 64 rows / (4e9 B / 4e12 B/s)
    assert re.search(r"^demo config +FAILED: exit 1: boom$", text, re.M)
    assert "200.0 routed TFLOP/s" in text  # 2e12 FLOPs in 10 ms
    assert re.search(r"^MoE kernel ep_ragged_a2a +FAILED: XlaRuntimeError: no$", text, re.M)


@pytest.mark.slow
def test_cpu_smoke_writes_the_table_and_json(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, OUT=str(tmp_path))
    # one CPU device, as on a plain machine; LLVM at -O0 like the rest of the suite (conftest)
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    env.pop("PYTHONPATH", None)  # the script sets it: a plain checkout must work
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu-smoke"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    text = (tmp_path / "gpu_check.txt").read_text()
    assert text.strip() == proc.stdout.strip()
    # The MoE rows name the kernel "auto" resolves to: block_loop on the CPU, sorted_blocks on GPUs.
    moe_row = "MoE (2-layer 30B-A3B, block_loop) GRPO update"
    rows = ("bf16 matmul", "forward (old logp)", "GRPO update", "MoE kernel ragged_dot",
            "MoE kernel block_loop", moe_row,
            "JaxSampler", "demo (2 RL")  # fmt: skip
    for row in rows:
        assert row in text, text
    # Every grouped kernel computes the one-hot reference's block (float32: rounding only).
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    kernels = record["moe"]["kernels"]
    for name in ("ragged_dot", "sorted_blocks", "block_loop", "dense"):
        assert kernels[name]["rel_err_out"] < 1e-5 and kernels[name]["rel_err_grad"] < 1e-5, name
    assert "skipped" in kernels["ep_ragged_a2a"]  # XLA:CPU cannot compile it
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["smoke"] and record["update"]["update_tokens_per_s"] > 0
    assert record["sampler"]["tokens_per_s"] > 0 and record["demo"]["rl_steps"] == 2
