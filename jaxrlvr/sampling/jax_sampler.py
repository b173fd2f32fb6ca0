"""JaxSampler: the embedded rollout engine (batched prefill plus KV-cache decode in one jit).

One `generate` call is one compiled program:

1. The B * n rows (prompt-major: prompt 0's n samples first) are LEFT-padded to a prompt-length
   bucket P with explicit position ids, so every row writes the same cache slot at each step.
2. Prefill of all P slots at once; only the last position goes through the vocabulary projection.
3. A ``lax.while_loop`` of one-token decode steps over a KV cache of P + G slots (G the
   generation bucket). It stops as soon as every row has finished (EOS / stop id) or reached
   ``max_tokens``. Each step writes one cache slot; the valid-slot mask never changes because the
   model's causal mask (by slot index) already hides the slots not yet written.
4. Host side: trim each row at its length, decode text, cut at stop strings.

Batch size, prompt length and generation length are rounded up to buckets, and the static
sampling choices (greedy, top-k size, top-p on/off, thinking budget on/off) are part of the jit
key, so calls that land in the same buckets reuse the compiled program (`num_traces` counts
traces). With a mesh, rows are sharded over ('data', 'fsdp') and the cache's kv heads over
'tensor', the parameters keep their own shardings: the sampler runs on the trainer's mesh.

The thinking budget (Qwen3's early exit) runs inside the loop: at step `thinking_budget`, rows
that have not produced the token ids of ``</think>`` get the ids of `thinking_end_text` forced
one per step (logprob 0.0, flagged in `Completion.forced`). Closure is detected on token ids (the
tokenizer's encoding of ``</think>``), not on detokenised text.

Logprobs: see `sample_ops` (``logprobs_mode``). By default they refer to the distribution the token
was drawn from (temperature-scaled, top-k/top-p filtered), as vLLM's ``processed_logprobs`` and
the `base` contract; ``logprobs_mode="temperature"`` gives them before top-k/top-p truncation.

Left out: continuous batching (a row that finishes early idles until the batch ends), prefix
sharing between the n samples of one prompt, penalties.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxrlvr import model as M
from jaxrlvr.model import qwen2, sharding
from jaxrlvr.sampling import base, sample_ops

DEFAULT_PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024)
DEFAULT_GEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_PAD_ID = -1  # never equal to a real token: pads the stop-id table


def bucket(value: int, buckets: Sequence[int], *, multiple_of: int = 1) -> int:
    """Smallest bucket >= value (rounded up to `multiple_of`); past the largest bucket, the next
    multiple of the largest bucket, so that any size works with a bounded number of programs."""
    for b in sorted(buckets):
        b = -(-b // multiple_of) * multiple_of
        if b >= value:
            return b
    top = max(buckets)
    top = -(-top // multiple_of) * multiple_of
    return -(-value // top) * top


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
    thinking: bool


@dataclasses.dataclass
class _Loop:
    """The decode loop's carry (a pytree via `jax.tree_util.register_dataclass`)."""

    t: jax.Array  # index of the next token to emit
    ks: tuple  # per layer, keys [B, K, H, S]
    vs: tuple  # per layer, values [B, K, S, H]
    token_b: jax.Array  # last emitted token
    tokens_bg: jax.Array
    logp_bg: jax.Array
    done_b: jax.Array
    length_b: jax.Array
    stopped_b: jax.Array  # finished on a stop id (finish_reason "stop")
    forcing_b: jax.Array  # thinking budget ran out without </think>: forced text follows
    closed_b: jax.Array  # </think> seen


jax.tree_util.register_dataclass(
    _Loop,
    data_fields=[f.name for f in dataclasses.fields(_Loop)],
    meta_fields=[],
)


def _emit(st: _Loop, logits_bv, key, inputs: dict, s: _Static) -> _Loop:
    """Samples (or forces) token `st.t` of every row and updates the finish bookkeeping."""
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
    forcing, closed = st.forcing_b, st.closed_b
    in_force = jnp.zeros_like(st.done_b)
    if s.thinking:
        forced_ids, close_ids, budget = inputs["forced_ids"], inputs["close_ids"], inputs["budget"]
        forcing = jnp.where(t == budget, ~closed & ~st.done_b, forcing)
        f = t - budget
        in_force = forcing & (f >= 0) & (f < forced_ids.shape[0])
        forced_tok = forced_ids[jnp.clip(f, 0, forced_ids.shape[0] - 1)]
        token = jnp.where(in_force, forced_tok, token)
        logp = jnp.where(in_force, 0.0, logp)
    tokens_bg = jax.lax.dynamic_update_slice_in_dim(st.tokens_bg, token[:, None], t, axis=1)
    logp_bg = jax.lax.dynamic_update_slice_in_dim(st.logp_bg, logp[:, None], t, axis=1)
    if s.thinking:
        c = close_ids.shape[0]
        window = jax.lax.dynamic_slice_in_dim(tokens_bg, jnp.maximum(t - c + 1, 0), c, axis=1)
        closed = closed | ((t >= c - 1) & jnp.all(window == close_ids[None, :], axis=-1))
    is_stop = jnp.any(token[:, None] == inputs["stop_ids"][None, :], axis=-1)
    is_stop = is_stop & ~in_force & ~st.done_b
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
        forcing_b=forcing,
        closed_b=closed,
    )


