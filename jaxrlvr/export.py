"""``jaxrlvr export``: a run's checkpointed policy as a Hugging Face folder
(``export_checkpoint``; the policy restored by ``assembly.restore_policy``, as eval and pairs
restore theirs).

Only the run directory is read (its checkpoints, config.yaml and the tokenizer): no data, graders
or Hugging Face weights are loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os

import yaml
from flax import nnx

from jaxrlvr import assembly, builders, configlib
from jaxrlvr import config as config_lib
from jaxrlvr import model as model_lib
from jaxrlvr.model import peft

# Where ``export_checkpoint`` writes a LoRA run's adapters (PEFT layout) inside OUT_DIR.
ADAPTER_SUBDIR = "adapter"


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
    step, model = assembly.restore_policy(cfg, run_dir, _single_host_mesh(), tokenizer, step=step)
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
