"""Two-process ``jaxrlvr train`` jobs with real CPU vLLM servers, in both modes of
``builders.build_sampler``, against one reference: 1 process x 8 devices using one server.

- One server group shared by the job (``sampler.vllm_urls``): the server is started here on the
  trainer's initial model; process 0 pushes every step's weights to it (the other waits at a
  barrier) and each process sends its own prompts.
- One server group per host (no ``vllm_urls``): each process starts its own server and pushes the
  gathered weights to it (``distributed.ProcessSyncedSampler(shared=False)``).

3 GRPO steps of 2 processes x 4 fake devices end with the reference's parameters (1e-5) and log
its metrics. Needs the vLLM environment (``JAXRLVR_VLLM_PYTHON``); each server is about 2 GB and
1 core while it starts.
"""

import os

import multihost_runs as mh
import pytest

VLLM_TINY = [
    # head_dim 32: the smallest the CPU attention backend of vLLM supports
    "model.hidden_size=64",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "model.intermediate_size=128",
    "model.num_hidden_layers=1",
    "data.synthetic_train_size=64",
    "data.synthetic_eval_size=16",
    "data.shards=2",
    "sft.steps=0",
    "rl.steps=3",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "rl.packing=false",
    "reward.format_weight=0.5",
    "optim.warmup_steps=0",
    "eval.every=3",
    "eval.max_problems=16",
    "checkpoint.every=3",
    "mesh.data=1",
    "mesh.fsdp=8",
    "reward.num_workers=1",
    "run.progress=false",
    "run.tensorboard=false",
    "sampler.kind=vllm",
]


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One CPU vLLM server on the tiny trainer's initial weights (its architecture and
    tokenizer); yields its URL."""
    python = os.environ.get("JAXRLVR_VLLM_PYTHON")
    if not python:
        if os.environ.get("CI"):
            pytest.fail("JAXRLVR_VLLM_PYTHON is not set in CI: the vLLM environment is missing")
        pytest.skip("JAXRLVR_VLLM_PYTHON not set (scripts/setup_vllm.sh)")
    import jax
    from flax import nnx

    from jaxrlvr import builders
    from jaxrlvr import config as config_lib
    from jaxrlvr import model as model_lib
    from jaxrlvr.sampling import vllm_server, weight_export

    root = tmp_path_factory.mktemp("shared_vllm")
    cfg = config_lib.load_config(str(mh.REPO / "configs/demo.yaml"), VLLM_TINY)
    tok = builders.build_tokenizer(cfg.model)
    mesh = model_lib.make_mesh(model_lib.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    model = builders.build_model(cfg.model, tok, mesh, seed=cfg.run.seed)
    weight_export.export_weights(model.config, nnx.state(model, nnx.Param), root / "model")
    tok.save_pretrained(root / "model")
    server = vllm_server.VLLMServer(
        root / "model", python=python, max_model_len=64, log_path=root / "server.log"
    )
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def reference(shared_server, tmp_path_factory):
    """The 1-process x 8-device run on the shared server: its run dir."""
    single = tmp_path_factory.mktemp("vllm_reference") / "single"
    mh.finish(mh.start(single, f"sampler.vllm_urls=[{shared_server}]", processes=1, args=VLLM_TINY))
    return single


def assert_like_reference(reference, multi):
    step_a, a = mh.final_params(reference)
    step_b, b = mh.final_params(multi)
    assert step_a == step_b == 3
    for k in a:
        # float32 on both sides; reductions in another order: ~1e-7 apart.
        mh.np.testing.assert_allclose(b[k], a[k], atol=1e-5, rtol=0, err_msg=k)
    mh.assert_same_metrics(reference, multi)
    lines = mh.metric_lines(multi)
    assert all(x["grad_norm"] > 0 for x in lines[1:])
    assert lines[1]["grading/n"] == 16  # both processes' rollouts


@pytest.mark.vllm
@pytest.mark.slow
def test_two_processes_share_one_vllm_server_like_one_process(shared_server, reference, tmp_path):
    multi = tmp_path / "multi"
    mh.finish(mh.start(multi, f"sampler.vllm_urls=[{shared_server}]", args=VLLM_TINY))
    assert_like_reference(reference, multi)
    assert not list(multi.glob("vllm_server*.log"))  # no process started a server of its own


@pytest.mark.vllm
@pytest.mark.slow
def test_two_processes_with_a_vllm_server_each_like_one_process(reference, tmp_path):
    multi = tmp_path / "multi"
    per_host = [
        f"sampler.vllm_python={os.environ['JAXRLVR_VLLM_PYTHON']}",
        "sampler.vllm_max_model_len=64",
        "sampler.vllm_device=cpu",
    ]
    outs = mh.finish(mh.start(multi, *per_host, args=VLLM_TINY))
    assert_like_reference(reference, multi)
    # Each process started one server of its own.
    started = [out + err for _, out, err in outs if "starting 1 vLLM server(s)" in out + err]
    assert len(started) == 2, [x[-500:] for x in started]
