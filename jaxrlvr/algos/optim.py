"""The optimiser of every update: global-norm clipping, AdamW, warmup + constant or cosine decay.

``make_optimizer(cfg)`` builds the optax chain ``clip_by_global_norm -> adamw(schedule)``
(the clip is ``clip_by_global_norm`` below: optax's rule as one scalar factor); the
optimiser state follows the parameters' dtype and tree (float32 master weights give float32
moments), so its sharding is the parameters' sharding. ``make_schedule(cfg)`` is the same
learning-rate schedule, exposed so the update can report the rate it applied at ``state.step``.

Not here: per-parameter-group learning rates and weight-decay masks (every parameter decays
alike, as in the CS336 reference), and optimisers other than AdamW.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from jaxrlvr.algos import loss_config

Schedule = Literal["constant", "cosine"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with gradient clipping and a learning-rate schedule.

    learning_rate: peak rate, reached after ``warmup_steps`` of linear warmup from 0.
    schedule: "constant" (stay at the peak) or "cosine" (decay to
        ``learning_rate * final_lr_ratio`` at ``total_steps``; required then).
    max_grad_norm: clip the global gradient norm to this (None: no clipping).
    b1, b2, eps, weight_decay: AdamW's (Loshchilov & Hutter 2019) moments, epsilon and decoupled
        weight decay.
    """

    learning_rate: float = 1e-6
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    final_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        loss_config.check_literal("schedule", self.schedule, Schedule)
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate!r}")
        if not self.warmup_steps >= 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.schedule == "cosine" and not (
            self.total_steps is not None and self.total_steps > self.warmup_steps
        ):
            raise ValueError(
                "total_steps must be an integer > warmup_steps when schedule is 'cosine', "
                f"got {self.total_steps!r}"
            )
        if not 0 <= self.final_lr_ratio <= 1:
            raise ValueError(f"final_lr_ratio must be in [0, 1], got {self.final_lr_ratio!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be None or > 0, got {self.max_grad_norm!r}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"b1 and b2 must be in [0, 1), got {self.b1!r} and {self.b2!r}")
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Learning rate as a function of the optimiser step (0-based): warmup, then constant/cosine."""
    if cfg.schedule == "constant":
        if cfg.warmup_steps == 0:
            return optax.constant_schedule(cfg.learning_rate)
        return optax.join_schedules(
            [
                optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
                optax.constant_schedule(cfg.learning_rate),
            ],
            [cfg.warmup_steps],
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.learning_rate * cfg.final_lr_ratio,
    )


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm``'s rule (g if ||g|| < max_norm, else g * max_norm / ||g||)
    as a multiply by one scalar factor, and the same (empty) state.

    Why not optax's own: it divides every element by the norm, and XLA counts an elementwise
    divide as expensive, so it materialises the clipped gradient (a float32 copy of every
    parameter) for the three AdamW fusions that read it; a multiply by a scalar is fused into
    each of them. Values agree with optax's to float rounding (one product instead of a
    quotient and a product).
    """

    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(max_grad_norm)`` then AdamW driven by ``make_schedule(cfg)``."""
    adamw = optax.adamw(
        learning_rate=make_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(clip_by_global_norm(cfg.max_grad_norm), adamw)
