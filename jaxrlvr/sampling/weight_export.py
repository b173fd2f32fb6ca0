"""Writes the trainer's parameters as Hugging Face safetensors for a vLLM server to reload.

Names come from `jaxrlvr.model.weights.hf_state_dict`, the same map `save_hf` uses, so what vLLM
reads is exactly what a saved checkpoint would hold. The file is written under a temporary name
and renamed into place, so a server (re)starting or reloading at the same moment never sees a
half-written file. The default directory is on tmpfs (/dev/shm) when present: the export is then
a memory copy, not a disk write.

Not here: sending weights over NCCL (vLLM's ``/update_weights`` route), which is the GPU fast path
and lives behind `VLLMSampler.update_weights`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import numpy as np
import safetensors.numpy

WEIGHTS_FILE = "model.safetensors"


def default_export_dir(prefix: str = "jaxrlvr-weights-") -> str:
    """A fresh directory on tmpfs (/dev/shm) when there is one, else in the temp dir."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def hf_config_dict(cfg: Any) -> dict:
    """The config.json a vLLM server gets for `cfg`: the model's HF config, always UNTIED.

    vLLM 0.32's in-place ``reload_weights`` rebuilds the embedding parameter and loses its tie
    with ``lm_head``: a tied model keeps serving logits from the embedding it was started with
    (measured here: log-prob gaps up to 7e-3 after a few updates, against 5e-7 untied). Serving
    the model untied, with ``lm_head.weight`` written as a copy of the embedding, gives the same
    logits and reloads both matrices.
    """
    hf = dict(cfg.to_hf_config())
    hf.setdefault("architectures", ["Qwen2ForCausalLM"])
    hf.setdefault("model_type", "qwen2")
    hf["tie_word_embeddings"] = False
    return hf


def export_weights(
    cfg: Any, params: Any, directory: str | os.PathLike, *, write_config: bool = True
) -> dict[str, float]:
    """Writes `params` as ``DIR/model.safetensors`` (HF names), atomically.

    Args:
      cfg: the `jaxrlvr.model.config.ModelConfig` of the model.
      params: the NNX parameter `State` (from ``nnx.split(model, nnx.Param, ...)``) or anything
        `hf_state_dict` accepts.
      directory: target directory (created if missing).
      write_config: also write ``config.json`` when the directory has none, so that the directory
        is a loadable model (with the tokenizer taken from elsewhere) for a server restart.

    Returns:
      timings in seconds: ``to_host_s`` (device -> NumPy in HF layout), ``write_s`` (safetensors +
      rename) and ``export_s`` (both), plus ``num_params`` and ``bytes``.
    """
    from jaxrlvr.model import weights

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    tensors = weights.hf_state_dict(cfg, params)
    if cfg.tie_word_embeddings:  # served untied: see hf_config_dict
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    # safetensors wants C-contiguous host arrays; np.ascontiguousarray is a no-op when they are.
    tensors = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}
    t1 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(directory, WEIGHTS_FILE))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    config_path = os.path.join(directory, "config.json")
    if write_config and not os.path.exists(config_path):
        with open(config_path + ".tmp", "w") as f:
            json.dump(hf_config_dict(cfg), f, indent=2)
        os.replace(config_path + ".tmp", config_path)
    t2 = time.perf_counter()
    return {
        "to_host_s": t1 - t0,
        "write_s": t2 - t1,
        "export_s": t2 - t0,
        "num_params": float(sum(v.size for v in tensors.values())),
        "bytes": float(sum(v.nbytes for v in tensors.values())),
    }
