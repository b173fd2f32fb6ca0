"""PPO critic: a linear value head, on the policy's final hidden states or on its own Qwen2 trunk.

V[b, t] = hidden[b, t] . w + c, the value of the state after reading ``input_ids[b, :t+1]``,
i.e. before emitting ``labels[b, t]`` (so it lines up with the per-token log-probs and the loss
mask). The head is a plain dict ``{"kernel": [D], "bias": []}`` of float32 arrays, replicated on
every device (it is tiny). Where ``hidden`` comes from is the ``Trunk`` option:

- ``"shared"``: the policy's hidden states; the value loss also trains the policy trunk (one
  forward pass serves both);
- ``"detached"``: the policy's hidden states behind a stop-gradient; only the head learns;
- ``"separate"``: a critic model of its own (as the critics of verl and TRL, initialised from the
  policy or a reward model): a Qwen2 backbone of the same class plus the head. Its params,
  ``{"backbone": nnx.State, "head": {"kernel", "bias"}}`` from ``init_value_model``, have their
  own optimiser state; the policy loss never reaches them and the value loss never reaches the
  policy. The backbone's params carry the policy's ``logical_axes``, so ``step.state_shardings``
  shards them exactly like the policy's. The critic costs a second forward and backward pass
  and a second copy of the weights and optimiser moments.

The critic's graph definition (``init_value_model``) is the policy's with the LM head removed:
a critic never computes logits, and an untied ``lm_head`` would be V x D dead weights with Adam
moments. For a tied model (``tie_word_embeddings``) it equals the policy's graph definition.

Not here: the value loss itself (``gae.value_loss``) and the PPO update (``ppo``).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrlvr.algos import batch as batch_lib

Trunk = Literal["shared", "detached", "separate"]
ValueParams = dict[str, jax.Array]
# trunk="separate": {"backbone": nnx.State of nnx.Param, "head": ValueParams}.
ValueModelParams = dict[str, Any]


def init_value_head(hidden_size: int, rng: jax.Array | int = 0, std: float = 0.0) -> ValueParams:
    """Head parameters: kernel [D] ~ N(0, std^2) (zeros by default: V = 0 at the start), bias 0."""
    key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
    return {
        "kernel": std * jax.random.normal(key, (hidden_size,), jnp.float32),
        "bias": jnp.zeros((), jnp.float32),
    }


def init_value_model(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    *,
    rng: jax.Array | int = 0,
    std: float = 0.0,
) -> tuple[nnx.GraphDef, ValueModelParams]:
    """A separate critic (``trunk="separate"``) initialised from a Qwen2 model's weights.

    Args:
      graphdef, params: a ``Qwen2ForCausalLM`` split with ``nnx.split(model, nnx.Param)``: the
        policy (the usual choice: a critic that starts from the policy, as in verl), or another
        checkpoint such as a reward model. The critic copies the weights (fresh buffers, so
        donating the policy's state never frees the critic's) and keeps their shardings.
      rng, std: the head's initialisation (``init_value_head``; zeros by default: V = 0).
    Returns:
      ``(value_graphdef, value_params)``: the critic's graph definition (static: pass it to
      ``make_value_fn`` and ``ppo.make_ppo_update`` as ``value_graphdef``) and
      ``{"backbone": nnx.State, "head": ValueParams}`` for ``TrainState.value_params``.
    """
    value_graphdef, backbone = _critic(graphdef, params)
    backbone = jax.tree.map(jnp.copy, backbone)
    head = init_value_head(nnx.merge(value_graphdef, backbone).config.hidden_size, rng, std)
    return value_graphdef, {"backbone": backbone, "head": head}


def _critic(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    """The policy split again without its LM head: (critic graph definition, backbone params)."""
    critic = nnx.merge(graphdef, params)
    if critic.lm_head is not None:
        # Drop the untied LM head; with lm_head None the class's invariant is "tied", which is
        # harmless here because the critic never calls lm_logits.
        critic.lm_head = None
        critic.config = dataclasses.replace(critic.config, tie_word_embeddings=True)
    return nnx.split(critic, nnx.Param)


def critic_graphdef(graphdef: nnx.GraphDef, params: nnx.State) -> nnx.GraphDef:
    """The separate critic's graph definition (``init_value_model``'s first result) without
    building a critic: ``params`` may be the policy's ``jax.ShapeDtypeStruct`` shapes."""
    return _critic(graphdef, params)[0]


def values_from_hidden(value_params: ValueParams, hidden_btd: jax.Array) -> jax.Array:
    """V [B, T] float32 from final hidden states [B, T, D] (any float dtype; computed in fp32)."""
    return (
        jnp.einsum("BTD,D->BT", hidden_btd.astype(jnp.float32), value_params["kernel"])
        + value_params["bias"]
    )


def value_model_values(
    value_graphdef: nnx.GraphDef,
    value_params: ValueModelParams,
    input_ids_bt: jax.Array,
    attention_mask_bt: jax.Array | None,
    *,
    positions_bt: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    prompt_group_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """V [B, T] float32 of a separate critic (``init_value_model``): its own backbone, then the
    head. ``positions_bt`` / ``segment_ids_bt`` / ``prompt_group_ids_bt``: packed rows
    (``algos.segments``), shared prompts."""
    critic = nnx.merge(value_graphdef, value_params["backbone"])
    hidden, _ = critic.backbone(
        input_ids_bt,
        attention_mask_bt,
        positions_bt,
        segment_ids=segment_ids_bt,
        prompt_group_ids=prompt_group_ids_bt,
    )
    return values_from_hidden(value_params["head"], hidden)


def make_value_fn(
    graphdef: nnx.GraphDef, *, value_graphdef: nnx.GraphDef | None = None
) -> Callable:
    """``(params, value_params, batch) -> values [B, T]`` float32 (jit it): the rollout-time
    ``old_values`` for PPO batches.

    Args:
      graphdef: the policy's graph definition.
      value_graphdef: the separate critic's (``init_value_model``), for ``trunk="separate"``;
        then ``value_params`` is the critic's ``{"backbone", "head"}`` and ``params`` (the
        policy's) is not read. None: ``value_params`` is a head on the policy's hidden states.
    """

    def value_fn(params: nnx.State, value_params: Any, batch: batch_lib.Batch):
        if value_graphdef is not None:
            return value_model_values(
                value_graphdef,
                value_params,
                batch.input_ids,
                batch.attention_mask,
                positions_bt=batch.positions,
                segment_ids_bt=batch.segment_ids,
                prompt_group_ids_bt=batch.prompt_group_ids,
            )
        lm = nnx.merge(graphdef, params)
        hidden, _ = batch_lib.run_backbone(lm, batch)
        return values_from_hidden(value_params, hidden)

    return value_fn
