"""jaxrlvr.preflight: each bad input gives one exact line naming its key; nothing is touched
except by --overwrite, which moves the old run aside intact."""

import json
import os

import pytest

from jaxrlvr import config as config_lib
from jaxrlvr import configlib, hub, preflight, rundir


def _model_dir(path, *, config=True, weights=True, tokenizer=True):
    os.makedirs(path, exist_ok=True)
    if config:
        (path / "config.json").write_text("{}")
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return str(path)


def _cfg(tmp_path, **sections):
    kw = {"run": config_lib.RunConfig(out_dir=str(tmp_path / "run"))}
    kw.update(sections)
    return config_lib.TrainConfig(**kw)


def _model(path, tokenizer=None):
    return config_lib.ModelSection(path=path, tokenizer=tokenizer)


def _data(train="synthetic", eval=None):
    return config_lib.DataSection(train=train, eval=eval)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty hub cache


def _error(cfg, **kw):
    with pytest.raises(configlib.PreflightError) as err:
        preflight.check(cfg, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_valid_local_model_passes_unchanged(tmp_path):
    cfg = _cfg(tmp_path, model=_model(_model_dir(tmp_path / "m")))
    assert preflight.check(cfg) is cfg
    assert not os.path.exists(tmp_path / "run")  # a check creates nothing


def test_hub_id_offline(tmp_path, offline):
    cfg = _cfg(tmp_path, model=_model("Qwen/Qwen2.5-Math-1.5B"))
    assert _error(cfg) == (
        "model.path='Qwen/Qwen2.5-Math-1.5B': not a local directory and the Hugging Face hub "
        "is unreachable (HF_HUB_OFFLINE is set)"
    )


def test_missing_relative_model_dir_as_in_the_shipped_config(tmp_path, offline, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config_lib.load_config(
        os.path.join(os.path.dirname(__file__), "..", "configs", "r1_zero_qwen2.5_math_1.5b.yaml")
    )
    assert _error(cfg) == (
        "model.path='models/Qwen2.5-Math-1.5B': not a local directory and the Hugging Face hub "
        "is unreachable (HF_HUB_OFFLINE is set)"
    )


def test_hub_unreachable_names_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    cfg = _cfg(tmp_path, model=_model("Qwen/Qwen2.5-Math-1.5B"))
    msg = _error(cfg, hub_timeout_s=2.0)
    assert msg.startswith(
        "model.path='Qwen/Qwen2.5-Math-1.5B': not a local directory and the Hugging Face hub "
        "is unreachable (tried http://127.0.0.1:9: ConnectError"
    )


def test_hub_id_found_in_the_local_cache_is_resolved(tmp_path, offline, monkeypatch):
    snapshot = _model_dir(tmp_path / "snap")
    monkeypatch.setattr(hub, "_cached_snapshot", lambda repo: snapshot if repo == "org/m" else None)
    cfg = preflight.check(_cfg(tmp_path, model=_model("org/m")))
    assert (cfg.model.path, cfg.model.tokenizer) == (snapshot, None)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("absent", "model.path='{p}': no such directory"),
        ("config", "model.path='{p}': no config.json in {p}"),
        (
            "weights",
            "model.path='{p}': no *.safetensors weights in {p} (found config.json, tokenizer.json)",
        ),
        ("file", "model.path='{p}': is a file, expected a model directory"),
    ],
)
def test_bad_local_model_dir(tmp_path, kind, expected):
    p = tmp_path / "m"
    if kind == "config":
        _model_dir(p, config=False)
    elif kind == "weights":
        _model_dir(p, weights=False)
    elif kind == "file":
        p.write_text("x")
    assert _error(_cfg(tmp_path, model=_model(str(p)))) == expected.format(p=p)


