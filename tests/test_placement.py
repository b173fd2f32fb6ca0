"""GPU placement without a GPU: the plan for each README layout, the trainer's environment, the
exact vLLM server command and environment, and the error when JAX already holds other GPUs."""

import os
import types

import pytest

from jaxrlvr import config as config_lib
from jaxrlvr import configlib, placement
from jaxrlvr.sampling import vllm_server

GPUS8 = tuple(str(i) for i in range(8))


def sampler(**kw):
    return config_lib.SamplerSection(kind="vllm", **kw)


def servers_for(plan, tmp_path):
    return [
        vllm_server.VLLMServer(
            tmp_path,
            python="/v/python",
            port=9000 + i,
            device=plan.device,
            gpus=g,
            dtype=plan.dtype,
            gpu_memory_utilization=plan.gpu_memory_utilization or 0.9,
            extra_args=("--seed", "1"),
            start=False,
        )
        for i, g in enumerate(plan.server_gpus or [()])
    ]


def gpu_command(tmp_path, port, gpus, util, extra=("--seed", "1")):
    """The full api_server command a GPU server must run (no --enforce-eager: CUDA graphs)."""
    return [
        "/v/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tmp_path), "--tokenizer", str(tmp_path),
        "--served-model-name", "jaxrlvr-policy",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "512",
        "--tensor-parallel-size", str(len(gpus)), "--gpu-memory-utilization", str(util),
        "--logprobs-mode", "processed_logprobs", *extra,
    ]  # fmt: skip


def test_cpu_server_command_is_unchanged(tmp_path):
    s = vllm_server.VLLMServer(tmp_path, python="/v/python", port=9000, start=False)
    assert s.command() == [
        "/v/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tmp_path), "--tokenizer", str(tmp_path),
        "--served-model-name", "jaxrlvr-policy",
        "--host", "127.0.0.1", "--port", "9000",
        "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(64 * 1024**2), "--enforce-eager",
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    env = s.environment()
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_cpu_host_plans_nothing(monkeypatch):
    # No GPU (this machine): auto means the CPU, and the trainer's environment is left alone.
    p = placement.plan(sampler(), gpus=(), environ={})
    assert p == placement.Placement(device="cpu", dtype="float32")
    assert p.trainer_env == {}
    # The embedded sampler, or servers given by URL, never move the trainer.
    assert placement.plan(config_lib.SamplerSection(), gpus=GPUS8, environ={}).trainer_env == {}
    urls = sampler(vllm_urls=("http://127.0.0.1:8000",))
    assert placement.plan(urls, gpus=GPUS8, environ={}).trainer_env == {}


def test_jax_platforms_cpu_keeps_auto_on_the_cpu():
    p = placement.plan(sampler(), gpus=("0", "1"), environ={"JAX_PLATFORMS": "cpu"})
    assert p.device == "cpu" and p.trainer_env == {}


def test_cs336_layout_two_gpus_one_trains_one_serves(tmp_path):
    p = placement.plan(sampler(), gpus=("0", "1"), environ={})
    assert p.server_gpus == (("1",),) and p.trainer_gpus == ("0",)
    assert p.trainer_env == {"CUDA_VISIBLE_DEVICES": "0"}  # JAX keeps its default 75% of GPU 0
    (s,) = servers_for(p, tmp_path)
    assert s.command() == gpu_command(tmp_path, 9000, ["1"], 0.9)
    env = s.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["VLLM_TARGET_DEVICE"] == "cuda"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert "--enforce-eager" not in s.command() and "--kv-cache-memory-bytes" not in s.command()


def test_eight_gpus_six_train_two_servers(tmp_path):
    p = placement.plan(sampler(vllm_num_servers=2), gpus=GPUS8, environ={})
    assert p.server_gpus == (("6",), ("7",))
    assert p.trainer_env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}
    s6, s7 = servers_for(p, tmp_path)
    assert s6.command() == gpu_command(tmp_path, 9000, ["6"], 0.9)
    assert s7.command() == gpu_command(tmp_path, 9001, ["7"], 0.9)
    assert s6.environment()["CUDA_VISIBLE_DEVICES"] == "6"
    assert s7.environment()["CUDA_VISIBLE_DEVICES"] == "7"


