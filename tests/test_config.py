"""Every YAML in configs/ parses into TrainConfig; overrides and bad keys/values give one-line
errors naming the key."""

import dataclasses
import pathlib

import pytest

from jaxrlvr import config as config_lib
from jaxrlvr import configlib

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "r1_zero_qwen2.5_math_1.5b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_parses(path):
    cfg = config_lib.load_config(str(path))
    assert isinstance(cfg, config_lib.TrainConfig)
    # The resolved config round-trips through its dict form.
    again = configlib.build(config_lib.TrainConfig, config_lib.config_to_dict(cfg))
    assert again == cfg


def test_r1_zero_recipe_values():
    cfg = config_lib.load_config("configs/r1_zero_qwen2.5_math_1.5b.yaml")
    assert cfg.rl.group_size == 8
    assert cfg.rl.rollouts_per_step == 256
    assert cfg.sampler.kind == "vllm"
    assert cfg.sampler.temperature == 1.0
    assert cfg.sampler.max_tokens == 1024
    assert cfg.optim.learning_rate == 1e-5
    assert cfg.optim.max_grad_norm == 1.0
    assert cfg.data.template == "r1_zero"
    assert cfg.reward.fn == "r1_zero"


def test_base_chain_merges_sections():
    cfg = config_lib.load_config("configs/drgrpo_audit_no_length_norm.yaml")
    demo = config_lib.load_config("configs/demo.yaml")
    assert cfg.rl.advantage.scale == "none"
    assert cfg.rl.loss.aggregation == "seq_mean_token_sum_norm"
    # Everything not overridden comes from demo.yaml.
    assert cfg.model == demo.model
    assert cfg.rl.group_size == demo.rl.group_size


