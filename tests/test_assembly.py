"""``assembly.open_run``: train, eval and pairs open their run the same way, in the same order
(compile cache, backend, preflight in the command's own mode, assembly), and the run's context is
closed at the end however the command ends. Nothing is built: the steps are recorded."""

import pytest

from jaxrlvr import assembly, compile_cache, evaluation, pairs, placement, preflight, train
from jaxrlvr import config as config_lib


class _Ctx:
    def __init__(self, calls):
        self.calls = calls

    def close(self):
        self.calls.append("close")


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(compile_cache, "enable", lambda setting: calls.append("compile_cache"))
    monkeypatch.setattr(placement, "place_trainer", lambda s: calls.append("place") or None)
    monkeypatch.setattr(assembly.distributed, "initialize", lambda d: calls.append("distributed"))
    monkeypatch.setattr(placement, "check_jax_devices", lambda p: calls.append("devices"))

    def check(cfg, *, mode, checkpoint, resume, overwrite):
        calls.append(("preflight", mode, checkpoint, cfg.run.out_dir))
        return cfg

    def assemble(cfg, *, mode, checkpoint):
        calls.append(("assemble", mode, checkpoint))
        raise RuntimeError("stop after assembly")

    monkeypatch.setattr(preflight, "check", check)
    monkeypatch.setattr(assembly, "assemble", assemble)
    return calls


@pytest.mark.parametrize("command", ["train", "eval", "pairs"])
def test_every_command_opens_its_run_the_same_way(recorded, tmp_path, command):
    cfg = config_lib.TrainConfig(run=config_lib.RunConfig(out_dir=str(tmp_path / "cfg_dir")))
    ckpt = None if command == "train" else str(tmp_path / "ckpt_run")
    with pytest.raises(RuntimeError, match="stop after assembly"):
        if command == "train":
            train.run(cfg)
        elif command == "eval":
            evaluation.evaluate_only(cfg, run_dir=ckpt)
        else:
            pairs.build_pairs(cfg, str(tmp_path / "p.jsonl"), pairs.PairsConfig(k=2), run_dir=ckpt)
    out_dir = ckpt or str(tmp_path / "cfg_dir")  # a checkpoint's run directory is the run's
    assert recorded == [
        "compile_cache",
        "place",
        "distributed",
        "devices",
        ("preflight", command, ckpt, out_dir),
        ("assemble", command, ckpt),
    ]


def test_the_context_is_closed_when_the_command_fails(recorded, monkeypatch, tmp_path):
    calls = recorded
    params = object()
    monkeypatch.setattr(assembly, "assemble", lambda cfg, **kw: (_Ctx(calls), params), raising=True)
    cfg = config_lib.TrainConfig(run=config_lib.RunConfig(out_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="the command failed"):
        with assembly.open_run(cfg, mode="eval") as run:
            assert run.cfg is cfg and run.take_params() is params and run.params is None
            raise ValueError("the command failed")
    assert calls[-1] == "close"
