"""Writes the trainer's parameters as Hugging Face safetensors for a vLLM server to reload.

A thin caller of `jaxrlvr.model.weights.save_hf_params`, the one HF writer (`save_hf` uses it too),
so what vLLM reads is exactly what a saved checkpoint would hold. What the export adds, for speed
and for vLLM: one ``model.safetensors`` (never split), config.json written only when the directory
has none (every later step writes the weights alone), and a tied model served untied (see
`hf_config_dict`). Files are written under a temporary name and renamed into place, so a server
(re)starting or reloading at the same moment never sees a half-written file. The default directory
is on tmpfs (/dev/shm) when present: the export is then a memory copy, not a disk write.

Time budget per RL step (Qwen2.5-1.5B, 1.54e9 parameters, bf16 export = 3.1 GB): the cast and
device-to-host copy (PCIe, ~10-25 GB/s: ~0.2-0.4 s), the safetensors write to tmpfs (memory speed,
~1-2 s for 3.1 GB) and vLLM's reload from tmpfs (~1-3 s), about 2-5 s in all against a rollout
phase of tens of seconds; float32 doubles the first two. These are estimates from bandwidths, not
GPU measurements; ``jaxrlvr bench sync`` measures the parts on the machine at hand.

Not here: sending weights over NCCL (vLLM's ``/update_weights`` route), which is the GPU fast path
and lives behind `VLLMSampler.update_weights`.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any


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
    return cfg.to_hf_config(untied=True)


def export_weights(
    cfg: Any,
    params: Any,
    directory: str | os.PathLike,
    *,
    write_config: bool = True,
    dtype: str | None = None,
) -> dict[str, float]:
    """Writes `params` as ``DIR/model.safetensors`` (HF names), atomically.

    Args:
      cfg: the `jaxrlvr.model.config.ModelConfig` of the model.
      params: the NNX parameter `State` (from ``nnx.split(model, nnx.Param, ...)``) or anything
        `hf_state_dict` accepts.
      directory: target directory (created if missing).
      write_config: also write ``config.json`` when the directory has none, so that the directory
        is a loadable model (with the tokenizer taken from elsewhere) for a server restart.
      dtype: the dtype written, which should be the server's (``--dtype``): bfloat16 for a GPU
        server halves the bytes moved and written and spares vLLM a cast at reload; None keeps
        the parameters' storage dtype (float32 for the CPU server).

    Returns:
      timings in seconds: ``to_host_s`` (device -> NumPy in HF layout), ``write_s`` (safetensors +
      rename) and ``export_s`` (both), plus ``num_params`` and ``bytes``.
    """
    from jaxrlvr.model import weights

    t0 = time.perf_counter()
    out = weights.save_hf_params(
        cfg,
        params,
        directory,
        untied=True,  # see hf_config_dict
        config="if_missing" if write_config else "never",
        max_shard_bytes=None,
        dtype=dtype,
    )
    out["export_s"] = time.perf_counter() - t0
    return out
