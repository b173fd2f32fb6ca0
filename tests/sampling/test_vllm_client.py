"""VLLMSampler's HTTP client without vLLM: request mapping, response parsing, ordering, retries
and error messages.

A small stub speaking the parts of vLLM's HTTP API that the client uses stands in for the server
here; the real server is exercised in test_vllm.py.
"""

import http.server
import json
import random
import threading
import time

import numpy as np
import pytest

from jaxrlvr.sampling import base, vllm_sampler, vllm_server


class _Stub:
    """An HTTP server answering /v1/models, /is_paused and /v1/completions.

    Completions echo the prompt: sample j of prompt [p0, ...] is tokens [p0, j], with logprobs
    [-p0, -j]; choices come back in shuffled order. `fail_first` requests get HTTP 503;
    `delay(prompt)` seconds pass before answering.
    """

    def __init__(self, *, dev_mode=True, fail_first=0, status=200, delay=lambda prompt: 0.0):
        self.requests = []
        self.fail_first = fail_first
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "stub-model"}]})
                elif self.path == "/is_paused" and dev_mode:
                    self._send(200, {"is_paused": False})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                stub.requests.append(body)
                if stub.fail_first > 0:
                    stub.fail_first -= 1
                    self._send(503, {"error": "engine busy"})
                    return
                if status != 200:
                    self._send(status, {"error": "bad request"})
                    return
                time.sleep(delay(body["prompt"]))
                p0 = body["prompt"][0]
                choices = [
                    {
                        "index": j,
                        "text": f"{p0}-{j}",
                        "token_ids": [p0, j],
                        "logprobs": {"token_logprobs": [-float(p0), -float(j)]},
                        "finish_reason": "length",
                    }
                    for j in range(body["n"])
                ]
                random.Random(p0).shuffle(choices)
                self._send(200, {"choices": choices})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stubs():
    made = []

    def make(**kw):
        s = _Stub(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_completion_request_maps_every_sampling_param():
    p = base.SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        max_tokens=33,
        stop_token_ids=(7, 8),
        stop=("</answer>",),
        ignore_eos=True,
    )
    body = vllm_sampler.completion_request("m", [1, 2, 3], 4, p, seed=11)
    assert body == {
        "model": "m",
        "prompt": [1, 2, 3],
        "n": 4,
        "max_tokens": 33,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "stop_token_ids": [7, 8],
        "stop": ["</answer>"],
        "ignore_eos": True,
        "return_token_ids": True,
        "add_special_tokens": False,
        "logprobs": 0,
        "seed": 11,
    }
    no_lp = vllm_sampler.completion_request("m", [1], 1, base.SamplingParams(logprobs=False), None)
    assert "logprobs" not in no_lp and "seed" not in no_lp


def _choice(i, ids, reason="length", lp=None):
    return {
        "index": i,
        "text": "t",
        "token_ids": ids,
        "logprobs": {"token_logprobs": lp if lp is not None else [-1.0] * len(ids)},
        "finish_reason": reason,
    }


def test_parse_response_orders_choices_and_keeps_float32_logprobs():
    body = {"choices": [_choice(2, [9], lp=[-0.1]), _choice(0, [7], "stop"), _choice(1, [8])]}
    out = vllm_sampler.parse_completion_response(body, prompt_index=3, n=3, want_logprobs=True)
    assert [c.token_ids for c in out] == [[7], [8], [9]]
    assert [c.prompt_index for c in out] == [3, 3, 3]
    assert [c.finish_reason for c in out] == ["stop", "length", "length"]
    assert out[2].logprobs == [float(np.float32(-0.1))]


