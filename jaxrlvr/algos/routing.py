"""MoE routing replay (R3, R2) and the sampler-vs-trainer routing diagnostics.

Why (arXiv 2510.11370; ../shared FIELD notes): a MoE sampler and trainer pick experts
independently, and float-level differences flip top-k choices that then compound over layers, so
the trainer's log-probs are those of a different network than the one that sampled. Replay
forces the trainer's forward onto the experts the rollout used.

- ``Batch.routes`` [B, T, L, k] (``ROUTES``, a ``batch.register_field`` of this module) holds, per
  input token and MoE layer, the experts to use (-1: the live top-k). ``to_model`` turns it into the
  decoder's ``routes`` [L, B, T, k]; ``engine.token_logprobs`` and ``engine.make_logprob_fn`` pass
  it on, so every update's training forward and the old policy's ``prepare`` pass replay it. The
  reference's pass does not by default (``reference_batch``, ``rl.reference_routes``): the KL
  penalty compares with the reference as it routes itself, as slime runs it (replay "fallthrough"
  for the reference and the distillation teacher) and verl except under LoRA, where the reference is
  the policy's own base without the adapters and the routes are replayed (the "auto" default does
  the same). A distillation teacher is another model: its passes never replay. Only the selection is
  replayed: the gate weights come from the live float32 router softmax at the chosen experts
  (``model.moe.select_experts``), so the router keeps its gradient.
- Modes (``ReplayMode``, the driver's ``rl.routing_replay``): ``"none"`` (routes are dropped
  before the update; they still feed the diagnostics), ``"r3"`` (rollout routing replay: the
  sampler's recorded routes), ``"r2"`` (the trainer's own routes of the batch under the
  parameters before the step, fixed across the step's epochs and microbatches; ``trainer_routes``).
- Diagnostics (``disagreement``): the share of (token, layer) top-k sets where the sampler's
  experts differ from the trainer's live ones, the share of tokens that differ in any layer, per
  layer too. Without replay they come from the update's own forward at no extra cost
  (``add_disagreement`` on ``Batch.sampler_routes``: counts summed over microbatches, ``shares``
  on the host); ``route_metrics`` runs two extra forwards for them and the k3 estimate of
  KL(sampler || trainer) with and without replay.
- Checks (``check_routes``, ``check_layers``): forced routes are refused in one line before any
  compute; ``layout`` accepts routes over only the MoE layers of a mixed layout. vLLM returns
  every decoder layer ([tokens, num_hidden_layers, k] from its ``RoutedExpertsCapturer``,
  ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``, zeros where a layer has no
  router); the JaxSampler records every layer with -1 on the dense ones.

Left out: the vLLM side (``sampling.vllm_sampler`` parses the server's routes where it can
return them) and the shapes of the routes on the host (``rollout.pack``).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import kl

ReplayMode = Literal["none", "r3", "r2"]
# The reference log-prob pass's routes (``reference_batch``): "auto" replays only under LoRA.
ReferenceRoutes = Literal["auto", "replay", "live"]
# The diagnostics' cost (``passes.routing_replay``): from the update's own forward, plus two
# extra forwards for the k3 gap, or none.
MetricsMode = Literal["basic", "full", "off"]

# The batch fields (``batch.register_field``): the experts to force, -1 where unknown, and the
# sampler's own experts, not replayed, compared with the update's forward (``add_disagreement``).
# Both are read beside the model's forward, so every update accepts them.
ROUTES = batch_lib.register_field("routes", "btlk", "route", model=True)
SAMPLER_ROUTES = batch_lib.register_field("sampler_routes", "btlk", "route", model=True)


def check_mode(mode: str, key: str = "rl.routing_replay", choices: Any = ReplayMode) -> None:
    """Refuse ``mode`` unless it is one of the Literal ``choices`` (one line naming ``key``)."""
    if mode not in get_args(choices):
        raise ValueError(f"{key}={mode!r}: expected one of {', '.join(get_args(choices))}")


def replays_reference(mode: str, lora: bool) -> bool:
    """Whether the reference's log-prob pass replays the batch's routes under
    ``rl.reference_routes`` = ``mode``: "replay" always, "live" never, "auto" only when the
    policy has LoRA adapters (``lora``; the reference is then the same base network, verl's
    rule)."""
    check_mode(mode, "rl.reference_routes", ReferenceRoutes)
    return mode == "replay" or (mode == "auto" and lora)


def reference_batch(batch: batch_lib.Batch, mode: str, *, lora: bool) -> batch_lib.Batch:
    """The batch the reference's log-prob pass runs on: ``batch`` itself when it replays
    (``replays_reference``), else without ``routes`` (the reference's own top-k experts)."""
    return batch if replays_reference(mode, lora) else batch.replace(routes=None)


class RouteError(ValueError):
    """Forced routes the model cannot replay: one line naming the field, the value and where."""


def check_layers(shape: tuple, sparse_layers: tuple[bool, ...], k: int, field: str) -> None:
    """Refuse routes [..., L, k] whose layer axis is neither every decoder layer nor every MoE
    layer of a model whose layers are ``sparse_layers``, or whose last axis is not its top-k
    ``k`` (shapes only: also at trace time)."""
    if len(shape) < 2:
        raise RouteError(f"{field}: expected [..., L, k] routes, got shape {tuple(shape)}")
    n, layer_axis = len(sparse_layers), len(shape) - 2
    moe = sum(sparse_layers)
    if shape[-2] not in (n, moe):
        raise RouteError(
            f"{field}: layer axis (axis {layer_axis}) of size {shape[-2]} is neither every "
            f"decoder layer ({n}) nor every MoE layer ({moe})"
        )
    if shape[-1] != k:
        raise RouteError(
            f"{field}: top-k axis (axis {layer_axis + 1}) of size {shape[-1]}, but the model "
            f"routes each token to num_experts_per_tok={k} experts"
        )


def check_routes(
    routes: Any, *, num_experts: int, sparse_layers: tuple[bool, ...], k: int, field: str
) -> None:
    """Host check of forced routes [..., L, k] (``Batch.routes`` [B, T, L, k] or one
    ``Completion.routes`` [N, L, k]) before any compute: the layer axis (``check_layers``), and
    on the MoE layers' rows (the dense layers' rows of an every-layer layout are ignored by the
    model: the JaxSampler writes -1 there, vLLM 0) every id in [-1, num_experts) and no id
    twice in one token's set. Raises ``RouteError`` naming ``field``, the value and its index."""
    r = np.asarray(routes)
    check_layers(r.shape, sparse_layers, k, field)
    if r.shape[-2] == len(sparse_layers):  # every decoder layer: only the MoE rows are read
        r = r[..., np.asarray(sparse_layers, bool), :]
        rows = np.flatnonzero(sparse_layers)
    else:
        rows = np.arange(r.shape[-2])
    r = r.astype(np.int64)

    def where(index) -> str:
        index = tuple(int(i) for i in index)
        return f"[{', '.join(map(str, index[:-2] + (int(rows[index[-2]]), index[-1])))}]"

    bad = np.argwhere((r < -1) | (r >= num_experts))
    if bad.size:
        value = r[tuple(bad[0])]
        raise RouteError(
            f"{field}{where(bad[0])} = {value}: expert ids must be in [-1, {num_experts})"
        )
    order = np.sort(r, axis=-1)
    repeat = np.argwhere((order[..., 1:] == order[..., :-1]) & (order[..., 1:] >= 0))
    if repeat.size:
        token = tuple(repeat[0][:-1])
        value = order[token + (repeat[0][-1],)]
        slots = np.flatnonzero(r[token] == value)
        raise RouteError(
            f"{field}{where(token + (slots[1],))} = {value}: expert {value} is chosen twice "
            f"for one token (slots {slots[0]} and {slots[1]}); a token's k experts are distinct"
        )


def layout(routes: Any, sparse_layers: tuple[bool, ...]) -> Any:
    """Routes [..., L, k] over every decoder layer: routes over only the MoE layers get -1
    rows (unread) at the dense layers; routes over every layer come back as they are. NumPy in,
    NumPy out; JAX in (also traced), JAX out."""
    n, moe = len(sparse_layers), sum(sparse_layers)
    if routes.shape[-2] == n or moe == n:
        return routes
    xp = np if isinstance(routes, np.ndarray) else jnp
    pad = xp.full(routes.shape[:-2] + (1, routes.shape[-1]), -1, routes.dtype)
    source = np.cumsum(sparse_layers) - 1  # decoder layer i <- MoE row source[i]
    index = np.where(np.asarray(sparse_layers, bool), source, moe)
    return xp.take(xp.concatenate([routes, pad], axis=-2), index, axis=-2)


def to_model(routes_btlk: jax.Array | None, config: Any = None) -> jax.Array | None:
    """``Batch.routes`` [B, T, L, k] as the decoder's ``routes`` [L, B, T, k] int32 (or None).
    With the model's ``config``: the layer axis checked and laid out over every decoder layer
    (``check_layers``, ``layout``), and, when the routes are concrete (not traced), their ids
    too (``check_routes``), so a bad route fails here in one line rather than as NaN logits."""
    if routes_btlk is None:
        return None
    if config is not None:
        if not config.is_moe:
            raise RouteError(
                f"Batch.routes: routing replay needs a MoE model, not model_type "
                f"{config.model_type!r}"
            )
        sparse, k = config.sparse_layers, config.num_experts_per_tok
        check_layers(tuple(routes_btlk.shape), sparse, k, "Batch.routes")
        if not isinstance(routes_btlk, jax.core.Tracer):
            check_routes(
                routes_btlk,
                num_experts=config.num_experts,
                sparse_layers=sparse,
                k=k,
                field="Batch.routes",
            )
        routes_btlk = layout(routes_btlk, sparse)
    return jnp.transpose(routes_btlk, (2, 0, 1, 3)).astype(jnp.int32)


def _same_set(a_nk: jax.Array, b_nk: jax.Array) -> jax.Array:
    """Whether two rows of k expert ids hold the same set (order ignored): [..., k] -> [...]."""
    return jnp.all(jnp.sort(a_nk, axis=-1) == jnp.sort(b_nk, axis=-1), axis=-1)


def disagreement_sums(
    sampler_btlk: jax.Array,
    live_btlk: jax.Array,
    valid_bt: jax.Array,
    layers: tuple[int, ...] | None = None,
) -> dict[str, jax.Array]:
    """The counts behind ``disagreement`` (sums add over microbatches; ``shares`` divides):
    ``routing/_n`` valid tokens that carry routes (no -1), ``routing/_valid`` valid tokens,
    ``routing/_token_differ`` tokens whose set differs in at least one layer, and per compared
    layer ``routing/layer{i}/_differ``. ``layers``: the sparse layers to compare (None: all)."""
    names = range(sampler_btlk.shape[-2]) if layers is None else layers
    if layers is not None:
        index = jnp.asarray(layers, jnp.int32)
        sampler_btlk, live_btlk = sampler_btlk[..., index, :], live_btlk[..., index, :]
    known = jnp.all(sampler_btlk >= 0, axis=(-1, -2))
    valid = valid_bt.astype(bool)
    use = (valid & known).astype(jnp.float32)
    differ = (~_same_set(sampler_btlk.astype(jnp.int32), live_btlk.astype(jnp.int32))).astype(
        jnp.float32
    )  # [B, T, L]
    per_layer = jnp.sum(differ * use[..., None], axis=(0, 1))
    out = {
        "routing/_n": jnp.sum(use),
        "routing/_valid": jnp.sum(valid.astype(jnp.float32)),
        "routing/_token_differ": jnp.sum(jnp.max(differ, axis=-1) * use),
    }
    for row, i in enumerate(names):
        out[f"routing/layer{i}/_differ"] = per_layer[row]
    return out


def shares(metrics: dict) -> dict:
    """``metrics`` with ``disagreement_sums``' counts replaced by the shares ``disagreement``
    reports (other keys kept); without them, ``metrics`` as it is."""
    if "routing/_n" not in metrics:
        return metrics
    out = {k: v for k, v in metrics.items() if "/_" not in k}
    n = max(float(metrics["routing/_n"]), 1.0)
    layers = [k for k in metrics if k.endswith("/_differ")]
    for k in layers:
        out[k.replace("/_differ", "/disagree")] = float(metrics[k]) / n
    out["routing/disagree"] = sum(float(metrics[k]) for k in layers) / n / max(len(layers), 1)
    out["routing/token_disagree"] = float(metrics["routing/_token_differ"]) / n
    out["routing/covered"] = float(metrics["routing/_n"]) / max(
        float(metrics["routing/_valid"]), 1.0
    )
    return out


def disagreement(
    sampler_btlk: jax.Array,
    live_btlk: jax.Array,
    valid_bt: jax.Array,
    layers: tuple[int, ...] | None = None,
) -> dict[str, float]:
    """Routing disagreement between recorded and live experts over the valid tokens that carry
    routes (no -1): ``routing/disagree`` (share of (token, layer) top-k sets that differ),
    ``routing/token_disagree`` (share of tokens that differ in at least one layer),
    ``routing/layer{i}/disagree``, and ``routing/covered`` (share of valid tokens with routes).
    ``layers``: the sparse layers to compare (``ModelConfig.sparse_layers``; None: all); the
    dense layers of a mixed Qwen3-MoE carry no experts (-1 from the JaxSampler, 0 from vLLM).
    Host floats (``shares`` of ``disagreement_sums``)."""
    sums = disagreement_sums(sampler_btlk, live_btlk, valid_bt, layers)
    return shares(jax.device_get(sums))


def add_disagreement(out, routers: list, rows: Any):
    """``(loss, metrics)`` of one microbatch of an update plus ``disagreement_sums`` of the
    sampler's routes (``Batch.sampler_routes`` in ``rows``, the microbatch) against the experts
    the microbatch's own forward chose (the first collected router, ``moe.collect_routers``):
    ``rl.routing_metrics: basic`` at no extra forward. ``out`` unchanged without either."""
    batches = [
        x
        for x in jax.tree.leaves(rows, is_leaf=lambda x: isinstance(x, batch_lib.Batch))
        if isinstance(x, batch_lib.Batch)
    ]
    if not routers or not batches or batches[0].sampler_routes is None:
        return out
    cfg, router = routers[0]
    b = batches[0]
    sampler = layout(b.sampler_routes, cfg.sparse_layers)
    live = jnp.transpose(router.expert_ids, (1, 2, 0, 3))
    layers = tuple(i for i, sparse in enumerate(cfg.sparse_layers) if sparse)
    loss, metrics = out
    return loss, {**metrics, **disagreement_sums(sampler, live, b.attention_mask, layers)}


def _k3(sampler_logp, trainer_logp, mask):
    """Mean k3 estimate of KL(sampler || trainer) over ``mask``: r - 1 - log r with r =
    pi_trainer / pi_sampler (Schulman's k3; expm1 and a clamp at 0 for float32 mismatch)."""
    d = trainer_logp - sampler_logp
    k3 = kl.k3(d)
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(m > 0, k3, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def _forward(lm, batch: batch_lib.Batch, routes):
    hidden, _, router = batch_lib.run_backbone(lm, batch, routes=routes, with_router=True)
    logits = lm.lm_logits(hidden)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch.labels[..., None], -1)[..., 0]
    return logp, jnp.transpose(router.expert_ids, (1, 2, 0, 3))


def trainer_routes(graphdef: nnx.GraphDef, params: Any, batch: batch_lib.Batch) -> jax.Array:
    """R2: the trainer's own live routes of ``batch`` [B, T, L, k] int32 under ``params``
    (un-jitted; jit it)."""
    lm = nnx.merge(graphdef, params)
    return _forward(lm, batch.replace(routes=None), None)[1]


def route_metrics(graphdef: nnx.GraphDef, params: Any, batch: batch_lib.Batch) -> dict:
    """Routing diagnostics of a batch that carries the sampler's routes and log-probs
    (``disagreement_sums``, for ``shares``, and ``routing/k3_live`` / ``routing/k3_replay``: the
    k3 estimate of KL(sampler || trainer) on the loss tokens, the trainer without and with
    replay). Two full forwards (``rl.routing_metrics: full``); un-jitted (jit it)."""
    lm = nnx.merge(graphdef, params)
    logp_live, live = _forward(lm, batch, None)
    logp_replay, _ = _forward(lm, batch, to_model(batch.routes, lm.config))
    sparse = tuple(i for i, s in enumerate(lm.config.sparse_layers) if s)
    routes = layout(batch.routes, lm.config.sparse_layers)
    out = disagreement_sums(routes, live, batch.attention_mask, sparse)
    out["routing/k3_live"] = _k3(batch.sampler_logp, logp_live, batch.loss_mask)
    out["routing/k3_replay"] = _k3(batch.sampler_logp, logp_replay, batch.loss_mask)
    return out
