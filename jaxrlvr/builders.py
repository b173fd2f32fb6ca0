"""The run's parts, each built from a ``TrainConfig``: the tokenizer, the model (its config, its
weights, or only its shape), the data splits and their shards, the sampler (the embedded JAX
sampler or supervised vLLM servers) and the grader (reward function + grading pool).
``assembly.assemble`` puts them together once for a run; nothing here trains or loops
(``train``, ``phases``), and nothing here checks the config: ``assembly`` runs ``preflight``'s
checks of the mesh, the devices, the data shards and the prompts before it calls these.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil

import jax
from flax import nnx

from jaxrlvr import config as config_lib
from jaxrlvr import configlib, distributed, placement, prompts, sandbox
from jaxrlvr import model as model_lib
from jaxrlvr.algos import step as step_lib
from jaxrlvr.data import (
    code_loading,
    loading,
    multiplication,
    scratchpad,
    shards,
    synthetic,
)
from jaxrlvr.data import tokenizer as tokenizer_lib
from jaxrlvr.rewards import code, grading, language, verifiers


def build_tokenizer(model: config_lib.ModelSection):
    """The tokenizer of ``model.tokenizer`` (default: the checkpoint's), with a pad token."""
    source = model.tokenizer or model.path
    if source == "char":
        return tokenizer_lib.build_char_tokenizer()
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(source)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def model_config(m: config_lib.ModelSection, tokenizer) -> model_lib.ModelConfig:
    """The policy's architecture: the checkpoint's config.json, or the random model's shape."""
    choices = dict(
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        lm_head_dtype=m.lm_head_dtype,
        remat=m.remat,
        scan_layers=m.scan_layers,
        attention_query_chunk=m.attention_query_chunk,
        moe_impl=m.moe_impl,
        lora=m.lora,
        router_aux_loss=m.router_aux_loss,
    )
    if m.path is not None:
        return model_lib.ModelConfig.from_json(os.path.join(m.path, "config.json"), **choices)
    return model_lib.ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        model_type=m.model_type,
        head_dim_override=m.head_dim,
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size,
        norm_topk_prob=m.norm_topk_prob,
        decoder_sparse_step=m.decoder_sparse_step,
        mlp_only_layers=m.mlp_only_layers,
        hf_config={
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        **choices,
    )


def build_model(
    m: config_lib.ModelSection, tokenizer, mesh, *, seed: int
) -> model_lib.Qwen2ForCausalLM:
    """The policy with its weights: loaded from ``model.path`` or randomly initialised (``seed``:
    ``run.seed``, also the LoRA adapters')."""
    if m.path is not None:
        return model_lib.load_hf(
            m.path,
            dtype=m.dtype,
            param_dtype=m.param_dtype,
            mesh=mesh,
            remat=m.remat,
            scan_layers=m.scan_layers,
            attention_query_chunk=m.attention_query_chunk,
            moe_impl=m.moe_impl,
            lora=m.lora,
            lora_seed=seed,
            router_aux_loss=m.router_aux_loss,
        )
    return model_lib.init_model(model_config(m, tokenizer), seed=seed, mesh=mesh)


def abstract_model(model_cfg: model_lib.ModelConfig, mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """(graph definition, params as ``jax.ShapeDtypeStruct``): the model's shape, no weights."""
    abstract = nnx.eval_shape(lambda: model_lib.Qwen2ForCausalLM(model_cfg, mesh=mesh))
    return nnx.split(abstract, nnx.Param)


def load_splits(
    cfg: config_lib.TrainConfig, *, train: bool = True
) -> tuple[list[loading.Problem], list[loading.Problem]]:
    """(train problems, held-out problems); ``train=False`` skips reading the training split.

    A generated task (``synthetic``, ``multiplication``, ``scratchpad``) draws both splits from
    ``run.seed``; ``data.eval``, when set, replaces its held-out split with that file (e.g. the
    held-out file ``jaxrlvr curate`` writes), so the override is never silently ignored."""
    d = cfg.data

    def load(path, split, key):
        data_cfg = loading.DataConfig(
            key=key,
            path=path,
            split=split,
            question_field=d.question_field,
            answer_field=d.answer_field,
            solution_field=d.solution_field,
            on_bad_row=d.on_bad_row,
        )
        problems, stats = loading.load_problems(data_cfg)
        if stats.dropped:
            prompts.log(
                f"{path}: kept {stats.kept} problems, dropped {stats.dropped} ({stats.reasons})"
            )
        if not problems:
            raise ValueError(f"{path}: no usable problems (dropped {stats.dropped})")
        return problems

    generated = {
        "synthetic": (synthetic, d.synthetic),
        "multiplication": (multiplication, d.multiplication),
        "scratchpad": (scratchpad, d.scratchpad),
    }
    if d.train in generated:
        module, task_cfg = generated[d.train]
        train_problems, held_out = module.make_splits(
            cfg.run.seed, d.synthetic_train_size, d.synthetic_eval_size, task_cfg
        )
        if d.eval:
            held_out = load(d.eval, d.eval_split, "data.eval")
        return train_problems, held_out
    if d.train == "synthetic_code" or d.code_layout is not None:
        return code_loading.load_splits(d, cfg.run.seed, train=train)

    train_problems = load(d.train, d.split, "data.train") if train else []
    held_out = load(d.eval, d.eval_split, "data.eval") if d.eval else []
    return train_problems, held_out


def build_sampler(s: config_lib.SamplerSection, model, tokenizer, mesh, run_dir: str):
    """The run's sampler: the engine of ``sampler.kind``, started on ``model``'s weights (the
    run's phases may wrap it: ``assembly.assemble``)."""
    eos = tuple(i for i in {tokenizer.eos_token_id} if i is not None)
    if s.kind == "jax":
        from jaxrlvr.sampling import jax_sampler

        own = device_split(s)[1]
        if own is not None:  # a sub-mesh of its own; update_weights copies the weights over
            mesh = model_lib.make_mesh(model_lib.MeshConfig(data=1, fsdp=-1, tensor=1), own)
        return jax_sampler.JaxSampler(
            model, tokenizer, mesh=mesh, eos_token_ids=eos, compute_dtype=s.jax_dtype
        )
    from jaxrlvr.sampling import vllm_sampler, vllm_server

    vllm_sampler.check_servable(model.config)  # before any server starts
    plan = placement.plan(s)  # the same answer Trainer.__init__ applied (host GPUs recorded)
    if s.vllm_urls:
        shared = vllm_sampler.VLLMSampler(
            model.config, list(s.vllm_urls), tokenizer, export_dtype=plan.dtype
        )
        # Given URLs are the job's one server group: process 0 pushes the weights.
        if jax.process_count() > 1:
            return distributed.ProcessSyncedSampler(shared, shared=True)
        return shared
    # Start our own servers on the current weights (one per GPU group of the placement); a server
    # that dies is restarted on the latest weights. The model directory, which every step's
    # export then overwrites, lives on tmpfs (/dev/shm) when there is one: a memory copy.
    from jaxrlvr.sampling import weight_export

    model_dir = weight_export.default_export_dir("jaxrlvr-vllm-model-")
    atexit.register(shutil.rmtree, model_dir, ignore_errors=True)
    # Every process gathers the (possibly sharded) weights; each exports for its own servers.
    weights = distributed.host_weights(nnx.state(model, nnx.Param))
    weight_export.export_weights(model.config, weights, model_dir, dtype=plan.dtype)
    tokenizer.save_pretrained(model_dir)
    groups = plan.server_gpus or ((),) * s.vllm_num_servers
    # One log per server; several processes (servers per host) each name theirs.
    stem = "vllm_server" if jax.process_count() == 1 else f"vllm_server_p{jax.process_index()}"
    logs = [
        os.path.join(run_dir, f"{stem}.log" if i == 0 else f"{stem}_{i}.log")
        for i in range(len(groups))
    ]
    prompts.log(
        f"starting {len(groups)} vLLM server(s) on {model_dir}: {plan.describe()} (logs: {logs})"
    )
    servers = [
        vllm_server.VLLMServer(
            model_dir,
            python=s.vllm_python,
            host=s.vllm_host,
            allow_remote_dev_endpoints=s.vllm_allow_remote_dev_endpoints,
            max_model_len=min(s.vllm_max_model_len, model.config.max_position_embeddings),
            dtype=plan.dtype,
            device=plan.device,
            gpus=gpus,
            gpu_memory_utilization=plan.gpu_memory_utilization
            or placement.DEFAULT_GPU_MEMORY_UTILIZATION,
            extra_args=s.vllm_extra_args,
            log_path=log_path,
            start=False,
            # LoRA: the servers keep the base and load each step's adapters (VLLMSampler).
            lora_rank=None if model.config.lora is None else model.config.lora.rank,
        )
        for gpus, log_path in zip(groups, logs)
    ]
    vllm_server.start_servers(servers)
    sampler = vllm_sampler.VLLMSampler(
        model.config,
        servers,
        tokenizer,
        restart_dead_servers=s.vllm_restart,
        export_dir=model_dir,
        export_dtype=plan.dtype,
    )
    # Started servers belong to this process (one server group per host): each process pushes
    # the gathered weights to its own.
    if jax.process_count() > 1:
        return distributed.ProcessSyncedSampler(sampler, shared=False)
    return sampler


def device_split(s: config_lib.SamplerSection) -> tuple[list | None, list | None]:
    """(the trainer's devices, the JAX sampler's devices): with ``sampler.jax_devices`` = S > 0
    (JAX sampler only) the last S devices of the host sample, the others train; else (None, None):
    both use every device. ``preflight.check_sampler_devices`` checked the trainer keeps one."""
    if s.kind != "jax" or s.jax_devices == 0:
        return None, None
    devices = jax.devices()
    return devices[: -s.jax_devices], devices[-s.jax_devices :]


def data_shards(cfg: config_lib.TrainConfig, mesh) -> tuple[int, range]:
    """(the run's number of data shards, the shards this process reads): ``data.shards``, by
    default one per process row block (``step.process_row_block``), as
    ``preflight.check_data_shards`` checked it."""
    block, blocks = step_lib.process_row_block(mesh)
    n = cfg.data.shards or blocks
    return n, shards.owned(n, block, blocks)


def build_reward_fn(cfg: config_lib.TrainConfig) -> verifiers.RewardFn:
    """The reward function of ``reward.fn`` (picklable: the grading pool's workers run it), with
    the language-consistency reward when ``reward.language.weight`` > 0.

    ``reward.fn: code`` checks here that the sandbox starts (a one-line error naming
    ``reward.sandbox`` when bubblewrap is missing) and warns when ``reward.sandbox`` is none.
    """
    r = cfg.reward
    if r.fn != "code":
        fn = verifiers.make_reward_fn(
            verifiers.RewardConfig(name=r.fn, format_weight=r.format_weight)
        )
        return language.with_language_reward(fn, r.language)
    if r.sandbox == "none":
        prompts.log("WARNING: reward.sandbox=none: model-written code runs WITHOUT a sandbox")
    try:
        sandbox.check_available(r.code.sandbox(r.sandbox))
    except sandbox.SandboxUnavailable as exc:
        raise configlib.ConfigKeyError(str(exc)) from None
    fn = code.make_code_reward_fn(r.code, sandbox_kind=r.sandbox, format_weight=r.format_weight)
    return language.with_language_reward(fn, r.language)


def build_grader(cfg: config_lib.TrainConfig) -> grading.Grader:
    """The run's ``Grader``: ``reward``'s verifier (``build_reward_fn``) in a grading pool that
    runs it time-bounded (a code reward's per-call bound covers its tests' limits); for a
    ``data.mixture``, each problem graded by its source's verifier
    (``verifiers.domain_reward_fn``) within the longest of the sources' bounds, on
    ``reward.num_workers`` workers."""
    mixture = cfg.data.mixture
    if mixture:
        fns = {
            m.domain: build_reward_fn(dataclasses.replace(cfg, reward=m.reward)) for m in mixture
        }
        reward_fn = functools.partial(verifiers.domain_reward_fn, fns=fns)
    else:
        reward_fn = build_reward_fn(cfg)
    timeout_s = max(
        code.grader_timeout_s(r.code, r.timeout_s) if r.fn == "code" else r.timeout_s
        for r in ([m.reward for m in mixture] or [cfg.reward])
    )
    pool = grading.GradingPool(num_workers=cfg.reward.num_workers, timeout_s=timeout_s)
    return grading.Grader(reward_fn, pool, by_domain=bool(mixture))
