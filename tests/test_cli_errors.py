"""User mistakes at the command line end in one line on stderr and a non-zero status, with no
traceback, and touch nothing on disk (eval/export without a checkpoint, an export over an earlier
one, an unsafe serve-vllm bind, checkpoint write errors)."""

import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from jaxrlvr import checkpoint, cli
from jaxrlvr import config as config_lib

REPO = pathlib.Path(__file__).parent.parent
DEMO = str(REPO / "configs" / "demo.yaml")


def _main(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_eval_without_a_checkpoint_is_an_error_not_a_fresh_model(tmp_path):
    # In a subprocess: proves there is no traceback and no "starting fresh" evaluation.
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlvr.cli", "eval", DEMO, "--checkpoint", str(run)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        f"jaxrlvr eval: error: --checkpoint {run}: no complete checkpoint in "
        f"{run / 'checkpoints'}\n"
    )
    assert proc.stdout == ""
    assert os.listdir(run) == ["checkpoints"] and os.listdir(run / "checkpoints") == []


def test_eval_checkpoint_dir_missing(tmp_path, capsys):
    code, out, err = _main(capsys, "eval", DEMO, "--checkpoint", str(tmp_path / "nope"))
    assert (code, out) == (2, "")
    assert err == f"jaxrlvr eval: error: --checkpoint {tmp_path / 'nope'}: no such directory\n"
    assert not (tmp_path / "nope").exists()


def _fake_run(run_dir, steps=(2,)):
    for step in steps:
        (run_dir / "checkpoints" / str(step)).mkdir(parents=True)
    cfg = config_lib.load_config(DEMO)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_lib.config_to_dict(cfg)))


def test_export_errors(tmp_path, capsys):
    run, out_dir = tmp_path / "run", tmp_path / "hf"
    run.mkdir()
    code, _, err = _main(capsys, "export", str(run), str(out_dir))
    assert code == 2
    assert err == (
        f"jaxrlvr export: error: export RUN_DIR {run}: no complete checkpoint in "
        f"{run / 'checkpoints'}\n"
    )
    (run / "checkpoints" / "2").mkdir(parents=True)
    code, _, err = _main(capsys, "export", str(run), str(out_dir))
    assert (code, err) == (
        2,
        f"jaxrlvr export: error: export RUN_DIR {run}: no config.yaml in {run}\n",
    )
    code, _, err = _main(capsys, "export", str(run), str(out_dir), "--step", "9")
    assert err == (
        f"jaxrlvr export: error: export RUN_DIR {run} --step 9: no complete checkpoint for step "
        f"9 in {run / 'checkpoints'} (have [2])\n"
    )
    assert not out_dir.exists()


def test_export_refuses_to_replace_an_earlier_export(tmp_path, capsys):
    run, out_dir = tmp_path / "run", tmp_path / "hf"
    _fake_run(run)
    out_dir.mkdir()
    (out_dir / "config.json").write_text('{"earlier": true}')
    (out_dir / "model.safetensors").write_bytes(b"weights")
    code, _, err = _main(capsys, "export", str(run), str(out_dir))
    assert code == 2
    assert err == (
        f"jaxrlvr export: error: export OUT_DIR {out_dir}: already holds a model (config.json, "
        "model.safetensors); pass --overwrite to replace it\n"
    )
    assert (out_dir / "config.json").read_text() == '{"earlier": true}'
    assert (out_dir / "model.safetensors").read_bytes() == b"weights"


def test_serve_vllm_refuses_a_public_bind(capsys, tmp_path):
    code, out, err = _main(capsys, "serve-vllm", "--model", str(tmp_path), "--host", "0.0.0.0")
    assert code == 2 and out == ""
    assert err == (
        "jaxrlvr serve-vllm: error: --host 0.0.0.0: refusing to expose a dev-mode vLLM server "
        "beyond this machine: its /collective_rpc endpoint runs methods on the workers, so anyone "
        "who can reach the port can run code here; bind 127.0.0.1 (and tunnel, e.g. ssh -L) or "
        "pass --allow-remote-dev-endpoints on a trusted network\n"
    )