def test_tokenizer(tmp_path, offline):
    m = _model_dir(tmp_path / "m", tokenizer=False)
    assert _error(_cfg(tmp_path, model=_model(m))) == (
        f"model.path (its tokenizer)='{m}': no tokenizer files in {m} (expected one of "
        "tokenizer.json, tokenizer_config.json, vocab.json, tokenizer.model)"
    )
    tok = tmp_path / "tok"
    tok.mkdir()
    assert _error(_cfg(tmp_path, model=_model(None, str(tok)))).startswith(
        f"model.tokenizer='{tok}': no tokenizer files in {tok}"
    )
    assert _error(_cfg(tmp_path, model=_model(None, "org/tok"))) == (
        "model.tokenizer='org/tok': not a local directory and the Hugging Face hub is "
        "unreachable (HF_HUB_OFFLINE is set)"
    )
    preflight.check(_cfg(tmp_path, model=_model(None, "char")))


def test_data_files(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"problem": "1+1", "answer": "2"}\n')
    missing = str(tmp_path / "MATH" / "validation.jsonl")
    assert _error(_cfg(tmp_path, data=_data("data/MATH/train.jsonl"))) == (
        "data.train='data/MATH/train.jsonl': file not found"
    )
    assert _error(_cfg(tmp_path, data=_data(str(train), missing))) == (
        f"data.eval='{missing}': file not found"
    )
    assert _error(_cfg(tmp_path, data=_data(str(tmp_path)))) == (
        f"data.train='{tmp_path}': is a directory, expected a jsonl/json/parquet file"
    )
    sft = config_lib.SFTSection(steps=2, data="sft.jsonl")
    assert _error(_cfg(tmp_path, data=_data(str(train)), sft=sft)) == (
        "sft.data='sft.jsonl': file not found"
    )
    # eval/export never read sft.data; hub dataset names are left to the loader.
    preflight.check(_cfg(tmp_path, data=_data("gsm8k")))


def _old_run(out_dir):
    os.makedirs(out_dir / "checkpoints" / "44")
    (out_dir / "metrics.jsonl").write_text('{"step": 44}\n')
    (out_dir / "config.yaml").write_text("run: {}\n")
    (out_dir / "notes.txt").write_text("mine")


def test_existing_run_dir_is_refused_without_resume_or_overwrite(tmp_path):
    _old_run(tmp_path / "run")
    cfg = _cfg(tmp_path)
    assert _error(cfg) == (
        f"run.out_dir='{tmp_path / 'run'}' already holds a run (metrics.jsonl, checkpoints/): "
        "pass --resume to continue it or --overwrite to start over (the old run is moved aside)"
    )
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 44}\n'
    assert preflight.check(cfg, resume=True) is cfg
    assert _error(cfg, resume=True, overwrite=True) == (
        "--resume and --overwrite exclude each other: pick one"
    )
    assert sorted(os.listdir(tmp_path / "run")) == [
        "checkpoints",
        "config.yaml",
        "metrics.jsonl",
        "notes.txt",
    ]


def test_overwrite_moves_the_old_run_aside_intact(tmp_path, capsys):
    run = tmp_path / "run"
    _old_run(run)
    for name in ("vllm_server_1.log", "vllm_server_p1.log"):  # further servers', processes'
        (run / name).write_text("log")
    preflight.check(_cfg(tmp_path), overwrite=True)
    names = os.listdir(run)
    moved = [n for n in names if n.startswith("previous-")]
    assert len(moved) == 1 and sorted(names) == sorted([moved[0], "notes.txt"])
    old = run / moved[0]
    assert (old / "metrics.jsonl").read_text() == '{"step": 44}\n'
    assert sorted(os.listdir(old)) == [
        "checkpoints",
        "config.yaml",
        "metrics.jsonl",
        "vllm_server_1.log",
        "vllm_server_p1.log",
    ]
    assert os.listdir(old / "checkpoints") == ["44"]
    assert capsys.readouterr().err == (
        f"[jaxrlvr] --overwrite: moved the previous run in {run} to {old}\n"
    )
    # A failed check moves nothing.
    _old_run(tmp_path / "run2")
    cfg = _cfg(
        tmp_path,
        run=config_lib.RunConfig(out_dir=str(tmp_path / "run2")),
        data=_data("missing.jsonl"),
    )
    _error(cfg, overwrite=True)
    assert os.path.isfile(tmp_path / "run2" / "metrics.jsonl")


