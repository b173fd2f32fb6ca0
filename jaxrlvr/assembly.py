"""The run assembled once, eagerly, from a ``TrainConfig``: what ``train``, ``eval``, ``pairs``
and the TRL peer share.

``open_run`` is the one way a command opens a run: the compile cache, the backend, every input
checked (``preflight.check``), the run assembled, and closed at the end.

``start_backend`` places vLLM's and JAX's GPUs and joins the job's processes
(``jax.distributed``): once per process, before anything else starts JAX. ``assemble`` then
builds, in the order a user would fix their problems, the mesh (checked against every phase's
batch geometry), the tokenizer, the data splits (every prompt checked against the model's
positions before any weight is loaded), the model (initial, or a run's checkpoint), the data
shards of this process, the grader, and the sampler, started now on the model's weights and
wrapped as the run's phases need it (``Phase.sampler_wrapper``). The result is a
``phases.base.RunContext``: the phases get it, and the loop closes it.

``load_policy`` gives eval and pairs their policy: the config's initial model or a run's
checkpoint (``restore_policy``, which ``export`` uses too), restored through the method the
checkpoint records (``algos.registry``).

Not here: the parts themselves (``builders``), the loop (``train``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Literal

import jax
from flax import nnx

from jaxrlvr import (
    builders,
    compile_cache,
    configlib,
    distributed,
    passes,
    phases,
    placement,
    preflight,
    prompts,
)
from jaxrlvr import checkpoint as checkpoint_lib
from jaxrlvr import config as config_lib
from jaxrlvr import model as model_lib
from jaxrlvr.algos import registry
from jaxrlvr.algos import step as step_lib
from jaxrlvr.data import loading, shards
from jaxrlvr.phases import base

Mode = Literal["train", "eval", "pairs"]


@dataclasses.dataclass(eq=False)
class OpenRun:
    """A run ``open_run`` opened: the checked config (hub ids resolved), the run's components,
    and the policy's parameters (the trainer takes them: ``take_params``)."""

    cfg: config_lib.TrainConfig
    ctx: base.RunContext
    params: nnx.State | None

    def take_params(self) -> nnx.State:
        """The parameters, dropped from here so that the caller holds the only reference."""
        params, self.params = self.params, None
        return params


@contextlib.contextmanager
def open_run(
    cfg: config_lib.TrainConfig,
    *,
    mode: Mode,
    checkpoint: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> Iterator[OpenRun]:
    """Opens a run for a command (``train``, ``eval``, ``pairs``), the same way for each, and
    closes its sampler and grading pool at the end.

    In order: the persistent compile cache on (before anything compiles) and the process's
    compile counter started; the backend started (``start_backend``: placement and
    ``jax.distributed``, before anything starts JAX); every input checked
    (``preflight.check(mode=...)``; in a multi-process job every process checks before process
    0 may move an old run aside); the run assembled (``assemble``).

    Args:
      mode: the command: "train" (the run directory is made), "eval" or "pairs".
      checkpoint: eval / pairs: a run directory whose newest checkpoint is the policy, which
        then is the run's ``run.out_dir``; None: the config's initial model.
      resume, overwrite: train: continue the run in ``run.out_dir``, or move it aside.
    """
    if checkpoint is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=checkpoint))
    compile_cache.enable(cfg.run.compile_cache)
    compile_cache.process_counter().start()
    start_backend(cfg)  # before jax.process_index() starts the backend
    cfg = preflight.check(
        cfg,
        mode=mode,
        checkpoint=checkpoint,
        resume=resume,
        overwrite=overwrite and jax.process_index() == 0,
    )
    if jax.process_count() > 1:  # every process checked out_dir before process 0 writes to it
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxrlvr-preflight")
    if mode == "train":
        os.makedirs(cfg.run.out_dir, exist_ok=True)
    ctx, params = assemble(cfg, mode=mode, checkpoint=checkpoint)
    run = OpenRun(cfg, ctx, params)
    del params
    try:
        yield run
    finally:
        ctx.close()


