"""MoE routing replay and its diagnostics, the rollout pass of ``algos.routing``.

Fields: ``routes`` [B, T, L, k] (the experts the sampler recorded for each input token,
``Completion.routes``, laid out by ``rollout.pack`` with the tokens; host), replaced by the
trainer's own routes under the step's parameters for ``rl.routing_replay: r2`` (device), dropped
for "none"; then ``sampler_routes`` carries them unreplayed for the diagnostics. Where: both.

Checks: when built, ``rl.routing_replay`` r3 / r2 on a dense model is refused in one line (it
used to train on, replaying nothing); every step, each completion's routes are checked on the
host before they are packed (``routing.check_routes``: ids in [-1, E), no id twice in a token's
set, a layer axis of every decoder layer or every MoE layer), so a bad route from a vLLM
response fails in one line naming the completion and the position.

Metrics (``rl.routing_metrics``): "basic" (the default) compares the sampler's routes with the
experts the update's own forward picks (``routing.add_disagreement``: with one epoch that forward
runs under the parameters before the step, so it is the old policy's; with several, the last
epoch's), no extra forward: ``routing/disagree``, ``routing/token_disagree``,
``routing/layer{i}/disagree``, ``routing/covered``; under replay the forward's experts are the
forced ones, so basic reports nothing. "full" adds, every ``rl.routing_metrics_every`` steps, two
extra forwards (``routing.route_metrics``: the disagreement and the k3 gap of the trainer without
and with replay, ``routing/k3_live`` / ``routing/k3_replay``). "off": none.

The pass runs for a MoE model (``ModelConfig.is_moe``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxrlvr import configlib
from jaxrlvr.algos import routing
from jaxrlvr.passes.base import RolloutPass


class RoutingReplay(RolloutPass):
    """Routing replay and its diagnostics (module docstring).

    Args:
      model_cfg, graphdef: the policy's model config and graph definition.
      mode: ``rl.routing_replay``; metrics, every: ``rl.routing_metrics`` and
        ``rl.routing_metrics_every``.
    """

    name = "routing"
    where = "both"
    fields = {"routes": "host (r2: device)", "sampler_routes": "device"}

    def __init__(self, model_cfg, graphdef, *, mode: str, metrics: str = "basic", every: int = 1):
        routing.check_mode(mode)
        self.model_cfg, self.graphdef = model_cfg, graphdef
        self.mode, self.metrics, self.every = mode, metrics, every
        self._fns: dict[str, Callable] = {}

    @classmethod
    def from_config(cls, cfg, *, model_cfg, graphdef, **_):
        rl = cfg.rl
        if not model_cfg.is_moe:
            if rl.routing_replay != "none":
                raise configlib.ConfigKeyError(
                    f"rl.routing_replay={rl.routing_replay}: routing replay needs a MoE model, "
                    f"and model_type {model_cfg.model_type!r} is dense (set it to none)"
                )
            return None
        return cls(
            model_cfg,
            graphdef,
            mode=rl.routing_replay,
            metrics=rl.routing_metrics,
            every=rl.routing_metrics_every,
        )

    def host(self, problems, prompts, completions):
        """Checks every completion's routes (module docstring). They are checked as one array,
        all tokens of the step at once (one completion at a time took 15 ms of the MoE demo's
        GRPO step, 256 completions of ~20 tokens); only when that fails, or the completions'
        layouts differ, does each get its own check, for a message that names it."""
        cfg = self.model_cfg
        kw = dict(
            num_experts=cfg.num_experts, sparse_layers=cfg.sparse_layers, k=cfg.num_experts_per_tok
        )
        recorded = [
            (i, np.asarray(c.routes)) for i, c in enumerate(completions) if c.routes is not None
        ]
        if not recorded:
            return {}, {}
        if len({r.shape[1:] for _, r in recorded}) == 1 and all(r.ndim == 3 for _, r in recorded):
            try:
                routing.check_routes(
                    np.concatenate([r for _, r in recorded]), field="Completion.routes", **kw
                )
                return {}, {}
            except routing.RouteError:
                pass  # found again below, named by completion
        for i, r in recorded:
            routing.check_routes(r, field=f"completion {i}: Completion.routes", **kw)
        return {}, {}

    def _fn(self, name: str) -> Callable:
        if name not in self._fns:
            fn = getattr(routing, name)
            self._fns[name] = jax.jit(lambda p, b: fn(self.graphdef, p, b))
        return self._fns[name]

    def _full(self, step: int) -> bool:
        return self.metrics == "full" and step % self.every == 0

    def _unreplayed(self, rollouts, step: int):
        """Replay off: the recorded routes move to ``sampler_routes`` for the basic metrics."""
        basic = self.metrics != "off" and not self._full(step)
        return rollouts.replace(routes=None, sampler_routes=rollouts.routes if basic else None)

    def device(self, state, rollouts, *, step):
        metrics = {}
        if rollouts.routes is None:
            return rollouts, metrics
        if self._full(step) and rollouts.sampler_logp is not None:
            out = self._fn("route_metrics")(state.params, rollouts)
            metrics = {k: float(v) for k, v in jax.device_get(out).items()}
        if self.mode == "r2":
            live = self._fn("trainer_routes")(state.params, rollouts.replace(routes=None))
            rollouts = rollouts.replace(routes=np.asarray(live).astype(np.int16))
        elif self.mode == "none":
            rollouts = self._unreplayed(rollouts, step)
        return rollouts, metrics

    @property
    def can_stand_in(self) -> bool:
        """r2's routes come from a forward under the state's parameters."""
        return self.mode != "r2"

    def stand_in(self, rollouts, *, step):
        """r3 hands the recorded routes on and replay off moves them."""
        if rollouts.routes is None or self.mode != "none":
            return rollouts
        return self._unreplayed(rollouts, step)

    def finish(self, metrics):
        return routing.shares(metrics)
