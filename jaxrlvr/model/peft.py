"""LoRA adapters in the PEFT layout: ``adapter_config.json`` + ``adapter_model.safetensors``.

What PEFT's ``save_pretrained`` writes for a ``Qwen2ForCausalLM`` and what ``PeftModel.
from_pretrained`` and vLLM's ``/v1/load_lora_adapter`` read: tensor names
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in] and ``...lora_B.
weight`` [out, r] (the HF module path under ``base_model.model.``, no adapter name), float32,
and a config with ``peft_type: LORA``, ``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules``, ``use_rslora``. Our ``A`` [L, *in, r] and ``B`` [L, r, *out]
(``model.lora``) map onto them per layer by a reshape and a transpose; the per-head axes flatten
in Hugging Face's order (``q_proj``'s out features are heads x head_dim).

Reading refuses, in one line naming the field, what ``model.lora`` does not implement: DoRA,
per-module ranks or alphas (``rank_pattern`` / ``alpha_pattern``), trained biases,
``modules_to_save``, a layer subset, ``fan_in_fan_out``, targets other than the seven
projections. ``target_modules`` may be a list, "all-linear", or a regular expression (PEFT
matches it against the full module name); it must select the same projections in every layer.

Not here: the merged model (``model.lora.merged`` + ``weights.save_hf_params``,
``jaxrlvr export``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrlvr.model import lora as lora_lib
from jaxrlvr.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_GROUP = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


class AdapterError(ValueError):
    """An adapter directory jaxrlvr cannot load exactly."""


def module_name(target: str, layer: int) -> str:
    """The Hugging Face module path of projection ``target`` in decoder layer ``layer``."""
    return f"model.layers.{layer}.{_GROUP[target]}.{target}"


def adapter_config(
    cfg: lora_lib.LoRAConfig, *, base_model_name_or_path: str | None = None
) -> dict[str, Any]:
    """The ``adapter_config.json`` dict of ``cfg`` (PEFT's LoraConfig fields)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.targets),
        "use_rslora": cfg.use_rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _targets_of(spec: Any, num_layers: int, file: str) -> tuple[str, ...]:
    """PEFT's matching rule: a string is "all-linear" or a regex full-matched against each
    module name; a list entry matches a module whose name equals it or ends with "." + it."""
    if isinstance(spec, str) and spec == "all-linear":
        return lora_lib.TARGETS
    if isinstance(spec, str):

        def matches(name):
            return re.fullmatch(spec, name) is not None

    elif isinstance(spec, list | tuple):
        entries = [str(x) for x in spec]
        for e in entries:
            if e.rsplit(".", 1)[-1] not in lora_lib.TARGETS:
                raise AdapterError(
                    f"{file}: target_modules entry {e!r} is not one of {list(lora_lib.TARGETS)}"
                )

        def matches(name):
            return any(name == e or name.endswith("." + e) for e in entries)

    else:
        raise AdapterError(f"{file}: target_modules={spec!r}: expected a list or a string")
    chosen = []
    for t in lora_lib.TARGETS:
        hits = [matches(module_name(t, i)) for i in range(num_layers)]
        if any(hits) and not all(hits):
            raise AdapterError(f"{file}: target_modules={spec!r} selects {t} in some layers only")
        if all(hits):
            chosen.append(t)
    if not chosen:
        raise AdapterError(f"{file}: target_modules={spec!r} selects none of the projections")
    return tuple(chosen)


def read_config(path: str | os.PathLike, num_layers: int) -> lora_lib.LoRAConfig:
    """The ``LoRAConfig`` of an adapter directory; ``AdapterError`` (one line naming the file and
    field) for a setting ``model.lora`` does not implement."""
    file = os.path.join(os.fspath(path), CONFIG_FILE)
    if not os.path.exists(file):
        raise AdapterError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        with open(file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise AdapterError(f"{file}: not valid JSON ({e})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{file}: peft_type={raw.get('peft_type')!r}, expected 'LORA'")
    refused = {
        "use_dora": (raw.get("use_dora"), (None, False)),
        "bias": (raw.get("bias"), (None, "none")),
        "fan_in_fan_out": (raw.get("fan_in_fan_out"), (None, False)),
        "modules_to_save": (raw.get("modules_to_save"), (None, [])),
        "layers_to_transform": (raw.get("layers_to_transform"), (None, [])),
        "rank_pattern": (raw.get("rank_pattern"), (None, {})),
        "alpha_pattern": (raw.get("alpha_pattern"), (None, {})),
    }
    for key, (value, ok) in refused.items():
        if value not in ok:
            raise AdapterError(f"{file}: {key}={value!r} is not supported (expected {ok[-1]!r})")
    targets = _targets_of(raw.get("target_modules"), num_layers, file)
    try:
        return lora_lib.LoRAConfig(
            rank=int(raw["r"]),
            alpha=float(raw.get("lora_alpha", 8)),
            dropout=float(raw.get("lora_dropout", 0.0) or 0.0),
            targets=targets,
            use_rslora=bool(raw.get("use_rslora", False)),
        )
    except KeyError:
        raise AdapterError(f"{file}: no 'r' (the LoRA rank)") from None
    except ValueError as e:
        raise AdapterError(f"{file}: {e}") from None


def _projections(cfg: ModelConfig, params: nnx.State):
    """(target, stack name, its decoder layers, projection sub-state) for every adapted
    projection of ``params``, per layer stack (``ModelConfig.layer_stacks``)."""
    for name, layers in cfg.layer_stacks.items():
        group = params["model"][name]
        for t in lora_lib.TARGETS:
            module = group[_GROUP[t]]
            if t in module and "lora_a" in module[t]:  # a MoE block has no gate_proj etc.
                yield t, name, layers, module[t]


def adapter_state_dict(cfg: ModelConfig, params: nnx.State) -> dict[str, np.ndarray]:
    """PEFT tensor name -> float32 NumPy array of every adapter in ``params`` (one transfer)."""
    if cfg.lora is None:
        raise ValueError("adapter_state_dict: the model has no LoRA adapters (model.lora is None)")
    # Only the adapters leave the device; a plain nested dict (host weights) is read as it is.
    pure = nnx.to_pure_dict(lora_lib.adapters(params)) if isinstance(params, nnx.State) else params
    host = jax.device_get(pure)
    out: dict[str, np.ndarray] = {}
    r = cfg.lora.rank
    for t in cfg.lora.targets:
        for stack, layers in cfg.layer_stacks.items():
            group = host["model"][stack]
            a = np.asarray(group[_GROUP[t]][t]["lora_a"], np.float32)  # [L, *in, r]
            b = np.asarray(group[_GROUP[t]][t]["lora_b"], np.float32)  # [L, r, *out]
            for row, i in enumerate(layers):
                name = PREFIX + module_name(t, i)
                out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[row].reshape(-1, r).T)
                out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[row].reshape(r, -1).T)
    return out