@pytest.fixture
def fake_run(monkeypatch):
    from jaxrlvr import train

    calls = []

    def run(cfg, *, resume=False, overwrite=False):
        calls.append({"resume": resume, "overwrite": overwrite})
        return {}

    monkeypatch.setattr(train, "run", run)
    return calls


def test_train_passes_resume_and_overwrite(capsys, fake_run):
    assert _main(capsys, "train", DEMO, "rl.steps=1")[0] == 0
    assert _main(capsys, "sft", DEMO, "--overwrite")[0] == 0
    assert _main(capsys, "train", DEMO, "--resume")[0] == 0
    assert fake_run == [
        {"resume": False, "overwrite": False},
        {"resume": False, "overwrite": True},
        {"resume": True, "overwrite": False},
    ]


def test_checkpoint_error_is_one_line_with_status_1(capsys, monkeypatch):
    from jaxrlvr import train

    def run(cfg, *, resume=False, overwrite=False):
        raise checkpoint.CheckpointError(
            "cannot save step 3 in /x/checkpoints: no space left on device (ENOSPC); the previous "
            "checkpoints (steps [1, 2]) are intact"
        )

    monkeypatch.setattr(train, "run", run)
    code, _, err = _main(capsys, "train", DEMO)
    assert code == 1
    assert err == (
        "jaxrlvr train: error: cannot save step 3 in /x/checkpoints: no space left on device "
        "(ENOSPC); the previous checkpoints (steps [1, 2]) are intact\n"
    )


def test_preflight_error_from_train_is_one_line(capsys, monkeypatch, tmp_path):
    from jaxrlvr import preflight, train

    def run(cfg, *, resume=False, overwrite=False):
        preflight.check(cfg)

    monkeypatch.setattr(train, "run", run)
    # A run directory of the test's own: the demo (README's first command) leaves runs/demo in the
    # checkout, and the run-directory check would answer first.
    out = f"run.out_dir={tmp_path / 'run'}"
    code, _, err = _main(capsys, "train", DEMO, out, "data.train=data/MATH/train.jsonl")
    assert (code, err) == (
        2,
        "jaxrlvr train: error: data.train='data/MATH/train.jsonl': file not found\n",
    )