@pytest.mark.parametrize(
    ("choices", "error", "match"),
    [
        ([_choice(0, [1], "abort")], vllm_sampler._Retryable, "aborted"),
        ([_choice(0, [1], "tool_calls")], vllm_sampler.VLLMError, "finish_reason"),
        ([{**_choice(0, [1]), "token_ids": None}], vllm_sampler.VLLMError, "token_ids"),
        ([_choice(0, [1, 2], lp=[-1.0])], vllm_sampler.VLLMError, "1 logprobs for 2 tokens"),
        ([_choice(1, [1])], vllm_sampler.VLLMError, "n=1"),
    ],
)
def test_parse_response_rejects_bad_responses(choices, error, match):
    with pytest.raises(error, match=match):
        vllm_sampler.parse_completion_response({"choices": choices}, 0, 1, True)


def test_unreachable_url_gives_a_clear_error():
    url = f"http://127.0.0.1:{vllm_server.pick_free_port()}"
    with pytest.raises(vllm_sampler.VLLMError, match="cannot reach vLLM server at " + url) as e:
        vllm_sampler.VLLMSampler(None, url)
    assert "serve-vllm" in str(e.value) and "\n" not in str(e.value)


def test_server_without_dev_mode_is_refused(stubs):
    stub = stubs(dev_mode=False)
    with pytest.raises(vllm_sampler.VLLMError, match="not in dev mode.*VLLM_SERVER_DEV_MODE=1"):
        vllm_sampler.VLLMSampler(None, stub.url)


def test_bad_options_are_refused_at_construction(stubs):
    url = stubs().url
    with pytest.raises(ValueError, match="weight_transfer='udp'.*'disk', 'nccl'"):
        vllm_sampler.VLLMSampler(None, url, weight_transfer="udp")
    with pytest.raises(NotImplementedError, match="nccl"):
        vllm_sampler.VLLMSampler(None, url, weight_transfer="nccl")
    with pytest.raises(ValueError, match="at least one"):
        vllm_sampler.VLLMSampler(None, [])


def test_results_are_prompt_major_and_spread_round_robin(stubs):
    # Earlier prompts answer later, so completion order is the reverse of prompt order.
    a = stubs(delay=lambda p: 0.05 * (10 - p[0]))
    b = stubs(delay=lambda p: 0.05 * (10 - p[0]))
    with vllm_sampler.VLLMSampler(None, [a.url, b.url]) as s:
        assert s.model_names == ["stub-model", "stub-model"]
        out = s.generate([[p] for p in range(6)], 3, base.SamplingParams(seed=100))
    assert [(c.prompt_index, c.token_ids) for c in out] == [
        (p, [p, j]) for p in range(6) for j in range(3)
    ]
    assert [c.logprobs for c in out[3:6]] == [[-1.0, -float(j)] for j in range(3)]
    assert len(a.requests) == len(b.requests) == 3
    # Each prompt gets its own seed, so that a seeded batch does not reuse one random stream.
    assert sorted(r["seed"] for r in a.requests + b.requests) == list(range(100, 106))


def test_failed_requests_are_retried_with_backoff(stubs):
    stub = stubs(fail_first=2)
    with vllm_sampler.VLLMSampler(None, stub.url, max_retries=2, backoff_s=0.01) as s:
        out = s.generate([[4]], 2, base.SamplingParams())
    assert [c.token_ids for c in out] == [[4, 0], [4, 1]]
    assert len(stub.requests) == 3


def test_retries_run_out_with_a_clear_error_and_no_partial_batch(stubs):
    stub = stubs(fail_first=100)
    with vllm_sampler.VLLMSampler(None, stub.url, max_retries=1, backoff_s=0.01) as s:
        with pytest.raises(vllm_sampler.VLLMError, match="failed after 2 attempts.*503"):
            s.generate([[1], [2]], 1, base.SamplingParams())


def test_rejected_request_is_not_retried(stubs):
    stub = stubs(status=400)
    with vllm_sampler.VLLMSampler(None, stub.url, max_retries=3, backoff_s=0.01) as s:
        with pytest.raises(vllm_sampler.VLLMError, match="rejected.*HTTP 400"):
            s.generate([[1]], 1, base.SamplingParams())
    assert len(stub.requests) == 1


