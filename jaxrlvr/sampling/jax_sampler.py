"""JaxSampler: the embedded rollout engine (batched prefill plus KV-cache decode in one jit).

One `generate` call is one compiled program:

1. The B * n rows (prompt-major: prompt 0's n samples first) are LEFT-padded to a prompt-length
   bucket P with explicit position ids, so every row writes the same cache slot at each step.
2. Prefill of all P slots at once into the model's KV cache (``decoder.init_cache``) of P + G
   slots (G the generation bucket); only the last position goes through the vocabulary projection.
3. A ``lax.while_loop`` of one-token decode steps, each a call of the model itself with the cache
   (the same decoder-layer function as training and prefill, `decoder.CausalLM`). It stops
   as soon as every row has finished (EOS / stop id) or reached ``max_tokens``. Each step writes
   one cache slot; the valid-slot mask never changes because the model's causal mask (by slot
   index) already hides the slots not yet written.
4. Host side: trim each row at its length, decode text, cut at stop strings.

Batch size, prompt length and generation length are rounded up to buckets, and the static
sampling choices (greedy, top-k size, top-p on/off) are part of the jit key, so calls that land
in the same buckets reuse the compiled program (`num_traces` counts traces). With a mesh, rows
are sharded over ('data', 'fsdp') and the cache's kv heads over 'tensor', the parameters keep
their own shardings: the sampler runs on the trainer's mesh.

The thinking budget (Qwen3's early exit) is `base.generate_with_thinking_budget`, the one
implementation that every sampler shares: a first call up to the budget, then one continuation
call for the rows that ran into it, with the early-exit text forced in (logprob 0.0, flagged in
`Completion.forced`).

Logprobs: see `sample_ops` (``logprobs_mode``). By default they refer to the distribution the token
was drawn from (temperature-scaled, top-k/top-p filtered), as vLLM's ``processed_logprobs`` and
the `base` contract; ``logprobs_mode="temperature"`` gives them before top-k/top-p truncation.

Left out: continuous batching (a row that finishes early idles until the batch ends), prefix
sharing between the n samples of one prompt, penalties.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrlvr import compile_cache
from jaxrlvr import model as M
from jaxrlvr.model import sharding
from jaxrlvr.model.buckets import bucket
from jaxrlvr.sampling import base, sample_ops

DEFAULT_PROMPT_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_GEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_PAD_ID = -1  # never equal to a real token: pads the stop-id table


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0):
    """Left-pads prompts to `length`.

    Returns:
      ids [B, length] int32, positions [B, length] int32 (0 at the first real token; pads get 0)
      and valid [B, length] bool.
    """
    b = len(prompts)
    ids = np.full((b, length), pad_id, np.int32)
    valid = np.zeros((b, length), bool)
    pos = np.zeros((b, length), np.int32)
    for i, p in enumerate(prompts):
        n = len(p)
        if n:
            ids[i, length - n :] = p
            valid[i, length - n :] = True
            pos[i, length - n :] = np.arange(n)
    return ids, pos, valid


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Static:
    """Everything that changes the compiled program besides array shapes."""

    gen_len: int  # G: output buffer and cache tail length
    greedy: bool
    top_k: int
    use_top_p: bool
    logprobs_mode: sample_ops.LogprobsMode
    # Rows come in groups of this many copies of one prompt (the n samples of a prompt, rows
    # prompt-major): the prompt is prefilled once per group and its cache copied to the rows.
    group: int = 1
    routes: bool = False  # MoE: record every layer's experts of every token (routing replay)


@dataclasses.dataclass
class _Loop:
    """The decode loop's carry (a pytree via `jax.tree_util.register_dataclass`)."""

    t: jax.Array  # index of the next token to emit
    cache: M.KVCache
    token_b: jax.Array  # last emitted token
    tokens_bg: jax.Array
    logp_bg: jax.Array
    done_b: jax.Array
    length_b: jax.Array
    stopped_b: jax.Array  # finished on a stop id (finish_reason "stop")
    routes_bglk: jax.Array | None = None  # experts of each fed completion token (``routes``)


jax.tree_util.register_dataclass(
    _Loop,
    data_fields=[f.name for f in dataclasses.fields(_Loop)],
    meta_fields=[],
)


