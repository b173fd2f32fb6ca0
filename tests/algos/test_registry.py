"""The method registry: every method's module registers itself, and the config's choices, the
"unknown method" error, async support, state keys and method sections are read from it."""

import dataclasses

import pytest

from jaxrlvr import config as config_lib
from jaxrlvr import configlib
from jaxrlvr.algos import distill, ppo, registry


def test_the_config_reads_its_choices_from_the_registry():
    names = registry.methods()
    # Each module registered itself; "sft" is a phase's method, not an rl.algo choice.
    assert {"grpo", "ppo", "distill", "expert_iteration", "dpo", "orpo", "sft"} <= set(names)
    assert "sft" not in registry.rl_choices() and registry.rl_choices()[-1] == "none"
    with pytest.raises(configlib.ConfigKeyError) as e:
        config_lib.load_config(None, ["model.tokenizer=char", "rl.algo=gpro"])
    assert str(e.value) == (
        f"rl: rl.algo='gpro': no such method; expected one of {list(registry.rl_choices())}"
    )
    # A method's record is the section YAML builds (no copy in config.py).
    assert registry.sections()["ppo"] is ppo.PPOConfig
    assert registry.sections()["distill"] is distill.DistillConfig
    hints = {f.name: f.type for f in dataclasses.fields(config_lib.RLSection)}
    assert hints["ppo"] is ppo.PPOConfig and hints["distill"] is distill.DistillConfig
    cfg = config_lib.load_config(None, ["model.tokenizer=char", "rl.distill.teacher=t"])
    assert isinstance(cfg.rl.distill, distill.DistillConfig)
    assert cfg.rl.distill.sources == {"default": "t"}


def test_async_support_and_state_keys_come_from_the_registrations():
    assert set(registry.asynchronous()) >= {"grpo", "ppo", "distill", "expert_iteration"}
    assert "dpo" not in registry.asynchronous()
    with pytest.raises(configlib.ConfigKeyError, match=r"not rl.algo='dpo'$"):
        config_lib.load_config(None, ["model.tokenizer=char", "rl.algo=dpo", "rl.max_staleness=1"])
    assert {"rl.ppo.", "rl.loss.kl_coef"} <= set(registry.state_keys())
    with pytest.raises(ValueError, match="is registered twice"):
        registry.register(dataclasses.replace(registry.get("grpo"), asynchronous=False))
    with pytest.raises(ValueError, match="method 'nope' is not registered"):
        registry.get("nope")
