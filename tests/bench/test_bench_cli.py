"""Every ``jaxrlvr bench NAME`` names itself and spells the shared flags the same way."""

import importlib

import pytest

BENCHMARKS = ("forward", "memory", "ops", "rewards", "sampler", "sync", "update")


def _help(name: str, capsys) -> str:
    module = importlib.import_module(f"jaxrlvr.bench.{name}")
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", BENCHMARKS)
def test_help_names_the_command_and_offers_json(name, capsys):
    out = _help(name, capsys)
    assert out.startswith(f"usage: jaxrlvr bench {name} ")
    assert "--json PATH" in out or "--json JSON" in out


def test_shared_flags_have_one_spelling(capsys):
    helps = {name: _help(name, capsys) for name in BENCHMARKS}
    for name in ("sampler", "sync"):
        assert "--vllm-python" in helps[name]
    for name, out in helps.items():
        assert "--python " not in out and "--steps" not in out, name
    for name in ("forward", "sampler", "sync", "update"):
        assert "--repeats" in helps[name]


def test_sync_without_a_vllm_python_names_the_flag(monkeypatch, capsys):
    from jaxrlvr.bench import sync

    monkeypatch.delenv("JAXRLVR_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit) as info:
        sync.main([])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "jaxrlvr bench sync: error: need --vllm-python or env JAXRLVR_VLLM_PYTHON" in err


@pytest.mark.parametrize(
    "name, argv, says",
    [
        ("forward", ["--shapes", "huge"], "--shapes: 'huge' is not one of moe, small, tiny"),
        ("forward", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        ("update", ["--systems", "jax"], "--systems: 'jax' is not one of jaxrlvr, torch"),
        ("sync", ["--vllm-python", "py", "--shapes", "1b"], "--shapes: '1b' is not one of"),
        ("memory", ["--attention-chunk", "0"], "--attention-chunk=0: must be a positive integer"),
        ("memory", ["--moe-impl", "grouped"], "argument --moe-impl: invalid choice: 'grouped'"),
    ],
)
def test_bad_flags_are_named(name, argv, says, capsys):
    module = importlib.import_module(f"jaxrlvr.bench.{name}")
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"jaxrlvr bench {name}: error: {says}" in err


def test_worker_env_drops_only_the_fake_devices(monkeypatch):
    """Bench workers get one CPU device (the tests' 8 fake devices dropped) but keep the other
    XLA flags (the suite's -O0 backend, a user's own)."""
    from jaxrlvr.bench import common

    fake = "--xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", f"--xla_backend_optimization_level=0 {fake}")
    assert common.worker_env()["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    monkeypatch.setenv("XLA_FLAGS", fake)
    assert "XLA_FLAGS" not in common.worker_env()


def test_memory_offers_every_moe_kernel():
    """``bench memory --moe-impl`` takes every ``model.moe_impl`` kernel (its list is spelled
    out so the command line parses without JAX): "auto" alone is left out, it would pick this
    host's kernel rather than the accelerator's the memory is asked for."""
    import typing

    from jaxrlvr.bench import memory
    from jaxrlvr.model import config

    assert set(memory.MOE_IMPLS) == set(typing.get_args(config.MoEImpl)) - {"auto"}
