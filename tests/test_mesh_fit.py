"""Microbatching that fits the mesh: every microbatch's rows split evenly over the batch shards
('data' x 'fsdp'), checked once with a one-line config error
(``preflight.check_microbatches_fit_mesh``)
and on every host batch (``step.check_microbatch_split``); the 1.5B recipes fit 1 and 8 devices."""

import glob
import os

import jax
import pytest

from jaxrlvr import assembly, configlib, preflight
from jaxrlvr import config as config_lib
from jaxrlvr import model as M
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import step

CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "configs")
R1_ZERO = os.path.join(CONFIGS, "r1_zero_qwen2.5_math_1.5b.yaml")


def _mesh(fsdp: int, data: int = 1):
    return M.make_mesh(M.MeshConfig(data=data, fsdp=fsdp, tensor=1), jax.devices()[: data * fsdp])


def test_unpacked_rows_that_do_not_divide_are_refused_in_one_line():
    cfg = config_lib.load_config(R1_ZERO, ["rl.packing=false", "rl.microbatches=128"])
    with pytest.raises(configlib.ConfigKeyError) as info:
        preflight.check_microbatches_fit_mesh(cfg, _mesh(8))
    assert str(info.value) == (
        "rl.microbatches=128 x 8 batch shards (mesh.data=1 x mesh.fsdp=8) = 1024 rows do not "
        "divide rl.prompts_per_step x rl.group_size = 256: each microbatch's rows must split "
        "evenly over the batch shards; try rl.microbatches=32"
    )
    assert "\n" not in str(info.value)


def test_packed_rows_beyond_the_rollouts_are_refused():
    cfg = config_lib.load_config(R1_ZERO, ["rl.microbatches=64"])
    with pytest.raises(configlib.ConfigKeyError, match=r"= 512 rows exceed rl.prompts_per_step"):
        preflight.check_microbatches_fit_mesh(cfg, _mesh(4, data=2))


def test_sft_batch_is_checked_too():
    cfg = config_lib.load_config(
        None, ["rl.algo=none", "sft.steps=1", "sft.batch_size=12", "sft.packing=false"]
    )
    with pytest.raises(configlib.ConfigKeyError, match=r"^sft.microbatches=1 x 8 batch shards"):
        preflight.check_microbatches_fit_mesh(cfg, _mesh(8))
    preflight.check_microbatches_fit_mesh(cfg, _mesh(4))  # 12 rows, 4 shards: fits


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "*1.5b.yaml"))))
def test_recipes_use_every_device(path):
    """The 1.5B recipes fit 8 devices as written (2 rows per device per microbatch), and
    1 device too."""
    cfg = config_lib.load_config(path)
    for fsdp in (8, 1):
        preflight.check_microbatches_fit_mesh(cfg, _mesh(fsdp))
    rl = cfg.rl
    if rl.algo != "none":
        assert rl.rollouts_per_step == rl.microbatches * 8 * 2
    else:
        assert cfg.sft.batch_size == cfg.sft.microbatches * 8 * 2


def test_host_batch_check_names_the_multiple():
    step.check_microbatch_split(32, 2, _mesh(8))
    with pytest.raises(batch_lib.BatchError) as info:
        step.check_microbatch_split(24, 2, _mesh(4, data=2))
    assert str(info.value) == (
        "a batch of 24 rows in 2 microbatches does not split over the 8 batch shards "
        "(data=2, fsdp=4): rows must be a multiple of microbatches x 8 = 16"
    )


def test_expert_axis_is_checked_against_the_model():
    """``mesh.expert`` > 1: a MoE whose experts it divides, else one line naming the key."""
    moe = M.ModelConfig.tiny(
        model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16
    )
    assembly.check_expert_mesh(moe, 4)
    with pytest.raises(configlib.ConfigKeyError, match=r"^mesh.expert=3 does not divide"):
        assembly.check_expert_mesh(moe, 3)
    with pytest.raises(configlib.ConfigKeyError, match=r"^mesh.expert=2: expert parallelism"):
        assembly.check_expert_mesh(M.ModelConfig.tiny(), 2)
    assembly.check_expert_mesh(M.ModelConfig.tiny(), 1)
