"""A vLLM server killed during a weight reload: the sampler restarts it on the new weights (or,
with restarts off, fails in one line). Real CPU vLLM server (marker ``vllm``)."""

import numpy as np
import pytest

from jaxrlvr.sampling import base, vllm_sampler

pytestmark = [pytest.mark.vllm, pytest.mark.kills_vllm_server]

ATOL = 1e-4


def _kill_on_reload(sampler, server):
    """Kills the server at the moment the reload request is sent (deterministic timing).

    Wraps the sampler's private ``_post`` on purpose: the one place that sees the reload
    request leave, which no public hook exposes."""
    post = sampler._post
    killed = []

    def wrapped(t, path, **kw):
        if path == "/collective_rpc" and not killed:
            killed.append(server.pid)
            server.kill()
        return post(t, path, **kw)

    sampler._post = wrapped
    return killed


def test_server_killed_during_reload_restarts_on_the_new_weights(
    vllm_server, tiny_export, tmp_path, helpers
):
    server, state = vllm_server
    cfg, graphdef = tiny_export["cfg"], tiny_export["graphdef"]
    prompts = [[5, 6, 7], [8, 9]]
    params = base.SamplingParams(max_tokens=8, seed=0)
    with vllm_sampler.VLLMSampler(
        cfg, server, tiny_export["tokenizer"], export_dir=tmp_path, backoff_s=0.1
    ) as s:
        _, new = helpers.random_params(cfg, seed=23)
        restarts = server.restarts
        killed = _kill_on_reload(s, server)
        s.update_weights(new, version=5)
        state["params"] = new
        assert len(killed) == 1 and server.restarts == restarts + 1 and server.alive()
        assert server.pid != killed[0]
        assert s.live_versions() == ["5"]
        out = s.generate(prompts, 2, params)
        expected = helpers.reference_logprobs(graphdef, new, prompts, out)
        gap = max(float(np.max(np.abs(np.asarray(c.logprobs) - e))) for c, e in zip(out, expected))
        assert gap < ATOL  # served from the new weights, not the ones before the reload


def test_server_killed_during_reload_without_restarts_fails_in_one_line(
    vllm_server, tiny_export, tmp_path, helpers
):
    server, state = vllm_server
    cfg = tiny_export["cfg"]
    with vllm_sampler.VLLMSampler(
        cfg, server, tiny_export["tokenizer"], export_dir=tmp_path, restart_dead_servers=False
    ) as s:
        _, new = helpers.random_params(cfg, seed=29)
        _kill_on_reload(s, server)
        with pytest.raises(vllm_sampler.VLLMError) as err:
            s.update_weights(new, version=6)
        msg = str(err.value)
        assert "\n" not in msg
        assert msg == (
            f"vLLM server at {server.url} died during a weight reload (exit code "
            f"{server.returncode()}) and restart_dead_servers=False"
        )
        assert not server.alive()
    # The fixture restarts the server for later tests on its model_dir: the first test's export,
    # which state["params"] already records.