def test_server_that_dies_at_start_up_raises_with_its_log_tail(tmp_path):
    import sys

    # This interpreter has no vLLM, so the api_server process exits at once.
    with pytest.raises(RuntimeError, match="exited with code 1 during start-up") as e:
        vllm_server.VLLMServer(
            tmp_path, python=sys.executable, log_path=tmp_path / "log", startup_timeout_s=60
        )
    assert "No module named 'vllm'" in str(e.value)


def test_server_command_has_the_flags_weight_sync_needs(tmp_path):
    s = vllm_server.VLLMServer(tmp_path, python="/x/python", port=1234, start=False)
    cmd = s.command()
    assert cmd[:3] == ["/x/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::1], cmd[4::1]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "1234"
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--dtype"] == "float32"
    assert "--enforce-eager" in cmd
    env = s.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert "XLA_FLAGS" not in env
    assert s.url == "http://127.0.0.1:1234" and not s.alive()


def test_update_weights_exports_in_place_while_holding_every_servers_lock(
    stubs, tmp_path, monkeypatch
):
    # The in-place export is only safe if no restart (which runs under a target's lock and reads
    # the export directory) can run meanwhile: every target's lock is held during the export.
    seen = {}

    class Stop(Exception):
        pass

    def fake_export(cfg, weights, directory, **kw):
        # Private on purpose: the per-server locks are the invariant under test.
        seen["locked"] = [t.lock.locked() for t in sampler._targets]
        seen["kw"] = kw
        raise Stop

    monkeypatch.setattr(vllm_sampler.weight_export, "export_weights", fake_export)
    a, b = stubs(), stubs()
    sampler = vllm_sampler.VLLMSampler(None, [a.url, b.url], export_dir=tmp_path)
    try:
        with pytest.raises(Stop):
            sampler.update_weights({})
        assert seen["locked"] == [True, True] and seen["kw"]["in_place"] is True
        assert [t.lock.locked() for t in sampler._targets] == [False, False]  # released
    finally:
        sampler.close()


def test_root_cause_is_the_first_exception_line():
    """The line a crashed server's log is quoted by: the first ERROR-level (or unprefixed)
    exception line of the log, without vLLM's prefix; warnings that mention an error and the
    wrappers that point back at the root cause are passed over. Lines shaped like the CPU
    build's log of a head_dim 16 model."""
    from jaxrlvr.sampling import vllm_server

    log = "\n".join(
        [
            "=== jaxrlvr: starting python -m vllm.entrypoints.openai.api_server ...",
            "(APIServer pid=1) WARNING 12-02 07:02:48 [system_utils.py:255] Found ulimit of "
            "20000 ... errors like `OSError: [Errno 24] Too many open files`.",
            "(Worker pid=3) ERROR 12-02 07:03:07 [multiproc_executor.py:1063] Traceback (most "
            "recent call last):",
            "(Worker pid=3) ERROR 12-02 07:03:07 [multiproc_executor.py:1063] RuntimeError: "
            "Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0",
            "(EngineCore pid=2) ERROR 12-02 07:03:07 [core.py:1512] RuntimeError: Worker failed "
            "with error 'x', please check the stack trace above for the root cause",
            "(APIServer pid=1) ERROR 12-02 07:03:07 [async_llm.py:906] vllm.v1.engine.exceptions."
            "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the "
            "root cause.",
        ]
    )
    assert vllm_server.root_cause(log) == (
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
    )
    # A start-up crash prints a plain Python traceback; only wrappers: nothing to quote.
    plain = "Traceback (most recent call last):\n  File 'x.py'\nValueError: max_model_len 9 > 4\n"
    assert vllm_server.root_cause(plain) == "ValueError: max_model_len 9 > 4"
    assert vllm_server.root_cause(log.splitlines()[-1]) is None
    assert vllm_server.root_cause("INFO all good\n") is None