def test_dotted_overrides():
    cfg = config_lib.load_config(
        "configs/demo.yaml", ["rl.group_size=4", "rl.loss.clip_eps_high=0.28", "sampler.stop=[]"]
    )
    assert cfg.rl.group_size == 4
    assert cfg.rl.loss.clip_eps_high == 0.28
    assert cfg.sampler.stop == ()
    assert cfg.rl.max_tokens_per_microbatch is None  # a fixed rl.microbatches by default
    budget = config_lib.load_config("configs/demo.yaml", ["rl.max_tokens_per_microbatch=4096"])
    assert budget.rl.max_tokens_per_microbatch == 4096
    sep = config_lib.load_config("configs/demo.yaml", ["rl.ppo.trunk=separate"])
    assert sep.rl.ppo.trunk == "separate"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("rl.group_sise=4", "unknown config key 'rl.group_sise'"),
        ("rl.group_size=four", "rl.group_size='four': expected an integer"),
        ("sampler.kind=tpu", "sampler.kind='tpu': expected one of ['jax', 'vllm']"),
        ("rl.loss.aggregation=sum", "rl.loss.aggregation='sum': expected one of"),
        (
            "rl.ppo.trunk=tied",
            "rl.ppo.trunk='tied': expected one of ['shared', 'detached', 'separate']",
        ),
        ("rl.group_size=1", "group_size=1"),
        ("model.moe_impl=grouped", "model.moe_impl='grouped': expected one of ['auto'"),
        ("nonsense", "expected key=value"),
    ],
)
def test_bad_overrides_are_one_line_errors_naming_the_key(override, fragment):
    with pytest.raises(configlib.ConfigKeyError) as e:
        config_lib.load_config("configs/demo.yaml", [override])
    msg = str(e.value)
    assert fragment in msg
    assert "\n" not in msg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(configlib.ConfigKeyError, match="config file not found"):
        config_lib.load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl: [1, 2\n")
    with pytest.raises(configlib.ConfigKeyError, match="invalid YAML"):
        config_lib.load_config(str(bad))


@pytest.mark.parametrize(
    "override, scan",
    [(None, False), ("model.scan_layers=true", True), ("model.scan_layers=false", False)],
)
def test_model_layer_loop_choice_reaches_the_model(override, scan):
    # model.scan_layers picks lax.scan or the unrolled layer loop (configs/demo.yaml: unrolled; a
    # random model here; load_hf's scan_layers argument is covered by tests/model/test_parity.py).
    from jaxrlvr import builders

    cfg = config_lib.load_config("configs/demo.yaml", [override] if override else [])
    assert cfg.model.scan_layers is scan
    lm = builders.build_model(
        cfg.model, builders.build_tokenizer(cfg.model), mesh=None, seed=cfg.run.seed
    )
    assert lm.config.scan_layers is scan


def test_the_config_is_checked_once_in_one_order_whatever_way_it_is_made():
    # The sections are records: config.check_config runs when the TrainConfig is made, in
    # TrainConfig's field order (sampler before rl), not in the YAML's key order.
    bad_rl = config_lib.RLSection(group_size=1)  # a record: nothing checked yet
    bad_sampler = config_lib.SamplerSection(jax_devices=-1)
    expected = "sampler: sampler.jax_devices=-1: must be >= 0"
    for data in (
        {"rl": {"group_size": 1}, "sampler": {"jax_devices": -1}},
        {"sampler": {"jax_devices": -1}, "rl": {"group_size": 1}},
    ):
        with pytest.raises(configlib.ConfigKeyError) as e:
            configlib.build(config_lib.TrainConfig, data)
        assert str(e.value) == expected
    with pytest.raises(configlib.ConfigKeyError) as e:  # in code: the same line
        config_lib.TrainConfig(rl=bad_rl, sampler=bad_sampler)
    assert str(e.value) == expected
    good = config_lib.TrainConfig()
    with pytest.raises(configlib.ConfigKeyError) as e:  # and through dataclasses.replace
        dataclasses.replace(good, rl=bad_rl)
    assert str(e.value) == "rl: group_size=1: GRPO needs at least 2 samples per prompt"
    # A method's record (rl.<method>, ``algos.registry``) checks itself where YAML builds it: no
    # row of its own here; sections against each other last.
    keys = [key for key, _ in config_lib.SECTION_CHECKS]
    assert not [key for key in keys if key.startswith("rl.")]
    with pytest.raises(configlib.ConfigKeyError) as e:
        configlib.build(config_lib.TrainConfig, {"rl": {"distill": {"kl_coef": -1}}})
    assert str(e.value) == "rl.distill: distill.kl_coef must be >= 0, got -1.0"
    with pytest.raises(configlib.ConfigKeyError) as e:
        configlib.build(
            config_lib.TrainConfig,
            {"env": {"tools": ["python"]}, "rl": {"mask_forced_tokens": False}},
        )
    assert str(e.value).startswith("TrainConfig: env.tools needs rl.mask_forced_tokens=true")


def test_scalerl_demo_is_the_demo_with_the_recipe():
    # configs/scalerl_demo.yaml: the demo task, CISPO, and each ScaleRL switch (docs/scalerl.md).
    cfg = config_lib.load_config("configs/scalerl_demo.yaml")
    cispo = config_lib.load_config("configs/cispo_demo.yaml")
    assert cfg.rl.algo == "cispo" and cfg.data == cispo.data and cfg.sft == cispo.sft
    assert cfg.rl.loss.aggregation == "prompt_mean_token_mean"
    assert cfg.rl.advantage.scale == "batch_std" and cfg.rl.advantage.baseline == "mean"
    assert cfg.model.lm_head_dtype == "float32"
    assert cfg.rl.drop_zero_variance_groups
    assert cfg.rl.retire_pass_rate == 0.9
    assert cfg.rl.packing and cfg.rl.share_prompts


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rl.retire_pass_rate=1.5"], "rl.retire_pass_rate=1.5"),
        (["rl.retire_pass_rate=0.9", "rl.curriculum=true"], "rl.curriculum"),
        (["rl.loss.aggregation=prompt_mean_token_mean", "rl.share_prompts=false"], "share_prompts"),
        (["model.lm_head_dtype=float16"], "model.lm_head_dtype"),
    ],
)
def test_scalerl_switches_are_checked(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_lib.load_config("configs/demo.yaml", overrides)