def test_tensor_parallel_groups_and_memory_settings(tmp_path):
    cfg = sampler(vllm_gpus=(4, 5, 6, 7), vllm_num_servers=2, vllm_gpu_memory_utilization=0.8)
    p = placement.plan(cfg, gpus=GPUS8, environ={})
    assert p.server_gpus == (("4", "5"), ("6", "7")) and p.trainer_gpus == ("0", "1", "2", "3")
    a, b = servers_for(p, tmp_path)
    assert a.command() == gpu_command(tmp_path, 9000, ["4", "5"], 0.8)
    assert a.environment()["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert b.environment()["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_colocated_on_one_gpu_caps_both_memories(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # the trainer's, not the server's
    p = placement.plan(sampler(vllm_colocate=True), gpus=("0",), environ={})
    assert p.colocated and p.server_gpus == (("0",),) and p.trainer_gpus is None
    assert p.trainer_env == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
    }
    (s,) = servers_for(p, tmp_path)
    assert s.command() == gpu_command(tmp_path, 9000, ["0"], 0.35)
    env = s.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env


def test_gpu_numbers_are_positions_in_the_visible_list():
    p = placement.plan(sampler(vllm_gpus=(1,)), environ={"CUDA_VISIBLE_DEVICES": "4,6"})
    assert p.server_gpus == (("6",),) and p.trainer_gpus == ("4",)


def test_apply_sets_the_trainer_environment_once(monkeypatch):
    environ = {"CUDA_VISIBLE_DEVICES": "0,1"}
    cfg = sampler(vllm_device="cuda")
    first = placement.apply(placement.plan(cfg, environ=environ), environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "0", placement.HOST_GPUS_ENV: "0,1"}
    # A second plan (build_sampler's, or a second Trainer) numbers the host's GPUs the same way.
    again = placement.apply(placement.plan(cfg, environ=environ), environ)
    assert again == first and environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_dtype_follows_the_device_unless_set():
    assert placement.plan(sampler(), gpus=(), environ={}).dtype == "float32"
    assert placement.plan(sampler(), gpus=("0", "1"), environ={}).dtype == "bfloat16"
    cfg = sampler(vllm_dtype="float32")
    assert placement.plan(cfg, gpus=("0", "1"), environ={}).dtype == "float32"


@pytest.mark.parametrize(
    "kw, gpus, match",
    [
        (dict(vllm_gpus=(2,)), ("0", "1"), r"^sampler.vllm_gpus=\[2\]: GPU 2 does not exist"),
        (dict(vllm_gpus=(0, 1)), ("0", "1"), r"leaves none for the trainer; .*vllm_colocate"),
        (dict(vllm_device="cuda"), (), r"^sampler.vllm_device='cuda': no GPU visible"),
    ],
)
def test_impossible_layouts_fail_in_one_line(kw, gpus, match):
    with pytest.raises(placement.PlacementError, match=match) as e:
        placement.plan(sampler(**kw), gpus=gpus, environ={})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"vllm_num_servers": 0}, "vllm_num_servers=0: must be >= 1"),
        ({"vllm_gpus": [0, 1, 2], "vllm_num_servers": 2}, "do not split into 2 equal"),
        ({"vllm_gpus": [1, 1]}, "expected distinct GPU numbers"),
        ({"vllm_gpus": [0], "vllm_device": "cpu"}, "needs sampler.vllm_device cuda or auto"),
        ({"vllm_gpu_memory_utilization": 1.5}, r"expected a fraction in \(0, 1\]"),
        ({"vllm_colocate": True, "vllm_trainer_memory_fraction": 0.7}, "keep the sum <= 0.95"),
        ({"vllm_device": "tpu"}, "expected one of"),
        ({"vllm_dtype": "float16"}, "expected one of"),
    ],
)
def test_config_refuses_bad_placements(overrides, match):
    with pytest.raises(configlib.ConfigKeyError, match=match) as e:
        configlib.build(config_lib.TrainConfig, {"sampler": {"kind": "vllm", **overrides}})
    assert "\n" not in str(e.value)


def fake_devices(n, platform="gpu"):
    return [types.SimpleNamespace(platform=platform, id=i) for i in range(n)]


def test_jax_holding_every_gpu_is_a_clear_error():
    p = placement.plan(sampler(), gpus=("0", "1"), environ={})
    placement.check_jax_devices(p, fake_devices(1))  # started after apply: sees GPU 0 only
    with pytest.raises(placement.PlacementError) as e:
        placement.check_jax_devices(p, lambda: fake_devices(2))  # started before apply
    msg = str(e.value)
    assert msg.startswith("JAX already started on 2 GPUs, but the trainer should see 1 (GPU 0;")
    assert "vLLM gets GPU 1" in msg and msg.endswith("set CUDA_VISIBLE_DEVICES=0 yourself")
    # A trainer on the CPU (JAX_PLATFORMS=cpu) leaves every GPU to the servers: nothing to check.
    placement.check_jax_devices(p, fake_devices(8, "cpu"))


