"""VLLMSampler against a real CPU vLLM server (marker ``vllm``; one server per session).

The server is started from the tiny model that jaxrlvr's own `save_hf` wrote. Tolerance for
logprob agreement: 1e-4 absolute, float32 on both sides (vLLM float32 matched transformers within
2e-6 here; the rest is summation order over a 512-token vocabulary).
"""

import os
import threading
import time

import httpx
import numpy as np
import pytest

from jaxrlvr.sampling import base, vllm_sampler, vllm_server

pytestmark = pytest.mark.vllm

ATOL = 1e-4
PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [300, 301, 302, 303, 304, 305]]


def _max_gap(served, expected):
    return max(float(np.max(np.abs(np.asarray(c.logprobs) - e))) for c, e in zip(served, expected))


def _prefix_cache_hits(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_exported_model_is_served_with_n_samples_and_matching_logprobs(
    vllm_server, tiny_export, helpers
):
    reference_logprobs = helpers.reference_logprobs
    server, state = vllm_server
    graphdef = tiny_export["graphdef"]
    with vllm_sampler.VLLMSampler(tiny_export["cfg"], server, tiny_export["tokenizer"]) as s:
        params = base.SamplingParams(max_tokens=12, seed=0, ignore_eos=True)
        out = s.generate(PROMPTS, 4, params)
        assert [c.prompt_index for c in out] == [0] * 4 + [1] * 4 + [2] * 4
        for c in out:
            assert len(c.token_ids) == 12 and c.finish_reason == "length"
            assert all(0 <= t < tiny_export["cfg"].vocab_size for t in c.token_ids)
            assert len(c.logprobs) == 12
        # n=4 samples of one prompt are distinct draws, not copies.
        assert len({tuple(c.token_ids) for c in out[:4]}) > 1
        ref = reference_logprobs(graphdef, state["params"], PROMPTS, out)
        assert _max_gap(out, ref) < ATOL

        # processed_logprobs mode: logprobs are those of the tempered, top-k-truncated
        # distribution that was sampled from, not the raw model's.
        warm = base.SamplingParams(max_tokens=8, seed=1, temperature=0.7, top_k=20, ignore_eos=True)
        out = s.generate(PROMPTS, 2, warm)
        ref = reference_logprobs(graphdef, state["params"], PROMPTS, out, temperature=0.7, top_k=20)
        assert _max_gap(out, ref) < ATOL
        raw = reference_logprobs(graphdef, state["params"], PROMPTS, out)
        assert _max_gap(out, raw) > 1e-2


def test_stop_ids_and_max_tokens_are_honoured(vllm_server, tiny_export):
    server, _ = vllm_server
    with vllm_sampler.VLLMSampler(tiny_export["cfg"], server, tiny_export["tokenizer"]) as s:
        free = s.generate(PROMPTS[:1], 4, base.SamplingParams(max_tokens=10, seed=3))
        stop_id = free[0].token_ids[2]
        out = s.generate(
            PROMPTS[:1], 4, base.SamplingParams(max_tokens=10, seed=3, stop_token_ids=(stop_id,))
        )
        # Same seed, same prefix: the first sample now ends at its third token, which is kept.
        assert out[0].token_ids == free[0].token_ids[:3]
        assert out[0].finish_reason == "stop"
        for c in out:
            assert len(c.token_ids) <= 10
            assert c.finish_reason == ("stop" if stop_id in c.token_ids else "length")


def test_update_weights_is_live_and_resets_the_prefix_cache(
    vllm_server, tiny_export, tmp_path, helpers
):
    reference_logprobs, random_params = helpers.reference_logprobs, helpers.random_params
    server, state = vllm_server
    graphdef, cfg = tiny_export["graphdef"], tiny_export["cfg"]
    # Long enough to fill whole KV blocks, so that the prefix cache holds it.
    long_prompt = [int(x) for x in np.random.default_rng(0).integers(5, 500, size=300)]
    prompts = [long_prompt]
    params = base.SamplingParams(max_tokens=6, seed=0, ignore_eos=True)
    with vllm_sampler.VLLMSampler(cfg, server, tiny_export["tokenizer"], export_dir=tmp_path) as s:
        old = s.generate(prompts, 2, params)
        assert _max_gap(old, reference_logprobs(graphdef, state["params"], prompts, old)) < ATOL
        hits = _prefix_cache_hits(server.url)
        s.generate(prompts, 2, params)
        assert _prefix_cache_hits(server.url) > hits, "the prompt should now be in the cache"

        _, new_params = random_params(cfg, seed=7)
        timings = s.update_weights(new_params, version=5)
        state["params"] = new_params
        for key in ("export_s", "pause_s", "reload_s", "reset_s", "resume_s", "total_s"):
            assert timings[key] >= 0.0
        assert timings["total_s"] >= timings["export_s"] + timings["reload_s"]
        assert s.live_versions() == ["5"] and s.version == 5

        new = s.generate(prompts, 2, params)
        # The served logprobs follow the new weights (a stale cached prompt KV would break this)...
        assert _max_gap(new, reference_logprobs(graphdef, new_params, prompts, new)) < ATOL
        # ...and are not the old weights' logprobs of the same tokens.
        assert (
            _max_gap(new, reference_logprobs(graphdef, tiny_export["params"], prompts, new)) > 1e-2
        )

        # Thinking budget on the real server: forced early-exit tokens carry logprob 0 and the
        # sampled ones still match the model.
        think = base.SamplingParams(max_tokens=100, seed=2, ignore_eos=True, thinking_budget=8)
        out = s.generate(PROMPTS[:2], 2, think)
        forced_ids = tiny_export["tokenizer"].encode(
            think.thinking_end_text, add_special_tokens=False
        )
        for c in out:
            assert len(c.token_ids) == 100 and c.forced is not None
            closed = base.thinking_closed(
                base.Completion(
                    prompt_index=0,
                    token_ids=c.token_ids[:8],
                    logprobs=[],
                    text="",
                    finish_reason="length",
                ),
                tiny_export["tokenizer"].encode(base.THINK_CLOSE, add_special_tokens=False),
            )
            if not closed:
                assert c.token_ids[8 : 8 + len(forced_ids)] == forced_ids
                assert c.forced == [False] * 8 + [True] * len(forced_ids) + [False] * (
                    100 - 8 - len(forced_ids)
                )
        ref = reference_logprobs(graphdef, new_params, PROMPTS, out)
        for c, r in zip(out, ref):
            sampled = ~np.asarray(c.forced)
            assert np.all(np.asarray(c.logprobs)[~sampled] == 0.0)
            assert np.max(np.abs(np.asarray(c.logprobs)[sampled] - r[sampled])) < ATOL

        # The next sync overwrites the same file in place. That is only sound if the server kept
        # no mapping of the file after its reload (else the overwrite would reach served weights).
        assert timings["in_place"] == 0.0
        assert not _processes_mapping(server, tmp_path / "model.safetensors")
        _, third = random_params(cfg, seed=8)
        again = s.update_weights(third, version=6)
        state["params"] = third
        assert again["in_place"] == 1.0 and s.live_versions() == ["6"]
        out = s.generate(prompts, 2, params)
        assert _max_gap(out, reference_logprobs(graphdef, third, prompts, out)) < ATOL
        assert _max_gap(out, reference_logprobs(graphdef, new_params, prompts, out)) > 1e-2
        assert not _processes_mapping(server, tmp_path / "model.safetensors")


def _processes_mapping(server, file) -> list[int]:
    """Processes of the server's group (API server, engine, workers) that map `file`."""
    target = os.path.realpath(file)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != server.pid:
                continue
            with open(f"/proc/{pid}/maps") as f:
                if any(line.rstrip().endswith(target) for line in f):
                    found.append(int(pid))
        except (OSError, ProcessLookupError):
            continue
    return found


def _generate_while_killing(sampler, server, prompts, n, params):
    """Runs generate in a thread and SIGKILLs the server once it is busy; returns result/error."""
    result = {}

    def run():
        try:
            result["out"] = sampler.generate(prompts, n, params)
        except Exception as e:  # noqa: BLE001 - handed to the test
            result["err"] = e

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while sampler.requests_in_flight < 1:  # an event: the server holds a request (a deadline)
        assert time.monotonic() < deadline and thread.is_alive(), "no request was ever sent"
        time.sleep(0.001)
    assert thread.is_alive(), "generation finished before the kill; make it longer"
    server.kill()
    thread.join(timeout=600)
    assert not thread.is_alive()
    return result


@pytest.mark.kills_vllm_server
def test_killed_server_is_restarted_on_latest_weights_or_fails_clearly(
    vllm_server, tiny_export, tmp_path, helpers
):
    reference_logprobs, random_params = helpers.reference_logprobs, helpers.random_params
    server, state = vllm_server
    graphdef, cfg = tiny_export["graphdef"], tiny_export["cfg"]
    params = base.SamplingParams(max_tokens=400, seed=0, ignore_eos=True)
    prompts = [[i + 5, i + 6, i + 7] for i in range(8)]
    with vllm_sampler.VLLMSampler(
        cfg, server, tiny_export["tokenizer"], export_dir=tmp_path, backoff_s=0.1
    ) as s:
        _, latest = random_params(cfg, seed=11)
        s.update_weights(latest, version=9)
        state["params"] = latest
        restarts = server.restarts
        result = _generate_while_killing(s, server, prompts, 4, params)
        assert "err" not in result, result.get("err")
        out = result["out"]
        assert server.restarts == restarts + 1
        assert len(out) == 32 and all(len(c.token_ids) == 400 for c in out)
        # Generated by the restarted server, on the latest weights (not the original checkpoint).
        assert _max_gap(out, reference_logprobs(graphdef, latest, prompts, out)) < ATOL
        assert s.live_versions() == ["9"]

    with vllm_sampler.VLLMSampler(
        cfg, server, tiny_export["tokenizer"], restart_dead_servers=False, backoff_s=0.1
    ) as s:
        result = _generate_while_killing(s, server, prompts, 4, params)
        assert "out" not in result
        err = result["err"]
        assert isinstance(err, vllm_sampler.VLLMError)
        assert "died" in str(err) and "restart_dead_servers=False" in str(err)
        assert not server.alive()


def _start_serve_vllm_cli(vllm_python, tiny_export, tmp_path):
    """``jaxrlvr serve-vllm`` in a subprocess, returned once it prints its ready line."""
    import os
    import subprocess
    import sys

    port = vllm_server.pick_free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrlvr.cli", "serve-vllm", "--model", str(tiny_export["dir"])]
        + ["--python", vllm_python, "--port", str(port), "--log", str(tmp_path / "cli.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "JAXRLVR_VLLM_PYTHON"},
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "ready at" in line or proc.poll() is not None:
            break
    if f"ready at http://127.0.0.1:{port}" not in "".join(lines):
        proc.kill()
        pytest.fail("serve-vllm did not become ready:\n" + "".join(lines))
    return proc, port


@pytest.mark.slow
def test_serve_vllm_cli_starts_a_dev_mode_server_and_stops_on_ctrl_c(
    vllm_python, tiny_export, tmp_path
):
    import signal

    proc, port = _start_serve_vllm_cli(vllm_python, tiny_export, tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        # Bound to loopback, in dev mode (the client's construction checks pass), serving the model.
        with vllm_sampler.VLLMSampler(tiny_export["cfg"], url) as s:
            (c,) = s.generate([[5, 6]], 1, base.SamplingParams(max_tokens=3, seed=0))
        assert len(c.token_ids) == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2.0)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_server_stops_when_its_parent_is_sigkilled(vllm_python, tiny_export, tmp_path):
    # A trainer killed with SIGKILL runs no atexit hook; the server must not outlive it (its
    # watchdog process notices the parent is gone and stops the server's process group).
    import signal
    import time

    proc, port = _start_serve_vllm_cli(vllm_python, tiny_export, tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(url + "/health", timeout=5.0).status_code == 200
        session = _session_of_server_on(port)
        assert len(_pids_in_session(session)) >= 2  # the API server and its engine process
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while _pids_in_session(session) and time.monotonic() < deadline:
            time.sleep(1.0)
        left = _pids_in_session(session)
        assert not left, f"vLLM processes {left} outlived their SIGKILLed parent by 60 s"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2.0)
    finally:
        if proc.poll() is None:
            proc.kill()


def _proc_stat(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # fields after the command name
    except OSError:
        return None


def _pids_in_session(session: int) -> list[int]:
    """Live (non-zombie) processes of a session, from /proc."""
    import os

    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _proc_stat(pid)
        if stat is not None and stat[0] != "Z" and int(stat[3]) == session:
            out.append(int(pid))
    return out


def _session_of_server_on(port: int) -> int:
    """The session id of the vLLM API server started with ``--port port`` (its own session)."""
    import os

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and str(port).encode() in argv:
            return int(_proc_stat(pid)[3])
    raise AssertionError(f"no vLLM API server process found for port {port}")
