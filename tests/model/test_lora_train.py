"""LoRA through the driver and the checkpoints: ``model.lora`` in a config trains only the
adapters in both phases (SFT warm start and GRPO), checkpoints restore a LoRA state exactly, and
``jaxrlvr export`` writes the merged model plus the PEFT adapter.

Tolerance: the exported merged model against our adapted forward, 1e-4 on float32 logits of
order 1 (transformers' float32 forward vs ours, as in test_parity; merging changes only the
summation order).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import runs
from flax import nnx

from jaxrlvr import checkpoint
from jaxrlvr import model as M
from jaxrlvr.algos import algorithm, optim, sft
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.model import lora, peft


@pytest.mark.slow  # one tiny SFT + GRPO run and an export: ~40 s on the loaded 2-core machine
def test_lora_run_trains_adapters_only_and_exports_merged_and_peft(tmp_path):
    run_dir = tmp_path / "run"
    runs.jaxrlvr(
        "train",
        "configs/demo.yaml",
        f"run.out_dir={run_dir}",
        "sft.steps=2",
        "rl.steps=2",
        "eval.every=2",
        "checkpoint.every=2",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "model.lora.targets=[q_proj,v_proj,up_proj]",
        "sft.optim.learning_rate=1e-2",
        "optim.learning_rate=1e-2",
        *runs.TINY,
    )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(x["nonfinite"] == 0 for x in lines if "nonfinite" in x)

    # The checkpoint's base is the seed's initial model, bit for bit; the adapters moved.
    with checkpoint.Checkpointer(run_dir / "checkpoints") as ckpt:
        step, extra = ckpt.restore_extra()
        arrays = ckpt.read_arrays(step)["state"]
    assert step == 4
    cfg = M.ModelConfig.from_hf_config(
        extra["model_config"],
        lora=lora.LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj")),
    )
    init = nnx.state(M.init_model(cfg, seed=0), nnx.Param)
    saved = arrays["params"]
    for path, var in nnx.to_flat_state(init):
        got = saved
        for key in path:
            got = got[key]
        got = np.asarray(got["value"] if isinstance(got, dict) else got)
        if isinstance(var, lora.LoRAParam):
            if path[-1] == "lora_b":
                assert np.abs(got).max() > 0, path  # B starts at zero: trained
        else:
            np.testing.assert_array_equal(got, np.asarray(var.get_value()), err_msg=str(path))
    # Optimiser moments exist for the adapters only.
    moments = sum(x.size for x in jax.tree.leaves(arrays["opt_state"]) if np.ndim(x) > 0)
    assert moments == 2 * lora.num_adapter_params(init)

    out = tmp_path / "hf"
    runs.jaxrlvr("export", str(run_dir), str(out))
    import torch
    import transformers

    record = json.loads((out / "jaxrlvr_export.json").read_text())
    assert record["merged_lora"] and os.path.isdir(record["adapter"])
    assert peft.read_config(record["adapter"], 1).targets == ("q_proj", "v_proj", "up_proj")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids)).logits.numpy()
    full = nnx.merge_state(
        lora.base(init),
        jax.tree.map(
            jnp.asarray,
            nnx.from_flat_state(
                {p: v.replace(_leaf(saved, p)) for p, v in nnx.to_flat_state(lora.adapters(init))}
            ),
        ),
    )
    graphdef, _ = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    ours = np.asarray(nnx.merge(graphdef, full)(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return np.asarray(tree["value"] if isinstance(tree, dict) else tree)


def test_checkpoint_restores_a_lora_state_exactly(tmp_path):
    """A LoRA train state (frozen base, adapters, adapter-only AdamW state) saved and restored
    into its abstract state: every array equal, and the next update from the restored state
    equals the next update from the original, bit for bit."""
    cfg = M.ModelConfig.tiny(lora=lora.LoRAConfig(rank=2, alpha=4.0, targets=("k_proj",)))
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    algo = sft.sft_algorithm(graphdef, optim.OptimizerConfig(learning_rate=1e-2))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (4, 8)).astype(np.int32)
    rollouts = batch_lib.Batch(
        input_ids=ids,
        attention_mask=np.ones((4, 8), np.int32),
        labels=np.roll(ids, -1, axis=1),
        loss_mask=np.ones((4, 8), np.float32),
    )
    batch, _ = algo.prepare(None, algorithm.select_fields(rollouts, algo.rollout_spec))
    update = jax.jit(algo.update)
    state, _ = update(algo.init(params, 0), batch)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, {})
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        restored, _ = ckpt.restore(1, checkpoint.abstract_like(state, sharding))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert lora.has_adapters(restored.params)
    # Copies: the next updates consume their states.
    one, _ = update(jax.tree.map(jnp.copy, state), batch)
    two, _ = update(restored, batch)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
