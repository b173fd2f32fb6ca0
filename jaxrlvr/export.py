"""A run's policy from its checkpoints: ``restore_policy`` (for eval, export and pairs) and
``export_checkpoint`` (``jaxrlvr export``: a Hugging Face folder).

Only the run directory is read (its checkpoints, config.yaml and the tokenizer): no data, graders
or Hugging Face weights are loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os

import yaml
from flax import nnx

from jaxrlvr import builders, configlib, prompts
from jaxrlvr import checkpoint as checkpoint_lib
from jaxrlvr import config as config_lib
from jaxrlvr import model as model_lib
from jaxrlvr.algos import registry
from jaxrlvr.model import peft

log = prompts.log
# Where ``export_checkpoint`` writes a LoRA run's adapters (PEFT layout) inside OUT_DIR.
ADAPTER_SUBDIR = "adapter"


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
                remat=m.remat,
                scan_layers=m.scan_layers,
                lora=m.lora,
            )
        else:
            model_cfg = builders.model_config(cfg.model, tokenizer)
        graphdef, params_shape = builders.abstract_model(model_cfg, mesh)
        algo = registry.build(checkpoint_method(cfg, extra), cfg, graphdef, params_shape, mesh)
        target.graphdef = graphdef
        return {"state": checkpoint_lib.abstract_state(algo, params_shape, mesh)[0]}

    try:
        restored = ckpt.restore_latest(target, step=step, log=log)
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
    log(f"{purpose} checkpoint step {step} of {run_dir}")
    return model


def _single_host_mesh():
    return model_lib.make_mesh(model_lib.MeshConfig(data=1, fsdp=-1, tensor=1))


def export_checkpoint(run_dir: str, out_dir: str, *, step: int | None = None) -> str:
    """Restores a checkpoint's policy and writes a Hugging Face folder (config, safetensors,
    tokenizer). Reads only the run directory (and the tokenizer): no data, graders or HF load.

    A LoRA run (``model.lora``) writes the merged model there (``W + s A B``: what transformers
    and vLLM load as a plain model) and its adapters in PEFT's layout in ``OUT_DIR/adapter``
    (``base_model_name_or_path``: the run's ``model.path``), for ``peft`` or a vLLM server with
    LoRA on the base model."""
    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = configlib.build(config_lib.TrainConfig, yaml.safe_load(f))
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=run_dir))
    tokenizer = builders.build_tokenizer(cfg.model)
    step, model = restore_policy(cfg, run_dir, _single_host_mesh(), tokenizer, step=step)
    model_lib.save_hf(model, out_dir, tokenizer_src=tokenizer)  # merged when it has adapters
    record = {"run_dir": os.path.abspath(run_dir), "step": step}
    if model.config.lora is not None:
        adapter_dir = os.path.join(out_dir, ADAPTER_SUBDIR)
        peft.save_adapter(
            model.config,
            nnx.state(model, nnx.Param),
            adapter_dir,
            base_model_name_or_path=cfg.model.path,
        )
        record.update(merged_lora=True, adapter=adapter_dir)
    with open(os.path.join(out_dir, "jaxrlvr_export.json"), "w") as f:
        json.dump(record, f)
    return out_dir