def _emit(st: _Loop, logits_bv, key, inputs: dict, s: _Static) -> _Loop:
    """Samples token `st.t` of every row and updates the finish bookkeeping."""
    t = st.t
    token, logp = sample_ops.sample(
        logits_bv,
        jax.random.fold_in(key, t),
        greedy=s.greedy,
        temperature=inputs["temperature"],
        top_k=s.top_k,
        top_p=inputs["top_p"],
        use_top_p=s.use_top_p,
        logprobs_mode=s.logprobs_mode,
    )
    tokens_bg = jax.lax.dynamic_update_slice_in_dim(st.tokens_bg, token[:, None], t, axis=1)
    logp_bg = jax.lax.dynamic_update_slice_in_dim(st.logp_bg, logp[:, None], t, axis=1)
    is_stop = jnp.any(token[:, None] == inputs["stop_ids"][None, :], axis=-1)
    is_stop = is_stop & ~st.done_b
    done = st.done_b | is_stop | (t + 1 >= inputs["max_new"])
    length = jnp.where(done & ~st.done_b, t + 1, st.length_b)
    return dataclasses.replace(
        st,
        t=t + 1,
        token_b=token,
        tokens_bg=tokens_bg,
        logp_bg=logp_bg,
        done_b=done,
        length_b=length,
        stopped_b=st.stopped_b | is_stop,
    )


