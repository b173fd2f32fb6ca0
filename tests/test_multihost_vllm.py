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

import multihost_runs as mh
import pytest
import runs

VLLM_TINY = [
    *mh.TINY,
    # head_dim 32 (TINY's is 16): the smallest the CPU attention backend of vLLM supports
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "checkpoint.every=3",
    "sampler.kind=vllm",
]


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One CPU vLLM server on the tiny trainer's initial weights (its architecture and
    tokenizer); yields its URL."""
    python = runs.vllm_python()
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
def per_host_job(tmp_path_factory):
    """The two-process job with a vLLM server each, started in the background before the shared
    server (it needs none of this module's other runs): (run dir, its processes)."""
    python = runs.vllm_python()
    multi = tmp_path_factory.mktemp("vllm_per_host") / "multi"
    per_host = [
        f"sampler.vllm_python={python}",
        "sampler.vllm_max_model_len=64",
        "sampler.vllm_device=cpu",
    ]
    procs = mh.start(multi, *per_host, args=VLLM_TINY)
    yield multi, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.fixture(scope="module")
def reference(per_host_job, shared_server, tmp_path_factory):
    """The 1-process x 8-device run on the shared server: its run dir."""
    single = tmp_path_factory.mktemp("vllm_reference") / "single"
    mh.finish(mh.start(single, f"sampler.vllm_urls=[{shared_server}]", processes=1, args=VLLM_TINY))
    return single


def assert_like_reference(reference, multi):
    _, lines = mh.assert_like_single(reference, multi)
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
def test_two_processes_with_a_vllm_server_each_like_one_process(reference, per_host_job):
    multi, procs = per_host_job
    outs = mh.finish(procs)
    assert_like_reference(reference, multi)
    # Each process started one server of its own.
    started = [out + err for _, out, err in outs if "starting 1 vLLM server(s)" in out + err]
    assert len(started) == 2, [x[-500:] for x in started]