def test_the_run_places_itself_once_before_jax_starts(monkeypatch, tmp_path):
    """``train.run`` places the process, joins the job and checks JAX's devices once
    (``assembly.start_backend``), before preflight starts JAX and before the mesh is built; the
    Trainer's assembly does not place again."""
    from jaxrlvr import distributed, preflight, train

    calls = []
    monkeypatch.setattr(placement, "place_trainer", lambda s: calls.append("place") or PLAN2)
    monkeypatch.setattr(distributed, "initialize", lambda d: calls.append("distributed"))
    monkeypatch.setattr(placement, "check_jax_devices", lambda p: calls.append(("check", p)))
    monkeypatch.setattr(preflight, "check", lambda cfg, **kw: calls.append("preflight") or cfg)

    def stop(cfg, devices=None):
        calls.append("mesh")
        raise RuntimeError("stop here")

    monkeypatch.setattr(train.assembly.model_lib, "make_mesh", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        train.run(config_lib.TrainConfig(run=config_lib.RunConfig(out_dir=str(tmp_path))))
    assert calls == ["place", "distributed", ("check", PLAN2), "preflight", "mesh"]


PLAN2 = placement.Placement(device="cuda", server_gpus=(("1",),), trainer_gpus=("0",))


def test_serve_vllm_takes_the_same_options(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    parse = lambda argv: vllm_server_args(argv, tmp_path)
    a, b = vllm_server.plan_servers(
        *parse(["--gpus", "4,5,6,7", "--num-servers", "2", "--port", "9000", "--seed", "1"]),
        GPUS8,
    )
    assert a.command() == gpu_command(tmp_path, 9000, ["4", "5"], 0.9)
    assert b.command() == gpu_command(tmp_path, 9001, ["6", "7"], 0.9)
    assert b.environment()["CUDA_VISIBLE_DEVICES"] == "6,7"
    (c,) = vllm_server.plan_servers(*parse(["--port", "9000"]), ())  # no GPU: the CPU command
    assert c.device == "cpu" and "--enforce-eager" in c.command() and c.dtype == "float32"
    with pytest.raises(ValueError, match="GPU 9 does not exist"):
        vllm_server.plan_servers(*parse(["--gpus", "9"]), GPUS8)


def vllm_server_args(argv, model):
    """serve-vllm's parsed flags (its own parser, without starting anything)."""
    captured = {}

    def fake_plan(args, extra, gpus):
        captured["args"] = (args, extra)
        raise SystemExit(0)

    import unittest.mock

    with unittest.mock.patch.object(vllm_server, "plan_servers", fake_plan):
        with pytest.raises(SystemExit):
            vllm_server.serve_vllm_main(["--model", str(model), "--python", "/v/python", *argv])
    return captured["args"]


def test_build_sampler_starts_one_server_per_group_and_exports_bf16(monkeypatch, tmp_path):
    """`jaxrlvr train` on 8 GPUs with two servers: both built with their GPUs, started together,
    handed to one VLLMSampler (round-robin, restart on death), weights exported in bfloat16 to
    tmpfs."""
    import json

    from safetensors import safe_open

    from jaxrlvr import builders
    from jaxrlvr import model as model_lib
    from jaxrlvr.sampling import vllm_sampler

    monkeypatch.setenv(placement.HOST_GPUS_ENV, ",".join(GPUS8))
    started, made = [], {}
    monkeypatch.setattr(vllm_server, "start_servers", lambda servers: started.extend(servers))

    def fake_sampler(cfg, servers, tokenizer, **kw):
        made.update(servers=servers, **kw)
        return "sampler"

    monkeypatch.setattr(vllm_sampler, "VLLMSampler", fake_sampler)
    cfg = configlib.build(
        config_lib.TrainConfig,
        {
            "sampler": {"kind": "vllm", "vllm_device": "cuda", "vllm_num_servers": 2,
                        "vllm_python": "/v/python", "vllm_extra_args": ["--seed", "1"]},
        },
    )  # fmt: skip
    tokenizer = builders.build_tokenizer(cfg.model)
    model = model_lib.init_model(model_lib.ModelConfig.tiny(vocab_size=tokenizer.vocab_size))
    assert builders.build_sampler(cfg.sampler, model, tokenizer, None, str(tmp_path)) == "sampler"
    a, b = made["servers"]
    assert started == [a, b] and made["export_dtype"] == "bfloat16"
    assert made["export_dir"] == a.model_dir == b.model_dir
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert a.model_dir.startswith("/dev/shm/")
    assert (a.gpus, b.gpus) == (("6",), ("7",)) and a.port != b.port
    assert a.command()[-2:] == ["--seed", "1"] and "--enforce-eager" not in a.command()
    assert (a.log_path, b.log_path) == (
        str(tmp_path / "vllm_server.log"),
        str(tmp_path / "vllm_server_1.log"),
    )
    with safe_open(os.path.join(a.model_dir, "model.safetensors"), "np") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"bfloat16"}
    with open(os.path.join(a.model_dir, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
