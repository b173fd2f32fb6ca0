"""Writes the trainer's parameters as Hugging Face safetensors for a vLLM server to reload.

A thin caller of `jaxrlvr.model.weights.save_hf_params`, the one HF writer (`save_hf` uses it too),
so what vLLM reads is exactly what a saved checkpoint would hold. What the export adds, for speed
and for vLLM: one ``model.safetensors`` (never split), config.json written only when the directory
has none (every later step writes the weights alone), and a tied model served untied (see
`hf_config_dict`). By default files are written under a temporary name and renamed into place, so a
server (re)starting or reloading at the same moment never sees a half-written file. The default
directory is on tmpfs (/dev/shm) when present: the export is then a memory copy, not a disk write.

``in_place=True`` (what `VLLMSampler.update_weights` uses, every step after the first): when
``DIR/model.safetensors`` already holds exactly the same tensor names, dtypes and shapes, only the
tensor bytes are overwritten, at the offsets the file's own header gives (the header and layout
stay those safetensors wrote); anything else falls back to the full atomic write. Reason, measured
on this project's 2-core VM (Qwen2.5-0.5B shape, float32, 2.5 GB file, ``bench sync`` against a
running vLLM server): a brand-new tmpfs file needs fresh pages every step, and this VM hands freed
pages back to its host (virtio-balloon free page reporting), so each new page costs a fault there
too: the new-file write took 6.0-7.2 s, the in-place overwrite 0.32-0.46 s. tmpfs also holds one
copy instead of two during the write. The price: a reader that opens the file during an in-place
write sees a mix of old and new tensors, so the caller must make sure nobody reads it meanwhile
(`VLLMSampler` holds every server's lock, which its restarts also take, and vLLM's
``reload_weights`` keeps no mapping of the file once it returns: tests/sampling/test_vllm.py).

Time budget per RL step (Qwen2.5-1.5B, 1.54e9 parameters, bf16 export = 3.1 GB): the cast and
device-to-host copy (PCIe, ~10-25 GB/s: ~0.2-0.4 s), the safetensors write to tmpfs (memory speed,
~1-2 s for 3.1 GB) and vLLM's reload from tmpfs (~1-3 s), about 2-5 s in all against a rollout
phase of tens of seconds; float32 doubles the first two. These are estimates from bandwidths, not
GPU measurements; ``jaxrlvr bench sync`` measures the parts on the machine at hand.

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

# safetensors' names for the dtypes an export writes; other dtypes take the full write.
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


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
    in_place: bool = False,
) -> dict[str, float]:
    """Writes `params` as ``DIR/model.safetensors`` (HF names), atomically unless `in_place`.

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
      in_place: overwrite the tensor bytes of an existing ``model.safetensors`` that lists the
        same names, dtypes and shapes (no new file, no rename; see the module docstring): only
        when no reader can open the file during the call.

    Returns:
      timings in seconds: ``to_host_s`` (device -> NumPy in HF layout), ``write_s`` (safetensors +
      rename, or the in-place overwrite) and ``export_s`` (both), plus ``num_params``, ``bytes``
      and ``in_place`` (1.0 when the file was overwritten in place, else 0.0).
    """
    from jaxrlvr.model import weights

    t0 = time.perf_counter()
    file = os.path.join(os.fspath(directory), weights.SAFETENSORS_FILE)
    config_ready = not write_config or os.path.exists(os.path.join(directory, "config.json"))
    if in_place and config_ready and os.path.exists(file):
        tensors = weights.hf_state_dict(cfg, params, dtype=dtype)
        if cfg.tie_word_embeddings:  # served untied, as save_hf_params(untied=True) writes it
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
        t1 = time.perf_counter()
        if overwrite_tensors(file, tensors):
            t2 = time.perf_counter()
            return {
                "to_host_s": t1 - t0,
                "write_s": t2 - t1,
                "export_s": t2 - t0,
                "num_params": float(sum(v.size for v in tensors.values())),
                "bytes": float(sum(v.nbytes for v in tensors.values())),
                "in_place": 1.0,
            }
        del tensors
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
    out["in_place"] = 0.0
    return out


def overwrite_tensors(file: str | os.PathLike, tensors: dict[str, np.ndarray]) -> bool:
    """Overwrites the data of `tensors` inside an existing safetensors `file`, in place.

    Only when the file's header lists exactly these names with the same dtypes and shapes (and the
    file ends where the header says): each tensor's bytes then go to the offsets that header gives,
    so the file stays what safetensors wrote, with new values. Returns False, having written
    nothing, for a missing file or any mismatch (the caller then writes the file anew). Not atomic:
    a concurrent reader may see a mix of old and new tensors.
    """
    try:
        fd = os.open(file, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            return False
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            return False
        try:
            header = json.loads(os.pread(fd, header_len, 8))
        except ValueError:
            return False
        header.pop("__metadata__", None)
        if header.keys() != tensors.keys():
            return False
        spans = []
        for name, arr in tensors.items():
            entry = header[name]
            begin, end = entry["data_offsets"]
            if (
                entry["dtype"] != _SAFETENSORS_DTYPES.get(arr.dtype.name)
                or tuple(entry["shape"]) != arr.shape
                or end - begin != arr.nbytes
                or not arr.flags.c_contiguous
            ):
                return False
            spans.append((begin, arr))
        if 8 + header_len + max((b + a.nbytes for b, a in spans), default=0) != size:
            return False
        base = 8 + header_len
        for begin, arr in sorted(spans, key=lambda s: s[0]):
            data = memoryview(arr.reshape(-1).view(np.uint8))
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], base + begin + done)
        return True
    finally:
        os.close(fd)
