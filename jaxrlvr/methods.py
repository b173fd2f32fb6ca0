"""The config's training method -> its ``algos`` record: the one place where ``rl.algo`` becomes
code.

``make_algorithm(cfg, phase, ...)`` builds the ``Algorithm`` record of a phase ("sft" for the
warm start, "rl" for ``rl.algo``'s method), ``abstract_state`` its state's shape and shardings
(what a checkpoint restores into). Nothing here runs a step.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jaxrlvr import checkpoint as checkpoint_lib
from jaxrlvr import config as config_lib
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import distill, grpo, ppo, preference, sft
from jaxrlvr.algos import step as step_lib


def make_algorithm(
    cfg: config_lib.TrainConfig,
    phase: str,
    graphdef: nnx.GraphDef,
    params_shape: nnx.State,
    mesh,
    *,
    microbatches: int | None = None,
) -> algorithm_lib.Algorithm:
    """The algorithm record of a training phase ("sft" or "rl"): the one place where the config's
    ``rl.algo`` string becomes code. An SFT-only run (``rl.algo: none``) stays with SFT's. An RL
    record trains each batch ``rl.epochs_per_step`` times in one ``update`` call (the record owns
    its epochs: a driver calls ``update`` once per step).

    ``microbatches``: the RL record's microbatch count (default ``rl.microbatches``), for the
    count a token budget chose (``rl.max_tokens_per_microbatch``); the state it inits has the
    same shapes whatever the count."""
    if phase == "sft" or cfg.rl.algo == "none":
        sft_cfg = sft.SFTUpdateConfig(
            num_microbatches=cfg.sft.microbatches, logprob_chunk_size=cfg.sft.logprob_chunk_size
        )
        return sft.sft_algorithm(graphdef, cfg.sft.optim, sft_cfg, mesh=mesh)
    rl = cfg.rl
    microbatches = rl.microbatches if microbatches is None else microbatches
    epochs = rl.epochs_per_step
    if rl.algo == "grpo":
        grpo_cfg = grpo.GRPOUpdateConfig(
            loss=rl.policy_loss,
            num_microbatches=microbatches,
            logprob_chunk_size=rl.logprob_chunk_size,
        )
        return grpo.grpo_algorithm(
            graphdef,
            cfg.optim,
            grpo_cfg,
            mesh=mesh,
            epochs_per_batch=epochs,
            rollouts_may_be_stale=rl.max_staleness > 0,
        )
    if rl.algo == "distill":
        distill_cfg = distill.DistillUpdateConfig(
            loss=rl.policy_loss,
            distill=distill.DistillConfig(
                signal=rl.distill.signal,
                kl_coef=rl.distill.kl_coef,
                reward_coef=rl.distill.reward_coef,
                beta=rl.distill.beta,
                temperature=rl.distill.temperature,
                top_k=rl.distill.top_k if rl.distill.signal == "jsd" else None,
            ),
            num_microbatches=microbatches,
            logprob_chunk_size=rl.logprob_chunk_size,
        )
        return distill.distill_algorithm(
            graphdef,
            cfg.optim,
            distill_cfg,
            mesh=mesh,
            epochs_per_batch=epochs,
            rollouts_may_be_stale=rl.max_staleness > 0,
        )
    if rl.algo == "ppo":
        ppo_cfg = ppo.PPOUpdateConfig(
            loss=rl.policy_loss,
            num_microbatches=microbatches,
            logprob_chunk_size=rl.logprob_chunk_size,
            **dataclasses.asdict(rl.ppo),
        )
        return ppo.ppo_algorithm(
            graphdef,
            cfg.optim,
            ppo_cfg,
            params_shape=params_shape,
            mesh=mesh,
            epochs_per_batch=epochs,
        )
    if rl.algo in config_lib.PREFERENCE_ALGOS:
        loss = preference.PreferenceLossConfig(
            kind=rl.algo,
            beta=cfg.pref.beta,
            label_smoothing=cfg.pref.label_smoothing,
            gamma=cfg.pref.gamma,
            nll_weight=cfg.pref.nll_weight,
        )
        pref_cfg = preference.PreferenceUpdateConfig(
            loss=loss, num_microbatches=microbatches, logprob_chunk_size=rl.logprob_chunk_size
        )
        return preference.preference_algorithm(
            graphdef, cfg.optim, pref_cfg, mesh=mesh, epochs_per_batch=epochs
        )
    if rl.algo == "expert_iteration":
        ei_cfg = sft.SFTUpdateConfig(
            num_microbatches=microbatches, logprob_chunk_size=rl.logprob_chunk_size
        )
        return sft.expert_iteration_algorithm(
            graphdef, cfg.optim, ei_cfg, mesh=mesh, epochs_per_batch=epochs
        )
    raise ValueError(f"rl.algo={rl.algo!r}: no such algorithm")


def abstract_state(algorithm, params_shape, mesh, rng=0):
    """The abstract ``TrainState`` of ``algorithm.init`` with its target shardings."""
    shape = jax.eval_shape(lambda p: algorithm.init(p, rng), params_shape)
    shardings = step_lib.state_shardings(shape, mesh)
    return checkpoint_lib.abstract_like(shape, shardings), shardings