def _cache_specs(shape_k, shape_v, mesh):
    """Shardings of one layer's decode cache: k [B, K, H, S], v [B, K, S, H]."""
    k_axes = ("batch", "kv_heads", "head_dim", "seq")
    v_axes = ("batch", "kv_heads", "seq", "head_dim")
    return (
        NamedSharding(mesh, M.logical_to_pspec(k_axes, shape_k, mesh)),
        NamedSharding(mesh, M.logical_to_pspec(v_axes, shape_v, mesh)),
    )


def _rms(x, weight, eps, dtype):
    """The model's RMSNorm (float32 statistics, weight applied in the compute dtype)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x32.astype(dtype)


def _proj(p, spec, y, dtype):
    out = jnp.einsum(spec, y, p["kernel"].astype(dtype))
    return out if "bias" not in p else out + p["bias"].astype(dtype)


def decode_layer(cfg: M.ModelConfig, p, x_bd, cos, sin, attend_bs, k_bkhs, v_bksh, slot, mesh):
    """One decoder layer for one new token per row, reading and writing a decode cache.

    The math is the model's (`qwen2._decoder_layer`); only the attention differs in form. With
    one query per row, attention is a matrix-vector product per (row, kv head), which XLA's CPU
    backend runs far faster as a fused multiply-reduce than as ~B*K tiny batched matmuls, and the
    cache layouts k [B, K, H, S] / v [B, K, S, H] keep the contiguous axis the one that is NOT
    reduced in each product, so both reductions vectorise.

    Args:
      p: one layer's parameters (pure dict, unstacked).
      x_bd: [B, D] hidden states; cos/sin [B, 1, H] rotary tables of the new positions.
      attend_bs: [B, S] bool, slots this token attends to (its own slot included).
      k_bkhs, v_bksh: this layer's cache; the new key/value are written at `slot`.
    """
    dtype = cfg.compute_dtype
    a, m = p["self_attn"], p["mlp"]
    b, kh, hd = x_bd.shape[0], cfg.num_key_value_heads, cfg.head_dim
    h = _rms(x_bd, p["input_layernorm"]["weight"], cfg.rms_norm_eps, dtype)
    q = qwen2.apply_rotary(_proj(a["q_proj"], "BD,DNH->BNH", h, dtype)[:, None], cos, sin)[:, 0]
    k = qwen2.apply_rotary(_proj(a["k_proj"], "BD,DKH->BKH", h, dtype)[:, None], cos, sin)[:, 0]
    v = _proj(a["v_proj"], "BD,DKH->BKH", h, dtype)
    k_bkhs = jax.lax.dynamic_update_slice_in_dim(
        k_bkhs, k[..., None].astype(k_bkhs.dtype), slot, axis=3
    )
    v_bksh = jax.lax.dynamic_update_slice_in_dim(
        v_bksh, v[:, :, None].astype(v_bksh.dtype), slot, axis=2
    )
    q = q.reshape(b, kh, cfg.num_groups, hd).astype(jnp.float32)
    # scores [B, K, G, S] = sum_H q * k, reducing over the middle axis of k [B, K, H, S].
    scores = jnp.sum(q[..., None] * k_bkhs[:, :, None].astype(jnp.float32), axis=3)
    scores = scores * (hd**-0.5)
    scores = jnp.where(attend_bs[:, None, None, :], scores, qwen2._MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    # out [B, K, G, H] = sum_S probs * v, reducing over the middle axis of v [B, K, S, H].
    out = jnp.sum(probs[..., None] * v_bksh[:, :, None].astype(jnp.float32), axis=3)
    out = out.reshape(b, cfg.num_attention_heads, hd).astype(dtype)
    x_bd = x_bd + jnp.einsum("BNH,NHD->BD", out, a["o_proj"]["kernel"].astype(dtype))
    x_bd = sharding.constrain(x_bd, ("batch", "embed"), mesh)
    h = _rms(x_bd, p["post_attention_layernorm"]["weight"], cfg.rms_norm_eps, dtype)
    gate = jnp.einsum("BD,DF->BF", h, m["gate_proj"]["kernel"].astype(dtype))
    up = jnp.einsum("BD,DF->BF", h, m["up_proj"]["kernel"].astype(dtype))
    act = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "mlp"), mesh)
    x_bd = x_bd + jnp.einsum("BF,FD->BD", act, m["down_proj"]["kernel"].astype(dtype))
    x_bd = sharding.constrain(x_bd, ("batch", "embed"), mesh)
    return x_bd, k_bkhs, v_bksh


def decode_step(cfg, mesh, p, layers, token_b, pos_b, slot, attend_bs, ks, vs):
    """Logits [B, V] float32 of the next token after `token_b` (at positions `pos_b`, written
    at cache `slot`), and the updated per-layer caches."""
    dtype = cfg.compute_dtype
    x = jnp.take(p["model"]["embed_tokens"]["embedding"], token_b, axis=0).astype(dtype)
    x = sharding.constrain(x, ("batch", "embed"), mesh)
    cos, sin = qwen2.rotary_tables(pos_b[:, None], cfg.head_dim, cfg.rope_theta)
    new_ks, new_vs = [], []
    for layer, k, v in zip(layers, ks, vs):
        x, k, v = decode_layer(cfg, layer, x, cos, sin, attend_bs, k, v, slot, mesh)
        new_ks.append(k)
        new_vs.append(v)
    x = _rms(x, p["model"]["norm"]["weight"], cfg.rms_norm_eps, dtype)
    if cfg.tie_word_embeddings:
        w = p["model"]["embed_tokens"]["embedding"].astype(dtype)
        logits = jnp.einsum("BD,VD->BV", x, w, preferred_element_type=jnp.float32)
    else:
        w = p["lm_head"]["kernel"].astype(dtype)
        logits = jnp.einsum("BD,DV->BV", x, w, preferred_element_type=jnp.float32)
    logits = sharding.constrain(logits.astype(jnp.float32), ("batch", "vocab"), mesh)
    return logits, tuple(new_ks), tuple(new_vs)


def generate_arrays(graphdef, params, inputs: dict, *, cfg: M.ModelConfig, mesh, s: _Static):
    """The compiled body: prefill + decode loop on padded arrays.

    Args:
      graphdef, params: the split model (`nnx.split(model, nnx.Param)`).
      inputs: ``prompt_ids``/``prompt_pos`` [B, P] int32, ``prompt_valid`` [B, P] bool,
        ``row_valid`` [B] bool (False for batch padding), ``max_new`` int32 (<= G), ``key``,
        ``temperature``/``top_p`` float32, ``stop_ids`` [Ns] int32 (padded with -1); with a
        thinking budget also ``budget`` int32, ``forced_ids`` [F] and ``close_ids`` [C] int32.
      s: the static choices (`_Static`).

    Returns:
      tokens [B, G] int32, logprobs [B, G] float32, lengths [B] int32, stopped [B] bool,
      forcing [B] bool (whether the row got the forced thinking-end text from step ``budget``).
    """
    lm = nnx.merge(graphdef, params)
    ids, pos, pvalid = inputs["prompt_ids"], inputs["prompt_pos"], inputs["prompt_valid"]
    b, p = ids.shape
    g = s.gen_len
    total = p + g
    # Prefill with the model itself (its own [L, B, P, K, H] cache), logits of the last position.
    cache = M.init_cache(cfg, b, p)
    hidden, cache = lm.backbone(ids, pvalid, pos, cache=cache, cache_index=0)
    logits = lm.lm_logits(hidden[:, -1:])[:, 0]

    # Decode caches, one per layer, in the layouts `decode_layer` reads fastest.
    pad = ((0, 0), (0, 0), (0, 0), (0, g))
    ks = tuple(jnp.pad(cache.k[i].transpose(0, 2, 3, 1), pad) for i in range(cfg.num_hidden_layers))
    vs = tuple(
        jnp.pad(cache.v[i].transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, g), (0, 0)))
        for i in range(cfg.num_hidden_layers)
    )
    if mesh is not None:
        k_spec, v_spec = _cache_specs(ks[0].shape, vs[0].shape, mesh)
        ks = tuple(jax.lax.with_sharding_constraint(k, k_spec) for k in ks)
        vs = tuple(jax.lax.with_sharding_constraint(v, v_spec) for v in vs)
    pure = nnx.to_pure_dict(params)
    # Per-layer parameter slices, taken once outside the loop.
    layers = [
        jax.tree.map(lambda w, i=i: w[i], pure["model"]["layers"])
        for i in range(cfg.num_hidden_layers)
    ]
    # Slots after the prompt are all valid; causality (slot <= current) hides the unwritten ones.
    valid_bs = jnp.concatenate([pvalid, jnp.ones((b, g), bool)], axis=1)
    slots = jnp.arange(total)
    next_pos = pos[:, -1] + 1  # position of the first generated token

    done0 = ~inputs["row_valid"]
    st = _Loop(
        t=jnp.zeros((), jnp.int32),
        ks=ks,
        vs=vs,
        token_b=jnp.zeros((b,), jnp.int32),
        tokens_bg=jnp.zeros((b, g), jnp.int32),
        logp_bg=jnp.zeros((b, g), jnp.float32),
        done_b=done0,
        length_b=jnp.zeros((b,), jnp.int32),
        stopped_b=jnp.zeros((b,), bool),
        forcing_b=jnp.zeros((b,), bool),
        closed_b=jnp.zeros((b,), bool),
    )
    key = inputs["key"]
    st = _emit(st, logits, key, inputs, s)

    def cond(st: _Loop):
        return (st.t < inputs["max_new"]) & ~jnp.all(st.done_b)

    def body(st: _Loop):
        prev = st.t - 1  # the token being fed sits at slot p + prev
        slot = p + prev
        attend = valid_bs & (slots <= slot)[None, :]
        logits, ks, vs = decode_step(
            cfg, mesh, pure, layers, st.token_b, next_pos + prev, slot, attend, st.ks, st.vs
        )
        return _emit(dataclasses.replace(st, ks=ks, vs=vs), logits, key, inputs, s)

    st = jax.lax.while_loop(cond, body, st)
    return st.tokens_bg, st.logp_bg, st.length_b, st.stopped_b, st.forcing_b


_TRACES = [0]


def _traced_generate(params, inputs, *, graphdef, cfg, mesh, s: _Static):
    _TRACES[0] += 1  # runs only while tracing: counts compilations
    return generate_arrays(graphdef, params, inputs, cfg=cfg, mesh=mesh, s=s)


# One jit for all samplers: samplers of the same model config and mesh share compiled programs.
_generate_jit = jax.jit(_traced_generate, static_argnames=("graphdef", "cfg", "mesh", "s"))


def num_traces() -> int:
    """How many times the generation program has been traced (all samplers of this process);
    tests use it to prove that calls in the same buckets do not recompile."""
    return _TRACES[0]


class JaxSampler:
    """Embedded sampler on JAX (see the module docstring); implements `base.Sampler`.

    Args:
      cfg: the model config (its compute dtype is used for the forward and the cache).
      params_or_model: a `Qwen2ForCausalLM` or its parameters (`nnx.split(model, nnx.Param)[1]`).
      tokenizer: a Hugging Face tokenizer or a directory to load one from; needed for text, stop
        strings and the thinking budget (without one, `Completion.text` is empty).
      mesh: the trainer's ('data', 'fsdp', 'tensor') mesh; None runs on the default device.
      eos_token_ids: ids that end a completion (unless `ignore_eos`); None takes the tokenizer's
        EOS, else the checkpoint config's ``eos_token_id``.
      prompt_buckets, gen_buckets, batch_buckets: the sizes that padded shapes are rounded up to.
      logprobs_mode: "processed" (the distribution sampled from, default) or "temperature"
        (before top-k/top-p); see `sample_ops`.
    """

    def __init__(
        self,
        cfg: M.ModelConfig,
        params_or_model: Any,
        tokenizer: Any = None,
        *,
        mesh=None,
        eos_token_ids: Sequence[int] | None = None,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        gen_buckets: Sequence[int] = DEFAULT_GEN_BUCKETS,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        logprobs_mode: sample_ops.LogprobsMode = "processed",
    ):
        sample_ops.check_logprobs_mode(logprobs_mode)
        for name, bs in (
            ("prompt_buckets", prompt_buckets),
            ("gen_buckets", gen_buckets),
            ("batch_buckets", batch_buckets),
        ):
            if not bs or not all(isinstance(x, int) and x >= 1 for x in bs):
                raise ValueError(f"{name} must be a non-empty sequence of ints >= 1, got {bs!r}")
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
        self._params = None
        self.version: int | None = None
        self._seed_counter = 0
        self.update_weights(params_or_model)

    # ------------------------------------------------------------------------------------------
    # Sampler protocol

    def update_weights(self, params: Any, *, version: int | None = None) -> dict[str, float]:
        """Swaps in new parameters (an `nnx.State` of `nnx.Param`, or a model); no copy unless
        they must move to this sampler's shardings. Returns ``{"update_s": seconds}``."""
        start = time.perf_counter()
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        if jax.tree.structure(params) != self._treedef:
            raise ValueError(
                "update_weights: parameter tree does not match the sampler's model config "
                f"({jax.tree.structure(params)} vs {self._treedef})"
            )
        if self.mesh is not None:
            params = jax.device_put(params, M.param_shardings(params, self.mesh))
        self._params = params
        self.version = version
        return {"update_s": time.perf_counter() - start}

    def close(self) -> None:
        self._params = None

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, params: base.SamplingParams
    ) -> list[base.Completion]:
        """`n` completions per prompt, flat and prompt-major (see `base.Sampler`)."""
        if self._params is None:
            raise RuntimeError("JaxSampler is closed")
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        if not prompts:
            return []
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if (params.stop or params.thinking_budget is not None) and self.tokenizer is None:
            raise ValueError("stop strings and thinking_budget need a tokenizer")
        rows = [p for p in prompts for _ in range(n)]
        tokens, logps, lengths, stopped, forcing, budget, num_forced = self._run(rows, params)

        out = []
        for r in range(len(rows)):
            length = int(lengths[r])
            ids = tokens[r, :length].tolist()
            lp = logps[r, :length].tolist() if params.logprobs else []
            forced = None
            if forcing[r] and length > budget:
                forced = [budget <= i < budget + num_forced for i in range(length)]
            reason = "stop" if stopped[r] else "length"
            text = self._decode(ids)
            if params.stop:
                ids, lp, forced, text, hit = self._cut_at_stop(ids, lp, forced, text, params.stop)
                reason = "stop" if hit else reason
            out.append(
                base.Completion(
                    prompt_index=r // n,
                    token_ids=ids,
                    logprobs=lp,
                    text=text,
                    finish_reason=reason,
                    forced=forced,
                )
            )
        base.check_prompt_major(out, len(prompts), n)
        return out

    # ------------------------------------------------------------------------------------------
    # Internals

    @property
    def batch_multiple(self) -> int:
        """Rows must split evenly over the mesh's batch axes."""
        if self.mesh is None:
            return 1
        return int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])

    def _run(self, rows: list[list[int]], params: base.SamplingParams):
        b = bucket(len(rows), self.batch_buckets, multiple_of=self.batch_multiple)
        p = bucket(max(len(r) for r in rows), self.prompt_buckets)
        g = bucket(params.max_tokens, self.gen_buckets)
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
        thinking = params.thinking_budget is not None
        budget, num_forced = -1, 0
        if thinking:
            forced_ids = self.tokenizer.encode(params.thinking_end_text, add_special_tokens=False)
            close_ids = self.tokenizer.encode(base.THINK_CLOSE, add_special_tokens=False)
            budget, num_forced = params.thinking_budget, len(forced_ids)
            inputs.update(
                budget=np.int32(budget),
                forced_ids=np.asarray(forced_ids, np.int32),
                close_ids=np.asarray(close_ids, np.int32),
            )
        s = _Static(
            gen_len=g,
            greedy=params.greedy,
            top_k=params.top_k if params.top_k < self.cfg.vocab_size else 0,
            use_top_p=params.top_p < 1.0,
            logprobs_mode=self.logprobs_mode,
            thinking=thinking,
        )
        inputs = self._place(inputs)
        outs = _generate_jit(
            self._params, inputs, graphdef=self._graphdef, cfg=self.cfg, mesh=self.mesh, s=s
        )
        outs = jax.device_get(outs)
        return (*outs, budget, num_forced)

    def _place(self, inputs: dict) -> dict:
        """Puts batch-leading arrays on the mesh's batch axes, the rest replicated."""
        if self.mesh is None:
            return inputs
        replicated = NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        batch_keys = ("prompt_ids", "prompt_pos", "prompt_valid", "row_valid")
        return {
            k: jax.device_put(
                v, M.batch_sharding(self.mesh, np.ndim(v)) if k in batch_keys else replicated
            )
            for k, v in inputs.items()
        }

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        # Special tokens are dropped from the text, as vLLM does by default.
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _cut_at_stop(self, ids, lp, forced, text, stops):
        """Cuts at the first stop string: text ends before it; tokens end with the token that
        completes it (the shortest prefix whose text contains a stop string)."""
        hits = [(text.find(x), x) for x in stops if x in text]
        if not hits:
            return ids, lp, forced, text, False

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
        forced = forced[:lo] if forced is not None else None
        return ids[:lo], lp[:lo], forced, cut_text[:first], True
