"""The training state: the one pytree that an update consumes and returns.

``TrainState`` holds only arrays: the step counter, the policy parameters (an ``nnx.State`` of
``nnx.Param`` leaves that carry their ``logical_axes``), the optimiser state, a PRNG key, and for
PPO the critic's parameters (a value head, or a separate value model) and their optimiser state,
and the frozen reference policy's parameters when a KL penalty needs them (no optimiser state;
updates pass them through unchanged).
The models' graph definitions and the optax transformations are static and live in the update's
closure, so the state can be donated, sharded (``step.state_shardings``) and checkpointed as a
plain pytree.

Not here: building a state for an algorithm (``algorithm.Algorithm.init`` does that, so the
optimiser that initialised ``opt_state`` is the one the update applies), and checkpointing.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxrlvr.model import lora


@struct.dataclass
class TrainState:
    """step: int32 scalar, the number of applied optimiser updates (a non-finite step is not
    counted); params: policy ``nnx.State``; opt_state: the optax state of ``params``; rng: a PRNG
    key (uint32 [2]), advanced on every applied update (with LoRA adapters in ``params``,
    ``opt_state`` covers only them: ``model.lora.split_trainable``); value_params /
    value_opt_state: the PPO
    critic (``value.init_value_head``, or ``value.init_value_model`` for a separate value model)
    and its optax state, None otherwise; ref_params: the frozen reference policy for KL
    penalties, None otherwise: the same tree as ``params``, or with LoRA adapters only the
    reference's adapter values (the base is frozen, so the reference's base is the policy's own;
    ``reference_params`` joins them, and the base is not held twice)."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    rng: jax.Array
    value_params: Any = None
    value_opt_state: Any = None
    ref_params: Any = None

    def reference_params(self) -> nnx.State | None:
        """The reference policy's whole params: ``ref_params``, or with LoRA adapters, the
        policy's frozen base joined with the reference's adapters."""
        if self.ref_params is None or not lora.has_adapters(self.params):
            return self.ref_params
        return lora.split_trainable(self.params)[1](self.ref_params)

    @classmethod
    def create(
        cls,
        model_or_graphdef: nnx.Module | nnx.GraphDef,
        params: nnx.State | None,
        tx: optax.GradientTransformation,
        rng: jax.Array | int = 0,
        value_params: Any = None,
        value_tx: optax.GradientTransformation | None = None,
        ref_params: nnx.State | None = None,
    ) -> "TrainState":
        """A fresh state at step 0.

        Args:
          model_or_graphdef: the policy module (its params are taken when ``params`` is None) or
            its graph definition (then ``params`` is required). The graph definition itself is not
            stored.
          params: the policy's ``nnx.Param`` state, e.g. ``nnx.split(model, nnx.Param)[1]``.
          tx: optax transformation for the policy (``optim.make_optimizer``).
          rng: PRNG key or integer seed.
          value_params: PPO critic parameters (``value.init_value_head`` or
            ``value.init_value_model``), or None.
          value_tx: optax transformation for the critic; required with ``value_params``.
          ref_params: the frozen reference policy's params, or None.
        """
        if params is None:
            if isinstance(model_or_graphdef, nnx.GraphDef):
                raise ValueError("TrainState.create: `params` is required with a graph definition")
            _, params = nnx.split(model_or_graphdef, nnx.Param)
        if isinstance(rng, int):
            rng = jax.random.PRNGKey(rng)
        if value_params is not None and value_tx is None:
            raise ValueError("TrainState.create: `value_tx` is required with `value_params`")
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(lora.trainable(params)),
            rng=jnp.asarray(rng),
            value_params=value_params,
            value_opt_state=None if value_params is None else value_tx.init(value_params),
            ref_params=ref_params,
        )