def _saved_run(tmp_path, *overrides):
    """A run directory as train leaves it after a step: its config.yaml and a metrics line."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = config_lib.load_config(DEMO, [f"run.out_dir={run}", *overrides])
    (run / "config.yaml").write_text(yaml.safe_dump(config_lib.config_to_dict(cfg)))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def _snapshot(path):
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(path.rglob("*"))}


def test_resume_with_another_model_or_method_names_the_keys(capsys, tmp_path):
    """--resume compares the config with the run's config.yaml before anything starts: a change
    of the model's shape or of the method is refused in one line listing the keys (old -> new),
    and the run directory is left exactly as it was."""
    run = _saved_run(tmp_path, "model.hidden_size=64", "rl.algo=grpo")
    before = _snapshot(run)
    code, out, err = _main(
        capsys,
        "train",
        DEMO,
        f"run.out_dir={run}",
        "model.hidden_size=128",
        "rl.algo=ppo",
        "rl.steps=7",
        "--resume",
    )
    assert (code, out) == (2, "")
    assert err == (
        f"jaxrlvr train: error: --resume: the config differs from the run's {run}/config.yaml in "
        "keys that change the checkpointed state or the method: model.hidden_size: 64 -> 128, "
        "rl.algo: 'grpo' -> 'ppo'; resume with the run's values, or start a new run (another "
        "run.out_dir, or --overwrite)\n"
    )
    assert _snapshot(run) == before


def test_resume_reports_harmless_config_changes(tmp_path, capsys):
    from jaxrlvr import preflight, rundir

    run = _saved_run(tmp_path, "rl.steps=5", "eval.every=5")
    cfg = config_lib.load_config(
        DEMO, [f"run.out_dir={run}", "rl.steps=9", "eval.every=3", "optim.learning_rate=3e-5"]
    )
    old_lr = config_lib.load_config(DEMO).optim.learning_rate
    assert old_lr != 3e-5
    assert preflight.check(cfg, resume=True) is cfg
    assert rundir.check_resume_config(cfg) == [
        ("eval.every", 5, 3),
        ("optim.learning_rate", old_lr, 3e-5),
        ("rl.steps", 5, 9),
    ]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"[jaxrlvr] --resume: continuing with config changes from {run}/config.yaml: "
        f"eval.every: 5 -> 3, optim.learning_rate: {old_lr!r} -> 3e-05, rl.steps: 5 -> 9"
    )


def test_prompts_longer_than_the_model_are_refused_before_any_compute(tmp_path):
    """Prompts plus sampler.max_tokens past the model's positions: one line naming the key, the
    split, the longest problem and both numbers, exit 2, and no run file written (the check runs
    before the model is built or a step compiled)."""
    run = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, like a user's laptop
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlvr.cli", "train", DEMO, f"run.out_dir={run}"]
        + ["sampler.max_tokens=60", "rl.steps=1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    code, out, err = proc.returncode, proc.stdout, proc.stderr
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(
        "jaxrlvr train: config error: sampler.max_tokens=60: the longest rendered prompt of "
        "data.train "
        "(problem "
    )
    assert "plus 60 new tokens is" in err
    assert err.endswith(
        "more than the model's max_position_embeddings=64; lower sampler.max_tokens or drop the "
        "longest prompts\n"
    )
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["sampler.vllm_python=/nonexistent/bin/python"],
            "sampler.vllm_python='/nonexistent/bin/python': no such interpreter "
            "(scripts/setup_vllm.sh)",
        ),
        (
            [f"sampler.vllm_python={sys.executable}"],  # the test environment has no vllm
            f"sampler.vllm_python={sys.executable!r}: cannot import vllm (install it with "
            "scripts/setup_vllm.sh)",
        ),
        (
            ["sampler.vllm_urls=[http://127.0.0.1:9]"],  # the discard port: nothing listens
            "sampler.vllm_urls: http://127.0.0.1:9 is not reachable (ConnectError: ",
        ),
        (
            # TEST-NET-1: never an address of this machine
            ["sampler.vllm_host=192.0.2.1", "sampler.vllm_allow_remote_dev_endpoints=true"],
            "sampler.vllm_host='192.0.2.1': a server cannot listen there (",
        ),
    ],
)
def test_what_the_vllm_sampler_needs_is_checked_before_any_compute(
    capsys, monkeypatch, tmp_path, overrides, line
):
    """A vLLM interpreter that does not exist or lacks vllm, servers that do not answer, an
    address nothing can listen on: one line at the start (exit 2), not after the SFT warm
    start; nothing is written to the run directory."""
    if "vllm_host" in overrides[0]:  # this case is about the address: any interpreter passes
        monkeypatch.setattr("jaxrlvr.preflight.check_vllm_python", lambda python, key: None)
    run = tmp_path / "run"
    code, out, err = _main(
        capsys, "train", DEMO, f"run.out_dir={run}", "sampler.kind=vllm", *overrides
    )
    assert (code, out) == (2, "")
    assert err.startswith(f"jaxrlvr train: error: {line}") and err.count("\n") == 1, err
    assert not run.exists() or not any(run.iterdir())


def _problems_file(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = '{"problem": "1 + 1 = ?", "answer": "2"}'


@pytest.mark.parametrize(
    "lines, overrides, line",
    [
        (
            [GOOD, GOOD, '{"problem": "2 + 2 = ?", "answer": 4', GOOD],
            ["data.on_bad_row=raise"],
            "line 3 is not JSON (Expecting ',' delimiter) (data.on_bad_row=raise)",
        ),
        (
            [GOOD, "[1, 2]", GOOD],
            ["data.on_bad_row=raise"],
            "line 2 is not a JSON object (data.on_bad_row=raise)",
        ),
        ([], [], "no rows (empty file)"),
        (["{oops", "", "not json"], [], "no rows (2 malformed lines)"),
        (
            [GOOD] * 3,
            ["rl.prompts_per_step=4", "sft.steps=0"],
            None,  # a file that cannot fill one step
        ),
        (  # rows without the question column, and too few of them: the column is named first
            ['{"question": "1 + 1 = ?", "answer": "2"}'] * 3,
            ["rl.prompts_per_step=4", "sft.steps=0"],
            "no row has the question column data.question_field='problem' "
            "(columns: ['answer', 'question'])",
        ),
    ],
)
def test_bad_data_files_are_one_line_before_any_compute(capsys, tmp_path, lines, overrides, line):
    """A malformed line (with data.on_bad_row=raise), an empty file, a file of malformed lines,
    a file with fewer rows than one step: one line naming the key, the file and the line, exit 2,
    and no run file written: never a datasets traceback after the warm start."""
    data = _problems_file(tmp_path / "train.jsonl", lines)
    run = tmp_path / "run"
    code, out, err = _main(
        capsys, "train", DEMO, f"run.out_dir={run}", f"data.train={data}", *overrides
    )
    assert (code, out) == (2, "")
    if line is None:
        line = (
            "data.train: 3 rows, fewer than one batch of rl.prompts_per_step=4; add rows or "
            "lower rl.prompts_per_step"
        )
    else:
        line = f"data.train={str(data)!r}: {line}"
    assert err == f"jaxrlvr train: error: {line}\n"
    assert not run.exists() or not any(run.iterdir())


def test_malformed_lines_are_skipped_and_counted_by_default(capsys, tmp_path):
    """data.on_bad_row=skip (the default): a malformed line costs its row, is named once at the
    start, and the other rows load."""
    from jaxrlvr import builders, preflight

    data = _problems_file(tmp_path / "train.jsonl", [GOOD, "{oops", GOOD, '"a string"', GOOD])
    cfg = config_lib.load_config(
        DEMO,
        [
            f"run.out_dir={tmp_path / 'run'}",
            f"data.train={data}",
            "rl.prompts_per_step=3",
            "sft.steps=0",
        ],
    )
    preflight.check(cfg)
    assert capsys.readouterr().err == (
        f"[jaxrlvr] data.train={str(data)!r}: skipping 2 malformed lines (line 2, 4)\n"
    )
    train, _ = builders.load_splits(cfg)
    assert [p.question for p in train] == ["1 + 1 = ?"] * 3
    assert "malformed_line" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        ("sampler.max_tokens=0", "max_tokens must be an int >= 1, got 0"),
        ("sampler.eval_max_tokens=0", "eval_max_tokens must be an int >= 1, got 0"),
        ("sampler.top_p=0", "top_p must be in (0, 1], got 0.0"),
        ("sampler.eval_temperature=-1", "eval_temperature must be a finite number >= 0, got -1.0"),
    ],
)
def test_sampling_settings_are_checked_when_the_config_is_read(capsys, tmp_path, override, message):
    """Sampling settings the sampler would refuse fail when the config is read, not after the
    SFT warm start (where the first evaluation would have built them)."""
    code, out, err = _main(capsys, "train", DEMO, f"run.out_dir={tmp_path / 'run'}", override)
    assert (code, out, err) == (2, "", f"jaxrlvr train: config error: sampler: {message}\n")
    assert not (tmp_path / "run").exists()


def test_a_run_dir_nothing_can_be_written_to_is_refused_first(capsys, tmp_path):
    """run.out_dir where no file can be written: one line naming the key, before any compute;
    the preflight probe leaves no directory behind when the run does not start."""
    code, out, err = _main(capsys, "train", DEMO, "run.out_dir=/proc/jaxrlvr-run")
    assert (code, out) == (2, "")
    assert err == (
        "jaxrlvr train: error: run.out_dir='/proc/jaxrlvr-run': cannot write there (No such file "
        "or directory)\n"
    )
    deep = tmp_path / "a" / "b"
    missing = tmp_path / "data.jsonl"
    code, _, err = _main(capsys, "train", DEMO, f"run.out_dir={deep}", f"data.train={missing}")
    assert code == 2 and "file not found" in err
    assert not (tmp_path / "a").exists()


def test_eval_k_beyond_the_samples_and_bad_k_lists_are_one_line(capsys):
    code, out, err = _main(capsys, "eval", DEMO, "--samples", "4", "--k", "1,64")
    assert (code, out) == (2, "")
    assert err == (
        "jaxrlvr eval: config error: eval: pass_k=[1, 64]: 64 is not an integer in "
        "1..samples_per_problem (4)\n"
    )
    code, out, err = _main(capsys, "eval", DEMO, "--maj", "8,x")
    assert (code, out) == (2, "")
    assert err == "jaxrlvr eval: error: --maj must be comma-separated integers, got '8,x'\n"