def _atomic_write(path: str, name: str, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, os.path.join(path, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_adapter(
    cfg: ModelConfig,
    params: nnx.State,
    path: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
) -> dict[str, float]:
    """Writes ``params``' adapters as a PEFT adapter directory (each file atomically: a reader
    such as a vLLM server never sees half a file). Returns ``to_host_s``, ``write_s``,
    ``num_params`` and ``bytes``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    t0 = time.perf_counter()
    tensors = adapter_state_dict(cfg, params)
    t1 = time.perf_counter()
    _atomic_write(path, WEIGHTS_FILE, lambda f: save_file(tensors, f, metadata={"format": "pt"}))
    config = adapter_config(cfg.lora, base_model_name_or_path=base_model_name_or_path)

    def write_json(f):
        with open(f, "w") as fh:
            json.dump(config, fh, indent=2)

    _atomic_write(path, CONFIG_FILE, write_json)
    return {
        "to_host_s": t1 - t0,
        "write_s": time.perf_counter() - t1,
        "num_params": float(sum(v.size for v in tensors.values())),
        "bytes": float(sum(v.nbytes for v in tensors.values())),
    }


def load_adapter(path: str | os.PathLike, cfg: ModelConfig, params: nnx.State) -> nnx.State:
    """``params`` with its adapters replaced by those of the PEFT directory ``path`` (each placed
    with the sharding of the leaf it replaces). The directory's config must equal ``cfg.lora``
    in rank, alpha, targets and scaling (build the model from ``read_config`` to load any);
    ``AdapterError`` names the first mismatch or missing / misshapen tensor."""
    path = os.fspath(path)
    theirs = read_config(path, cfg.num_hidden_layers)
    ours = cfg.lora
    if ours is None:
        raise AdapterError(f"{path}: the model has no LoRA adapters (model.lora is None)")
    for key in ("rank", "alpha", "targets", "use_rslora"):
        if getattr(theirs, key) != getattr(ours, key):
            raise AdapterError(
                f"{path}: {key}={getattr(theirs, key)!r} but the model's lora.{key}="
                f"{getattr(ours, key)!r}"
            )
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.exists(file):
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
    flat = dict(nnx.to_flat_state(params))
    with safe_open(file, framework="numpy") as f:
        names = set(f.keys())
        for t, stack, layers, proj in _projections(cfg, params):
            a_var, b_var = proj["lora_a"], proj["lora_b"]
            a_shape, b_shape = a_var.get_value().shape, b_var.get_value().shape
            a_layers, b_layers = [], []
            for i in layers:
                name = PREFIX + module_name(t, i)
                for suffix in ("lora_A.weight", "lora_B.weight"):
                    if f"{name}.{suffix}" not in names:
                        raise AdapterError(f"{file}: missing tensor {name}.{suffix}")
                a = f.get_tensor(f"{name}.lora_A.weight")
                b = f.get_tensor(f"{name}.lora_B.weight")
                want_a = (ours.rank, int(np.prod(a_shape[1:-1])))
                want_b = (int(np.prod(b_shape[2:])), ours.rank)
                if a.shape != want_a or b.shape != want_b:
                    raise AdapterError(
                        f"{file}: {name} lora_A {a.shape} / lora_B {b.shape}, expected "
                        f"{want_a} / {want_b}"
                    )
                a_layers.append(a.T.reshape(a_shape[1:]))
                b_layers.append(b.T.reshape(b_shape[1:]))
            prefix = ("model", stack, _GROUP[t], t)
            for key, var, layers in (("lora_a", a_var, a_layers), ("lora_b", b_var, b_layers)):
                value = np.stack(layers).astype(np.float32)
                old = var.get_value()
                sharding = getattr(old, "sharding", None)
                new = jnp.asarray(value) if sharding is None else jax.device_put(value, sharding)
                flat[prefix + (key,)] = var.replace(new)
    return nnx.from_flat_state(flat)


def load_peft(
    base_path: str | os.PathLike, adapter_path: str | os.PathLike, **load_hf_kwargs
) -> Any:
    """A ``Qwen2ForCausalLM`` of the HF checkpoint ``base_path`` with the PEFT adapter of
    ``adapter_path`` (its ``LoRAConfig`` read from ``adapter_config.json``). Keyword arguments go
    to ``weights.load_hf`` (dtype, param_dtype, mesh, ...)."""
    from jaxrlvr.model import weights

    num_layers = ModelConfig.from_json(base_path).num_hidden_layers
    lora_cfg = read_config(adapter_path, num_layers)
    model = weights.load_hf(base_path, lora=lora_cfg, **load_hf_kwargs)
    graphdef, params = nnx.split(model, nnx.Param)
    return nnx.merge(graphdef, load_adapter(adapter_path, model.config, params))


__all__ = [
    "CONFIG_FILE",
    "PREFIX",
    "WEIGHTS_FILE",
    "AdapterError",
    "adapter_config",
    "adapter_state_dict",
    "load_adapter",
    "load_peft",
    "module_name",
    "read_config",
    "save_adapter",
]
