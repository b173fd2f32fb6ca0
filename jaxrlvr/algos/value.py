"""PPO critic: a linear value head on the policy's final hidden states.

V[b, t] = hidden[b, t] . w + c, the value of the state after reading ``input_ids[b, :t+1]``,
i.e. before emitting ``labels[b, t]`` (so it lines up with the per-token log-probs and the loss
mask). The head is a plain dict ``{"kernel": [D], "bias": []}`` of float32 arrays, replicated on
every device (it is tiny). With ``trunk="shared"`` the value loss also trains the policy trunk
(one forward pass serves both); with ``"detached"`` only the head learns from it.

Not here: a separate value model with its own trunk (use a second policy-sized ``TrainState``
if you need one), and the value loss itself (``gae.value_loss``).
"""

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrlvr.algos import batch as batch_lib

Trunk = Literal["shared", "detached"]
ValueParams = dict[str, jax.Array]


def init_value_head(hidden_size: int, rng: jax.Array | int = 0, std: float = 0.0) -> ValueParams:
    """Head parameters: kernel [D] ~ N(0, std^2) (zeros by default: V = 0 at the start), bias 0."""
    key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
    return {
        "kernel": std * jax.random.normal(key, (hidden_size,), jnp.float32),
        "bias": jnp.zeros((), jnp.float32),
    }


def values_from_hidden(value_params: ValueParams, hidden_btd: jax.Array) -> jax.Array:
    """V [B, T] float32 from final hidden states [B, T, D] (any float dtype; computed in fp32)."""
    return (
        jnp.einsum("BTD,D->BT", hidden_btd.astype(jnp.float32), value_params["kernel"])
        + value_params["bias"]
    )


def make_value_fn(graphdef: nnx.GraphDef) -> Callable:
    """``(params, value_params, batch) -> values [B, T]`` float32 (jit it): the rollout-time
    ``old_values`` for PPO batches."""

    def value_fn(params: nnx.State, value_params: ValueParams, batch: batch_lib.Batch):
        lm = nnx.merge(graphdef, params)
        hidden, _ = lm.backbone(batch.input_ids, batch.attention_mask)
        return values_from_hidden(value_params, hidden)

    return value_fn