def generate_arrays(graphdef, params, inputs: dict, *, cfg: M.ModelConfig, mesh, s: _Static):
    """The compiled body: prefill + decode loop on padded arrays.

    Args:
      graphdef, params: the split model (`nnx.split(model, nnx.Param)`).
      inputs: ``prompt_ids``/``prompt_pos`` [B, P] int32, ``prompt_valid`` [B, P] bool,
        ``row_valid`` [B] bool (False for batch padding), ``max_new`` int32 (<= G), ``key``,
        ``temperature``/``top_p`` float32, ``stop_ids`` [Ns] int32 (padded with -1).
      s: the static choices (`_Static`).

    Returns:
      tokens [B, G] int32, logprobs [B, G] float32, lengths [B] int32, stopped [B] bool; with
      ``s.routes`` also the experts of the prompt slots [B, P, L, k] and of the fed completion
      tokens [B, G, L, k] (token j at index j), in ``routes_dtype(cfg)``.
    """
    lm = nnx.merge(graphdef, params)
    ids, pos, pvalid = inputs["prompt_ids"], inputs["prompt_pos"], inputs["prompt_valid"]
    b, p = ids.shape
    g = s.gen_len
    # Slots after the prompt are all valid; causality (slot <= current) hides the unwritten ones.
    valid_bs = jnp.concatenate([pvalid, jnp.ones((b, g), bool)], axis=1)
    record = {"with_router": True} if s.routes else {}
    # Prefill: the prompt fills slots [0, P) of a P + G slot cache; logits of the last position.
    if s.group > 1:
        # One prefill per prompt, not per sample: the group's first row, then its cache and
        # last-position logits repeated to the group's rows (n x less prefill work).
        first = slice(None, None, s.group)
        cache = M.init_cache(cfg, b // s.group, p + g)
        hidden, cache, *router = lm.backbone(
            ids[first], valid_bs[first], pos[first], cache=cache, cache_index=0, **record
        )
        cache = jax.tree.map(lambda x: jnp.repeat(x, s.group, axis=0), cache)
        logits = jnp.repeat(lm.lm_logits(hidden[:, -1:])[:, 0], s.group, axis=0)
    else:
        cache = M.init_cache(cfg, b, p + g)
        hidden, cache, *router = lm.backbone(
            ids, valid_bs, pos, cache=cache, cache_index=0, **record
        )
        logits = lm.lm_logits(hidden[:, -1:])[:, 0]
    prompt_routes = None
    if s.routes:  # [L, B', P, k] -> [B, P, L, k]
        prompt_routes = jnp.repeat(_routes_of(router[0], cfg), s.group, axis=0)
    next_pos = pos[:, -1] + 1  # position of the first generated token

    done0 = ~inputs["row_valid"]
    st = _Loop(
        t=jnp.zeros((), jnp.int32),
        cache=cache,
        token_b=jnp.zeros((b,), jnp.int32),
        tokens_bg=jnp.zeros((b, g), jnp.int32),
        logp_bg=jnp.zeros((b, g), jnp.float32),
        done_b=done0,
        length_b=jnp.zeros((b,), jnp.int32),
        stopped_b=jnp.zeros((b,), bool),
        routes_bglk=None
        if not s.routes
        else jnp.full(
            (b, g, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, routes_dtype(cfg)
        ),
    )
    key = inputs["key"]
    st = _emit(st, logits, key, inputs, s)

    def cond(st: _Loop):
        return (st.t < inputs["max_new"]) & ~jnp.all(st.done_b)

    def body(st: _Loop):
        prev = st.t - 1  # the token being fed sits at slot p + prev
        step_valid = valid_bs
        if cfg.is_moe:  # a finished row's fed token is padding: it skips the experts
            here = jnp.arange(p + g) == p + prev
            step_valid = valid_bs & ~(here[None, :] & st.done_b[:, None])
        hidden, cache, *router = lm.backbone(
            st.token_b[:, None],
            step_valid,
            (next_pos + prev)[:, None],
            cache=st.cache,
            cache_index=p + prev,
            **record,
        )
        logits = lm.lm_logits(hidden)[:, 0]
        st = dataclasses.replace(st, cache=cache)
        if s.routes:  # the fed token (completion token ``prev``)'s experts
            st.routes_bglk = jax.lax.dynamic_update_slice_in_dim(
                st.routes_bglk, _routes_of(router[0], cfg), prev, axis=1
            )
        return _emit(st, logits, key, inputs, s)

    st = jax.lax.while_loop(cond, body, st)
    out = (st.tokens_bg, st.logp_bg, st.length_b, st.stopped_b)
    return out + (prompt_routes, st.routes_bglk) if s.routes else out


def routes_dtype(cfg: M.ModelConfig):
    """The compact dtype of recorded expert ids: int8 when the ids and the -1 fit, else int16."""
    return jnp.int8 if cfg.num_experts <= 127 else jnp.int16


def _routes_of(router, cfg: M.ModelConfig) -> jax.Array:
    """A router output's expert ids [L, B, T, k] as [B, T, L, k] in ``routes_dtype``."""
    return jnp.transpose(router.expert_ids, (1, 2, 0, 3)).astype(routes_dtype(cfg))


_TRACES = [0]


def _traced_generate(params, inputs, *, graphdef, cfg, mesh, s: _Static):
    _TRACES[0] += 1  # runs only while tracing: counts compilations
    return generate_arrays(graphdef, params, inputs, cfg=cfg, mesh=mesh, s=s)


# One jit for all samplers: samplers of the same model config and mesh share compiled programs.
_generate_jit = jax.jit(_traced_generate, static_argnames=("graphdef", "cfg", "mesh", "s"))


def _program_key(inputs: dict, s: _Static) -> tuple:
    """What tells one sampler's generation programs apart: the inputs' shapes and the static
    choices (the weights, graph, config and mesh are the sampler's own)."""
    return s, tuple((k, np.shape(v)) for k, v in sorted(inputs.items()))


def num_traces() -> int:
    """How many times the generation program has been traced (all samplers of this process);
    tests use it to prove that calls in the same buckets do not recompile."""
    return _TRACES[0]


def _held_rows(x: jax.Array) -> tuple[int, int]:
    """[lo, hi): the rows of a batch-sharded global array that this process's devices hold."""
    spans = [(s.index[0].start or 0, s.index[0].stop or x.shape[0]) for s in x.addressable_shards]
    return min(a for a, _ in spans), max(b for _, b in spans)


def _rows_of(x: jax.Array, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of a global array, read from this process's shards (however the array is
    laid out, as long as those rows are addressable here)."""
    out = np.empty((hi - lo, *x.shape[1:]), x.dtype)
    for s in x.addressable_shards:
        start = s.index[0].start or 0
        stop = s.index[0].stop or x.shape[0]
        a, b = max(start, lo), min(stop, hi)
        if a < b:
            out[(slice(a - lo, b - lo), *s.index[1:])] = np.asarray(s.data)[a - start : b - start]
    return out


# Hugging Face fast tokenizers whose ``decode`` is the Rust decoder's call plus, when
# ``clean_up_tokenization_spaces`` is set, a clean-up (transformers 5 and 4).
_PLAIN_DECODE_MODULES = (
    "transformers.tokenization_utils_tokenizers",
    "transformers.tokenization_utils_fast",
)


def backend_decoder(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` where ``tokenizer.decode(ids,
    skip_special_tokens=True)`` is exactly its ``decode`` (a fast tokenizer whose class keeps the
    library's ``_decode`` and cleans no spaces up), else None.

    Why: the sampler decodes every row once and, for a stop string, a few prefixes of each row;
    through the Python wrapper (argument conversion per call) that was 16 ms of host time per
    demo step of 256 rows, 8.7 ms calling the decoder directly (docs/step_profile.md)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    decode = getattr(type(tokenizer), "_decode", None)
    if getattr(decode, "__module__", None) not in _PLAIN_DECODE_MODULES:
        return None
    return backend


class JaxSampler:
    """Embedded sampler on JAX (see the module docstring); implements `base.Sampler`.

    Args:
      model: a `Qwen2ForCausalLM`; its config (compute dtype: forward and cache) and its current
        parameters are taken. Later weights come through `update_weights`.
      tokenizer: a Hugging Face tokenizer or a directory to load one from; needed for text, stop
        strings and the thinking budget (without one, `Completion.text` is empty).
      mesh: the ('data', 'fsdp', 'tensor') mesh to run on; None takes the model's own
        (``model.mesh``; None there too runs on the default device).
      eos_token_ids: ids that end a completion (unless `ignore_eos`); None takes the tokenizer's
        EOS, else the checkpoint config's ``eos_token_id``.
      prompt_buckets, gen_buckets, batch_buckets: the sizes that padded shapes are rounded up to.
      logprobs_mode: "processed" (the distribution sampled from, default) or "temperature"
        (before top-k/top-p); see `sample_ops`.
      record_routes: MoE routing replay: every completion carries the experts of every token
        this sampler computed (``Completion.routes``, recorded in prefill and decode); None
        (default) records them for a MoE model and not for a dense one. Not recorded with a
        thinking budget (its continuation call re-reads the head: those rollouts carry None).
      compute_dtype: the sampler's compute dtype (forward and KV cache) when not the model's:
        e.g. a bfloat16 sampler for a float32 trainer, as GPU RL stacks run, the source of the
        sampler-trainer mismatch that routing replay addresses (docs/experiments).
    """

    def __init__(
        self,
        model: M.Qwen2ForCausalLM,
        tokenizer: Any = None,
        *,
        mesh=None,
        eos_token_ids: Sequence[int] | None = None,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        gen_buckets: Sequence[int] = DEFAULT_GEN_BUCKETS,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        logprobs_mode: sample_ops.LogprobsMode = "processed",
        record_routes: bool | None = None,
        compute_dtype: str | None = None,
    ):
        sample_ops.check_logprobs_mode(logprobs_mode)
        for name, bs in (
            ("prompt_buckets", prompt_buckets),
            ("gen_buckets", gen_buckets),
            ("batch_buckets", batch_buckets),
        ):
            if not bs or not all(isinstance(x, int) and x >= 1 for x in bs):
                raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {bs!r}")
        if not isinstance(model, M.Qwen2ForCausalLM):
            raise TypeError(f"model must be a Qwen2ForCausalLM, got {type(model).__name__}")
        cfg = model.config
        mesh = model.mesh if mesh is None else mesh
        if compute_dtype is not None:
            cfg = dataclasses.replace(cfg, dtype=compute_dtype)
        if record_routes and not cfg.is_moe:
            raise ValueError("record_routes (routing replay) needs a MoE model (qwen3_moe)")
        self.record_routes = cfg.is_moe if record_routes is None else bool(record_routes)
        self.cfg = cfg
        self.mesh = mesh
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        self.gen_buckets = tuple(sorted(gen_buckets))
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.logprobs_mode = logprobs_mode
        if isinstance(tokenizer, str | os.PathLike):
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
            if eos is None and cfg.hf_config is not None:
                eos = cfg.hf_config.get("eos_token_id")
            eos_token_ids = () if eos is None else ([eos] if isinstance(eos, int) else eos)
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        # The graph is rebuilt for this mesh so activation constraints follow the sampler's mesh,
        # whatever mesh the caller's model was created with.
        abstract = nnx.eval_shape(lambda: M.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0), mesh=mesh))
        self._graphdef, abstract_params = nnx.split(abstract, nnx.Param)
        self._treedef = jax.tree.structure(abstract_params)
        self._live: tuple[Any, int | None] | None = None  # (params, version), swapped as one
        # Programs being compiled ahead (``precompile_in_background``), by ``_program_key``: a
        # generation that needs one waits for it rather than compiling it a second time.
        self._compiling: dict[tuple, threading.Event] = {}
        self._ran_ahead: set[tuple] = set()  # the ones a generation has run since
        self._compiling_lock = threading.Lock()
        self._seed_counter = 0
        self.update_weights(nnx.state(model, nnx.Param))

    # ------------------------------------------------------------------------------------------
    # Sampler protocol

    def update_weights(self, weights: Any, *, version: int | None = None) -> dict[str, float]:
        """Swaps in new weights (an `nnx.State` of `nnx.Param`, as `nnx.state(model, nnx.Param)`);
        no copy unless they must move to this sampler's shardings. Returns ``{"update_s": s}``."""
        start = time.perf_counter()
        if jax.tree.structure(weights) != self._treedef:
            raise ValueError(
                "update_weights: weights tree does not match the sampler's model config "
                f"({jax.tree.structure(weights)} vs {self._treedef})"
            )
        if self.mesh is not None:
            weights = jax.device_put(weights, M.param_shardings(weights, self.mesh))
        # One assignment: a generation starting in another thread sees both or neither.
        self._live = (weights, version)
        return {"update_s": time.perf_counter() - start}

    @property
    def version(self) -> int | None:
        """The weight version the next generation runs on (`update_weights`'s ``version``)."""
        return None if self._live is None else self._live[1]

    def close(self) -> None:
        self._live = None

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling_params: base.SamplingParams,
    ) -> list[base.Completion]:
        """`n` completions per prompt, flat and prompt-major (see `base.Sampler`)."""
        if self._live is None:
            raise RuntimeError("JaxSampler is closed")
        return base.generate(
            self._generate_plain,
            prompt_token_ids,
            n,
            sampling_params,
            self._budget_tokenizer,
            budget_segment=lambda *a: self._generate_plain(*a, routes=False),
        )

    def precompile(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling_params: base.SamplingParams,
    ) -> bool:
        """Compiles, without running it, the program that ``generate`` with these arguments
        will run (the same batch, prompt-length and generation buckets and static choices;
        another call that lands in the same buckets runs it too), so that the call starts at
        once. Returns False, compiling nothing, where ``generate`` would not run one plain
        program (a thinking budget), in a multi-process job (every process must compile the
        same programs in the same order) and on a closed sampler."""
        planned = self._lowered(prompt_token_ids, n, sampling_params)
        if planned is None:
            return False
        planned[1].compile()
        return True

    def precompile_in_background(
        self,
        calls: Sequence[tuple[Sequence[Sequence[int]], int, base.SamplingParams]],
        *,
        after: threading.Thread | threading.Event | None = None,
    ) -> threading.Thread | None:
        """``precompile`` of each ``(prompt_token_ids, n, sampling_params)``: the programs are
        traced and lowered here, then XLA compiles them in turn on a daemon thread (returned,
        started; None when there is nothing to compile), once ``after`` is done
        (``compile_cache.wait_for``), while the caller works, e.g. the RL phase's rollout
        program and the evaluation's during the SFT warm start. A ``generate`` that needs a
        program still compiling there waits for it instead of compiling it a second time (so
        ``after`` must not wait for such a ``generate``). A program that fails to compile is
        skipped: ``generate`` meets the same error where it would have without this.

        Tracing and lowering hold the GIL, so they run here and only XLA's compile (which
        releases it) runs on the thread: traced there, they stalled the caller's every step.
        The thread keeps the normal priority: at idle priority it was no faster on the demo,
        and a caller waiting for it on a busy machine could wait for as long as the machine
        stays busy (an unprivileged thread cannot be raised back)."""
        pending = []
        with self._compiling_lock:
            for call in calls:
                planned = self._lowered(*call)
                if planned is not None and planned[0] not in self._compiling:
                    self._compiling[planned[0]] = threading.Event()
                    pending.append(planned)
        if not pending:
            return None

        return compile_cache.compile_in_background(
            [lowered for _, lowered in pending],
            after=after,
            then=lambda i: self._compiling[pending[i][0]].set(),
        )

    def _lowered(self, prompt_token_ids, n: int, sampling_params: base.SamplingParams):
        """(``_program_key``, ``jax.stages.Lowered``) of the one program ``generate`` would run
        for these arguments on the live weights' shapes (jit keeps what it compiles: a call
        with the same shapes runs it); None where ``precompile`` compiles nothing."""
        live = self._live
        if live is None or sampling_params.thinking_budget is not None:
            return None
        if not prompt_token_ids or n < 1 or (self.mesh is not None and jax.process_count() > 1):
            return None
        rows = [list(map(int, p)) for p in prompt_token_ids for _ in range(n)]
        params = dataclasses.replace(sampling_params, seed=0)  # a traced input: any value
        inputs, s = self._program_inputs(
            rows, params, group=n, multi=False, routes=self.record_routes
        )
        lowered = _generate_jit.lower(
            live[0], inputs, graphdef=self._graphdef, cfg=self.cfg, mesh=self.mesh, s=s
        )
        return _program_key(inputs, s), lowered

    def _wait_for_compile(self, key: tuple) -> None:
        """Blocks while ``precompile_in_background`` is compiling the program ``key``."""
        event = self._compiling.get(key)
        if event is not None:
            event.wait()
            self._ran_ahead.add(key)

    def compiled_ahead(self) -> dict[str, int]:
        """``{"programs": compiled by precompile_in_background, "used": how many of them a
        generation has run}``: a run's summary reports whether its guesses were right."""
        return {"programs": len(self._compiling), "used": len(self._ran_ahead)}

    def _budget_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("stop strings and thinking_budget need a tokenizer")
        return self.tokenizer

    # ------------------------------------------------------------------------------------------
    # Internals

    def _generate_plain(
        self,
        prompts: list[list[int]],
        n: int,
        sampling_params: base.SamplingParams,
        *,
        routes: bool = True,
    ) -> list[base.Completion]:
        """`generate` without a thinking budget, on validated prompts."""
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError("stop strings and thinking_budget need a tokenizer")
        rows = [p for p in prompts for _ in range(n)]
        weights, version = self._live  # one snapshot: these weights generate every row
        routes = routes and self.record_routes
        tokens, logps, lengths, stopped, *recorded = self._run(
            weights, rows, sampling_params, group=n, routes=routes
        )
        stops = sampling_params.stop
        out = []
        # Host work per call, not per row: one tolist per array, one batched decode.
        lengths, stopped = lengths[: len(rows)].tolist(), stopped[: len(rows)].tolist()
        all_ids = [row[:k] for row, k in zip(tokens[: len(rows)].tolist(), lengths)]
        all_lp = [row[:k] for row, k in zip(logps[: len(rows)].tolist(), lengths)]
        texts = self._decode_all(all_ids)
        for r in range(len(rows)):
            ids = all_ids[r]
            lp = all_lp[r] if sampling_params.logprobs else []
            reason = "stop" if stopped[r] else "length"
            text = texts[r]
            if stops:
                ids, lp, text, hit = self._cut_at_stop(ids, lp, text, stops)
                reason = "stop" if hit else reason
            row_routes = None
            if routes:  # the row's prompt slots (left-padded) then its fed tokens
                prompt_routes, gen_routes = recorded
                np_ = len(rows[r])
                row_routes = np.concatenate(
                    [prompt_routes[r, prompt_routes.shape[1] - np_ :], gen_routes[r, : len(ids)]]
                )[: np_ + len(ids) - 1]
            out.append(
                base.Completion(
                    prompt_index=r // n,
                    token_ids=ids,
                    logprobs=lp,
                    text=text,
                    finish_reason=reason,
                    weight_version=version,
                    routes=row_routes,
                )
            )
        base.check_prompt_major(out, len(prompts), n)
        return out

    def stand_in(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        completion_token_ids: Sequence[Sequence[int]],
        sampling_params: base.SamplingParams,
    ) -> list[base.Completion]:
        """Completions with the fields ``generate`` gives (log-probs when asked, routes when
        recorded, in their dtype and layout) around given tokens, ``len(completion_token_ids)
        / len(prompt_token_ids)`` per prompt, prompt-major, and no generation: a stand-in of a
        step's rollouts, to compile the trainer's programs for their shapes ahead of time
        (``phases.rl.RLPhase.programs_ahead``). The values mean nothing (log-probs 0, routes
        -1: "live")."""
        n = len(completion_token_ids) // max(len(prompt_token_ids), 1)
        all_ids = [[int(t) for t in ids] for ids in completion_token_ids]
        cfg, out = self.cfg, []
        for r, (ids, text) in enumerate(zip(all_ids, self._decode_all(all_ids))):
            routes = None
            if self.record_routes:
                rows = len(prompt_token_ids[r // n]) + len(ids) - 1
                shape = (rows, cfg.num_hidden_layers, cfg.num_experts_per_tok)
                routes = np.full(shape, -1, routes_dtype(cfg))
            out.append(
                base.Completion(
                    prompt_index=r // n,
                    token_ids=ids,
                    logprobs=[0.0] * len(ids) if sampling_params.logprobs else [],
                    text=text,
                    finish_reason="stop",
                    weight_version=self.version,
                    routes=routes,
                )
            )
        base.check_prompt_major(out, len(prompt_token_ids), n)
        return out

    @property
    def batch_multiple(self) -> int:
        """Rows must split evenly over the mesh's batch axes."""
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape.get(a, 1) for a in sharding.BATCH_AXES)

    def _run(
        self, weights, rows: list[list[int]], params: base.SamplingParams, *, group=1, routes=False
    ):
        """Runs the compiled program on ``rows``; tokens, logprobs, lengths, stopped (NumPy),
        and with ``routes`` the prompt's and the completion's experts (``generate_arrays``).
        ``group``: rows come in groups of that many copies of one prompt (prefilled once)."""
        multi = self.mesh is not None and jax.process_count() > 1
        inputs, s = self._program_inputs(rows, params, group=group, multi=multi, routes=routes)
        self._wait_for_compile(_program_key(inputs, s))
        outs = _generate_jit(
            weights, inputs, graphdef=self._graphdef, cfg=self.cfg, mesh=self.mesh, s=s
        )
        if multi:  # this process's rows of the job's outputs
            lo, hi = _held_rows(inputs["prompt_ids"])
            return tuple(_rows_of(x, lo, hi) for x in outs)
        return jax.device_get(outs)

    def _program_inputs(
        self, rows: list[list[int]], params: base.SamplingParams, *, group, multi, routes
    ) -> tuple[dict, _Static]:
        """The program's placed inputs for ``rows`` (padded to their buckets) and its static
        choices: what ``_run`` runs and ``precompile`` compiles."""
        # Multi-process: ``rows`` are this process's; every process pads its rows to the same
        # bucket and the program runs once over the whole job's rows, each process's rows on its
        # own devices (its block of the batch axes). Random draws follow the global row order, so
        # when every process's rows fill their bucket, the rows sample as in one process that
        # holds them all in process order.
        blocks = self._row_blocks() if multi else 1
        b = bucket(len(rows), self.batch_buckets, multiple_of=self.batch_multiple // blocks)
        p = bucket(max(len(r) for r in rows), self.prompt_buckets)
        g = bucket(params.max_tokens, self.gen_buckets)
        if multi:
            from jax.experimental import multihost_utils

            b, p = (int(x) for x in multihost_utils.process_allgather(np.asarray([b, p])).max(0))
        padded = rows + [rows[0][:1]] * (b - len(rows))
        ids, pos, valid = left_pad(padded, p)
        row_valid = np.arange(b) < len(rows)

        stop = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        stop_ids = np.full(max(8, 1 << max(len(stop) - 1, 0).bit_length()), _PAD_ID, np.int32)
        stop_ids[: len(stop)] = stop
        seed = params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") ^ self._seed_counter
            self._seed_counter += 1
        inputs = dict(
            prompt_ids=ids,
            prompt_pos=pos,
            prompt_valid=valid,
            row_valid=row_valid,
            max_new=np.int32(params.max_tokens),
            key=jax.random.PRNGKey(seed),
            temperature=np.float32(max(params.temperature, 1e-6)),
            top_p=np.float32(params.top_p),
            stop_ids=stop_ids,
        )
        s = _Static(
            gen_len=g,
            greedy=params.greedy,
            top_k=params.top_k if params.top_k < self.cfg.vocab_size else 0,
            use_top_p=params.top_p < 1.0,
            logprobs_mode=self.logprobs_mode,
            # Grouped prefill needs whole groups that still split over the batch shards.
            group=group if group > 1 and b % (group * self.batch_multiple) == 0 else 1,
            routes=routes,
        )
        return self._place(inputs, multi=multi), s

    def _row_blocks(self) -> int:
        """How many distinct row blocks the processes hold (processes that share batch shards
        hold the same rows)."""
        n = self.batch_multiple
        lo, hi = _held_rows(
            jax.make_array_from_callback(
                (n,), M.batch_sharding(self.mesh, 1), lambda idx: np.zeros(n, np.int32)[idx]
            )
        )
        return n // (hi - lo)

    def _place(self, inputs: dict, *, multi: bool = False) -> dict:
        """Puts batch-leading arrays on the mesh's batch axes, the rest replicated. Multi-process
        (``multi``): the batch arrays hold this process's rows, the global array is every
        process's rows in process order (``jax.make_array_from_process_local_data``)."""
        if self.mesh is None:
            return inputs
        replicated = NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        batch_keys = ("prompt_ids", "prompt_pos", "prompt_valid", "row_valid")
        out = {}
        for k, v in inputs.items():
            sh = M.batch_sharding(self.mesh, np.ndim(v)) if k in batch_keys else replicated
            if multi:
                v = np.asarray(v)
                out[k] = jax.make_array_from_process_local_data(sh, v)
            else:
                out[k] = jax.device_put(v, sh)
        return out

    def _backend(self):
        """``backend_decoder(self.tokenizer)``, looked up once per tokenizer."""
        tok = self.tokenizer
        cached = getattr(self, "_backend_of", None)
        if cached is None or cached[0] is not tok:
            cached = self._backend_of = (tok, backend_decoder(tok))
        return cached[1]

    def _decode_all(self, rows: list[list[int]]) -> list[str]:
        """Every row's text: one call into the Rust decoder where the tokenizer allows
        (``backend_decoder``), else one ``batch_decode`` call, else row by row."""
        if self.tokenizer is None:
            return [""] * len(rows)
        backend = self._backend()
        if backend is not None:
            return backend.decode_batch(rows, skip_special_tokens=True)
        batch = getattr(self.tokenizer, "batch_decode", None)
        if batch is None:
            return [self._decode(ids) for ids in rows]
        return batch(rows, skip_special_tokens=True)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        # Special tokens are dropped from the text, as vLLM does by default.
        backend = self._backend()
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _cut_at_stop(self, ids, lp, text, stops):
        """Cuts at the first stop string: text ends before it; tokens end with the token that
        completes it (the shortest prefix whose text contains a stop string)."""
        hits = [(text.find(x), x) for x in stops if x in text]
        if not hits:
            return ids, lp, text, False

        def has_stop(k: int) -> bool:
            t = self._decode(ids[:k])
            return any(x in t for x in stops)

        lo, hi = 1, len(ids)  # has_stop(hi) is True; find the smallest such k
        while lo < hi:
            mid = (lo + hi) // 2
            if has_stop(mid):
                hi = mid
            else:
                lo = mid + 1
        cut_text = self._decode(ids[:lo])
        first = min(cut_text.find(x) for x in stops if x in cut_text)
        return ids[:lo], lp[:lo], cut_text[:first], True
