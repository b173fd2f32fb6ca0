"""Asynchronous rollouts against a real CPU vLLM server (marker ``vllm``; the session's server).

- A request in flight when new weights are pushed finishes on the OLD weights (stamped with the
  old version, its log-probs those of the old weights), is neither dropped nor repeated (the
  server finished it once), and the update waited for it; a request sent afterwards runs on the
  new weights.
- The training loop with ``rl.max_staleness=1`` and the vLLM sampler: every batch's version lag,
  read from the versions stamped on its completions, is exactly what the schedule allows; the
  off-policy diagnostics split vLLM's engine gap (~0 in float32) from the staleness gap.

Tolerance for log-prob agreement: 1e-4, float32 on both sides (as tests/sampling/test_vllm.py).
"""

import json
import threading
import time

import httpx
import numpy as np
import pytest
import runs

from jaxrlvr.sampling import base, vllm_sampler

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ATOL = 1e-4
PROMPT = [5, 17, 42, 99]


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _max_gap(served, expected):
    return max(float(np.max(np.abs(np.asarray(c.logprobs) - e))) for c, e in zip(served, expected))


def test_inflight_request_finishes_on_old_weights_later_ones_on_new(
    vllm_server, tiny_export, tmp_path, helpers
):
    server, state = vllm_server
    cfg, graphdef = tiny_export["cfg"], tiny_export["graphdef"]
    ref = helpers.reference_logprobs
    old_params = state["params"]
    _, new_params = helpers.random_params(cfg, seed=11)
    with vllm_sampler.VLLMSampler(cfg, server, tiny_export["tokenizer"], export_dir=tmp_path) as s:
        s.update_weights(old_params, version=1)
        done_before = _metric(server.url, "vllm:request_success_total")
        long = base.SamplingParams(max_tokens=400, seed=0, ignore_eos=True)
        result = {}
        thread = threading.Thread(target=lambda: result.update(out=s.generate([PROMPT], 8, long)))
        thread.start()
        deadline = time.time() + 60
        while s.requests_in_flight < 1:  # the request is on its way to the server
            assert time.time() < deadline and thread.is_alive(), "the request was never sent"
            time.sleep(0.001)
        timings = s.update_weights(new_params, version=2)
        state["params"] = new_params
        thread.join()
        after = s.generate([PROMPT], 2, base.SamplingParams(max_tokens=20, seed=1, ignore_eos=True))
        done = _metric(server.url, "vllm:request_success_total") - done_before

    inflight = result["out"]
    assert [len(c.token_ids) for c in inflight] == [400] * 8
    assert {c.weight_version for c in inflight} == {1}
    assert _max_gap(inflight, ref(graphdef, old_params, [PROMPT], inflight)) < ATOL
    assert _max_gap(inflight, ref(graphdef, new_params, [PROMPT], inflight)) > 1e-2
    assert timings["wait_inflight_s"] >= 0.0  # the time the update waited for it
    assert {c.weight_version for c in after} == {2}
    assert _max_gap(after, ref(graphdef, new_params, [PROMPT], after)) < ATOL
    # The in-flight request and the later one each finished exactly once (vLLM counts each of
    # the n samples of a request as one finished request: 8 + 2).
    assert done == 8 + 2


def test_k1_loop_with_the_vllm_server_lags_exactly_one_version(vllm_server, tiny_export, tmp_path):
    """``jaxrlvr train`` (its own process, one CPU device) on the session's server
    (``sampler.vllm_urls``), starting from the served model's weights."""
    server, state = vllm_server
    run_dir = tmp_path / "run"
    cmd = [
        "train",
        "configs/demo.yaml",
        f"run.out_dir={run_dir}",
        f"model.path={tiny_export['dir']}",
        "sampler.kind=vllm",
        f"sampler.vllm_urls=[{server.url}]",
        "sampler.max_tokens=8",
        "data.synthetic_train_size=64",
        "data.synthetic_eval_size=8",
        "sft.steps=0",
        "rl.steps=3",
        "rl.prompts_per_step=2",
        "rl.group_size=4",
        "rl.max_staleness=1",
        "eval.max_problems=0",
        "eval.at_start=false",
        "checkpoint.every=3",
        "reward.num_workers=1",
        "run.progress=false",
        "run.tensorboard=false",
        "optim.learning_rate=3e-2",
        "optim.warmup_steps=0",
    ]
    try:
        proc = runs.jaxrlvr(*cmd, check=False)
        # The version the run left live on the server: after its 3 updates, version 3.
        live = httpx.get(server.url + "/weight_info").json().get("weight_version")
    finally:
        # Whatever happened, put the session's server back on the exported model's weights.
        with vllm_sampler.VLLMSampler(tiny_export["cfg"], server, tiny_export["tokenizer"]) as s:
            s.update_weights(tiny_export["params"], version=0)
        state["params"] = tiny_export["params"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["async/rollout_version"] for x in lines] == [0, 0, 1]
    assert [x["async/staleness"] for x in lines] == [0, 1, 1]
    for x in lines:
        assert "sync/wait_inflight_s" in x and "time/wait_rollouts_s" in x
        # The off-policy diagnostics split by source (docs/corrections.md): vLLM's float32
        # log-probs against the trainer's under the same (kept) version differ by ~5e-7, so the
        # engine KL is ~0 (k3 ~ d^2 / 2); the staleness gap is the one-version lag.
        assert x["offpolicy/behaviour_exact"] == 1.0
        assert abs(x["offpolicy/engine/k1"]) < 1e-4 and x["offpolicy/engine/k3"] < 1e-6, x
    assert lines[0]["offpolicy/staleness/k3"] == 0.0  # step 0: version 0 trains version 0's batch
    for prev, x in zip(lines, lines[1:]):
        # The batch of step t came from version t - 1: a gap exactly when step t - 1 moved the
        # weights (a tiny random model may draw groups of equal rewards: zero gradient).
        assert (x["offpolicy/staleness/k3"] > 0) == (prev["grad_norm"] > 0), (prev, x)
    assert live == "3"