def test_eval_and_export_need_a_complete_checkpoint(tmp_path):
    cfg = _cfg(tmp_path)
    run = tmp_path / "old"
    assert _error(cfg, mode="eval", checkpoint=str(run)) == f"--checkpoint {run}: no such directory"
    os.makedirs(run / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000")  # a killed save
    assert _error(cfg, mode="eval", checkpoint=str(run)) == (
        f"--checkpoint {run}: no complete checkpoint in {run / 'checkpoints'}"
    )
    os.makedirs(run / "checkpoints" / "2")
    assert preflight.check(cfg, mode="eval", checkpoint=str(run)) is cfg
    assert preflight.check(cfg, mode="eval") is cfg  # eval of model.path needs no checkpoint
    assert _error(cfg, mode="export", checkpoint=str(run), step=3) == (
        f"export RUN_DIR {run} --step 3: no complete checkpoint for step 3 in "
        f"{run / 'checkpoints'} (have [2])"
    )
    assert _error(cfg, mode="eval", resume=True) == (
        "eval: --resume/--overwrite apply to train and sft only"
    )


def test_complete_steps_agrees_with_orbax(tmp_path):
    import jax.numpy as jnp

    from jaxrlvr import checkpoint

    ckpt = checkpoint.Checkpointer(tmp_path, keep=5)
    for step in (1, 5):
        ckpt.save(step, {"x": jnp.ones(3)}, {"s": json.dumps(step)})
    os.makedirs(tmp_path / "7.orbax-checkpoint-tmp-123")
    assert rundir.complete_steps(str(tmp_path)) == ckpt.all_steps() == [1, 5]


def test_writable_dir_probe_survives_another_process_removing_the_new_folder(tmp_path, monkeypatch):
    """Two processes of one run probe the same new out_dir; the other one's clean-up can remove
    the folder between this one's makedirs and its probe (CI saw 'cannot write there (No such file
    or directory)'). The probe makes it again; a folder that stays unwritable is still refused."""
    import tempfile

    real = tempfile.NamedTemporaryFile
    target = tmp_path / "new" / "run"
    calls = []

    def racing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the other process's rmdir lands here
            os.rmdir(target)
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", racing)
    rundir.check_writable_dir(str(target), "run.out_dir")
    assert len(calls) == 2 and not (tmp_path / "new").exists()  # disk left as it was

    def always_gone(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", always_gone)
    with pytest.raises(configlib.PreflightError, match="run.out_dir=.*cannot write there"):
        rundir.check_writable_dir(str(target), "run.out_dir")


def test_sampler_devices_leave_the_trainer_one():
    """``sampler.jax_devices`` takes devices from the trainer: all of them is refused in one line
    (assembly runs this before ``builders.device_split``, which checks nothing)."""
    s = config_lib.SamplerSection(kind="jax", jax_devices=4)
    preflight.check_sampler_devices(s, 5)
    with pytest.raises(configlib.ConfigKeyError) as err:
        preflight.check_sampler_devices(s, 4)
    assert str(err.value) == (
        "sampler.jax_devices=4: the host has 4 devices, and the trainer needs at least one"
    )


def test_cosine_schedule_must_cover_every_epoch():
    """With 2 epochs per RL step a cosine over rl.steps updates would end half-way: refused in
    one line naming the keys; total_steps = steps x epochs, a constant schedule and 1 epoch
    pass."""
    over = ["rl.steps=200", "rl.epochs_per_step=2", "optim.schedule=cosine"]
    cfg = config_lib.load_config("configs/demo.yaml", [*over, "optim.total_steps=200"])
    with pytest.raises(configlib.PreflightError) as err:
        preflight.check_schedule_covers_epochs(cfg)
    assert str(err.value) == (
        "optim.total_steps=200 counts optimiser updates: rl.steps=200 x rl.epochs_per_step=2 = "
        "400, so the cosine schedule would reach its final rate at RL step 100; "
        "set optim.total_steps=400"
    )
    for ok in (
        ["optim.total_steps=400"],
        ["optim.total_steps=200", "optim.schedule=constant"],
        ["optim.total_steps=200", "rl.epochs_per_step=1"],
    ):
        preflight.check_schedule_covers_epochs(
            config_lib.load_config("configs/demo.yaml", [*over, *ok])
        )