def start_backend(cfg: config_lib.TrainConfig) -> placement.Placement:
    """Places the vLLM servers' and JAX's GPUs and joins the job's processes, both before JAX's
    backend starts, then checks the backend sees the trainer's GPUs. Returns the placement."""
    plan = placement.place_trainer(cfg.sampler)
    distributed.initialize(cfg.distributed)  # a no-op for one process
    placement.check_jax_devices(plan)
    return plan


def assemble(
    cfg: config_lib.TrainConfig, *, mode: Mode = "train", checkpoint: str | None = None
) -> tuple[base.RunContext, nnx.State]:
    """(the run's components, the policy's parameters). ``mode``: "train" builds the initial
    model and this process's data shards; "eval" and "pairs" load the policy of ``checkpoint``
    (a run directory; None: the config's initial model) on the whole host, with the held-out
    or the training split only."""
    train = mode == "train"
    preflight.check_sampler_devices(cfg.sampler, len(jax.devices()))
    devices = builders.device_split(cfg.sampler)[0] if train else None
    mesh = model_lib.make_mesh(cfg.mesh, devices)
    if train:
        preflight.check_microbatches_fit_mesh(cfg, mesh)
    tokenizer = builders.build_tokenizer(cfg.model)
    if train:
        model = None
        model_cfg = builders.model_config(cfg.model, tokenizer)
    else:
        purpose = "evaluating" if mode == "eval" else "pairs: sampling from"
        model = load_policy(cfg, checkpoint, mesh, tokenizer, purpose=purpose)
        model_cfg = model.config
    positions = model_cfg.max_position_embeddings
    check_expert_mesh(model_cfg, cfg.mesh.expert)
    train_problems, eval_problems = load_splits(cfg, train=mode != "eval")
    # Every prompt fits the model before any weight is loaded or step compiled.
    plan = phases.plan(cfg)
    sampled = mode == "pairs" or any(p.samples_train_prompts for p in plan)
    checked = {
        "data.train": train_problems if sampled else [],
        "data.eval": loading.held_out_share(eval_problems, cfg.eval.max_problems),
    }
    preflight.check_lengths(cfg.data.template, cfg.sampler, tokenizer, positions, checked)
    if model is None:
        model = builders.build_model(cfg.model, tokenizer, mesh, seed=cfg.run.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    if train:  # multi-process: this process keeps only the training rows of its data shards
        preflight.check_data_shards(cfg, step_lib.process_row_block(mesh)[1])
        num_shards, owned = builders.data_shards(cfg, mesh)
        split = shards.split(train_problems, num_shards, cfg.run.seed)
        row_block = step_lib.process_row_block(mesh)
    else:
        num_shards, owned, split, row_block = 1, range(1), [train_problems], (0, 1)
    # The rollout passes (teacher scores, routing replay), loaded and checked before any compute.
    run_passes = ()
    if train:
        run_passes = passes.build(
            cfg,
            model_cfg=model.config,
            graphdef=graphdef,
            mesh=mesh,
            tokenizer=tokenizer,
            problems=train_problems,
        )
    grader = builders.build_grader(cfg)
    try:
        sampler = builders.build_sampler(cfg.sampler, model, tokenizer, mesh, cfg.run.out_dir)
        wrappers = {c.sampler_wrapper: c for c in plan if c.sampler_wrapper}
        for wrap, cls in wrappers.items():
            sampler = wrap(cls.view(cfg), sampler, tokenizer)
    except BaseException:
        with contextlib.suppress(Exception):
            grader.close()
        raise
    ctx = base.RunContext(
        run_dir=cfg.run.out_dir,
        mesh=mesh,
        tokenizer=tokenizer,
        template=cfg.data.template,
        model_cfg=model.config,
        graphdef=graphdef,
        params_shape=jax.eval_shape(lambda p: p, params),
        train_problems=[p for i in owned for p in split[i]],
        train_shards={i: split[i] for i in owned},
        num_shards=num_shards,
        eval_problems=eval_problems,
        row_block=row_block,
        grader=grader,
        sampler=sampler,
        passes=run_passes,
    )
    return ctx, params


def checkpoint_method(cfg: config_lib.TrainConfig, extra: dict) -> str:
    """The registered method whose state a checkpoint holds: its ``method``; a checkpoint written
    before phases recorded it names its record "sft" or "rl" (then ``rl.algo``'s)."""
    if "method" in extra:
        return extra["method"]
    return registry.SFT if extra.get("record") == "sft" else cfg.rl.algo


def restore_policy(
    cfg: config_lib.TrainConfig, run_dir: str, mesh, tokenizer, *, step: int | None = None
) -> tuple[int, model_lib.Qwen2ForCausalLM]:
    """The policy of a run's checkpoint (default: the newest that restores), restored into an
    abstract model: no Hugging Face weights are loaded, no data or graders are touched.

    The architecture comes from the checkpoint (``model_config``), else from the run's config.
    """
    ckpt = checkpoint_lib.Checkpointer(os.path.join(run_dir, "checkpoints"))

    def target(s, extra):
        if extra.get("model_config"):
            m = cfg.model
            model_cfg = model_lib.ModelConfig.from_hf_config(
                extra["model_config"],
                dtype=m.dtype,
                param_dtype=m.param_dtype,
                lm_head_dtype=m.lm_head_dtype,
                remat=m.remat,
                scan_layers=m.scan_layers,
                attention_query_chunk=m.attention_query_chunk,
                moe_impl=m.moe_impl,
                lora=m.lora,
            )
        else:
            model_cfg = builders.model_config(cfg.model, tokenizer)
        graphdef, params_shape = builders.abstract_model(model_cfg, mesh)
        algo = registry.build(checkpoint_method(cfg, extra), cfg, graphdef, params_shape, mesh)
        target.graphdef = graphdef
        return {"state": checkpoint_lib.abstract_state(algo, params_shape, mesh)[0]}

    try:
        restored = ckpt.restore_latest(target, step=step, log=prompts.log)
    finally:
        ckpt.close()
    if restored is None:
        raise checkpoint_lib.CheckpointError(f"no complete checkpoint in {ckpt.directory}")
    step, tree, _ = restored
    return step, nnx.merge(target.graphdef, tree["state"].params)


def load_policy(
    cfg: config_lib.TrainConfig, run_dir: str | None, mesh, tokenizer, *, purpose: str
) -> model_lib.Qwen2ForCausalLM:
    """The config's initial model (``run_dir`` None), or the policy of a run's newest checkpoint
    (``restore_policy``), logged as ``"{purpose} checkpoint step N of RUN_DIR"``."""
    if run_dir is None:
        return builders.build_model(cfg.model, tokenizer, mesh, seed=cfg.run.seed)
    step, model = restore_policy(cfg, run_dir, mesh, tokenizer)
    prompts.log(f"{purpose} checkpoint step {step} of {run_dir}")
    return model


def load_splits(
    cfg: config_lib.TrainConfig, *, train: bool = True
) -> tuple[list[loading.Problem], list[loading.Problem]]:
    """``builders.load_splits`` with domains: ``data.domain`` given to the problems without one
    of their own; a ``data.mixture``'s sources each loaded as its own ``data`` section, every
    problem given its source's domain, the sources' splits concatenated in the listed order."""
    d = cfg.data
    if not d.mixture:
        splits = builders.load_splits(cfg, train=train)
        if d.domain is None:
            return splits
        return tuple(
            [p if p.domain else dataclasses.replace(p, domain=d.domain) for p in split]
            for split in splits
        )
    train_problems, eval_problems = [], []
    for m in d.mixture:
        source = dataclasses.replace(cfg, data=dataclasses.replace(m.data, template=d.template))
        tr, ev = builders.load_splits(source, train=train)
        train_problems += [dataclasses.replace(p, domain=m.domain) for p in tr]
        eval_problems += [dataclasses.replace(p, domain=m.domain) for p in ev]
    return train_problems, eval_problems


def check_expert_mesh(model_cfg, expert: int) -> None:
    """``mesh.expert`` > 1 needs a MoE model whose experts it divides and a dispatch that
    compiles here (``model.expert_parallel.check``): one-line config error otherwise."""
    from jaxrlvr.model import expert_parallel

    try:
        expert_parallel.check(model_cfg, expert)
    except ValueError as e:
        raise configlib.ConfigKeyError(str(e)) from None
