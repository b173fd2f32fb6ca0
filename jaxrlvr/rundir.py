"""A run's directory: where a run lives, what makes a folder hold one, its checkpoints, and
``--resume`` / ``--overwrite`` against what is already there.

``check_run_dir`` refuses to start a new run where one already lives (unless resume or
overwrite) and a folder nothing can be written to; ``move_run_aside`` is ``--overwrite``'s
side effect (the old run's files into ``out_dir/previous-<UTC time>/``, nothing deleted), so two
runs never share one metrics file or checkpoint directory; ``check_checkpoint`` finds a complete
checkpoint without opening orbax; ``check_resume_config`` compares the config with the run's
saved ``config.yaml``. Errors are one line naming the key or flag (``configlib.PreflightError``).
``preflight.check`` runs these for a command; not here: what a run reads (``preflight``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import time

from jaxrlvr import config as config_lib
from jaxrlvr import configlib
from jaxrlvr.algos import registry

# Files and folders of a run in out_dir (written by train.py, metrics.py and the vLLM launcher).
RUN_ENTRIES = (
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "checkpoints",
    "plots",
    "tb",
    "vllm_model",
    "vllm_server.log",
)


def complete_steps(checkpoint_dir: str) -> list[int]:
    """Steps of complete checkpoints in ``checkpoint_dir`` (orbax names a committed step by its
    number; partial saves live in ``<step>.orbax-checkpoint-tmp-*``), without opening orbax."""
    if not os.path.isdir(checkpoint_dir):
        return []
    steps = []
    for name in os.listdir(checkpoint_dir):
        if name.isdigit() and os.path.isdir(os.path.join(checkpoint_dir, name)):
            steps.append(int(name))
    return sorted(steps)


def check_checkpoint(run_dir: str, flag: str = "--checkpoint", step: int | None = None) -> int:
    """``run_dir/checkpoints`` holds a complete checkpoint (``step`` if given); returns its step."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(run_dir):
        raise configlib.PreflightError(f"{flag} {run_dir}: no such directory")
    steps = complete_steps(ckpt_dir)
    if not steps:
        raise configlib.PreflightError(f"{flag} {run_dir}: no complete checkpoint in {ckpt_dir}")
    if step is not None and step not in steps:
        raise configlib.PreflightError(
            f"{flag} {run_dir} --step {step}: no complete checkpoint for step {step} in "
            f"{ckpt_dir} (have {steps})"
        )
    return steps[-1] if step is None else step


def existing_run(out_dir: str) -> list[str]:
    """The entries that make ``out_dir`` hold a run: metrics, summary or checkpoints."""
    held = []
    for name in ("metrics.jsonl", "summary.json"):
        if os.path.isfile(os.path.join(out_dir, name)):
            held.append(name)
    ckpt = os.path.join(out_dir, "checkpoints")
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        held.append("checkpoints/")
    return held


def check_writable_dir(path: str, key: str) -> None:
    """A file can be written in ``path`` (created if missing). Leaves the disk as it was: the
    probe file and the directories made for it are removed."""
    import tempfile

    made, parent = [], os.path.abspath(path)
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        # Another process of the same run may probe the same new folder and remove it between
        # our makedirs and our probe (ENOENT): make it again, a few times, before calling it
        # unwritable.
        for attempt in range(5):
            os.makedirs(path, exist_ok=True)
            try:
                with tempfile.NamedTemporaryFile(dir=path, prefix=".jaxrlvr-probe-"):
                    pass
                break
            except FileNotFoundError:
                if attempt == 4:
                    raise
    except OSError as e:
        raise configlib.PreflightError(
            f"{key}={path!r}: cannot write there ({e.strerror or e})"
        ) from None
    finally:
        for directory in made:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def check_run_dir(out_dir: str, *, resume: bool, overwrite: bool) -> None:
    """Refuses to start a new run where one already lives, unless resume or overwrite, and a
    run directory nothing can be written to."""
    if resume and overwrite:
        raise configlib.PreflightError("--resume and --overwrite exclude each other: pick one")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise configlib.PreflightError(f"run.out_dir={out_dir!r}: is a file, expected a directory")
    check_writable_dir(out_dir, "run.out_dir")
    held = existing_run(out_dir)
    if held and not resume and not overwrite:
        raise configlib.PreflightError(
            f"run.out_dir={out_dir!r} already holds a run ({', '.join(held)}): pass --resume to "
            "continue it or --overwrite to start over (the old run is moved aside)"
        )


def move_run_aside(out_dir: str) -> str | None:
    """Moves the run's files in ``out_dir`` into ``out_dir/previous-<UTC time>/``; returns that
    folder (None when there was nothing to move). Files that are not the run's stay."""
    present = [n for n in RUN_ENTRIES if os.path.lexists(os.path.join(out_dir, n))]
    # The logs of further servers and of other processes' servers (builders.build_sampler).
    logs = glob.glob(os.path.join(glob.escape(out_dir), "vllm_server?*.log"))
    present += sorted(os.path.basename(x) for x in logs if os.path.basename(x) not in present)
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = os.path.join(out_dir, f"previous-{stamp}")
    suffix = 1
    while os.path.exists(dest):
        dest = os.path.join(out_dir, f"previous-{stamp}-{suffix}")
        suffix += 1
    os.makedirs(dest)
    for name in present:
        os.rename(os.path.join(out_dir, name), os.path.join(dest, name))
    return dest


# Keys whose change makes the run's checkpoints another run's: the model (shapes, dtypes, layer
# layout), the method, and what the train state holds for it (each method's registered
# ``state_keys``: PPO's critic, the KL reference copy that exists only with kl_coef > 0). Prefixes
# end with a dot.
STATE_KEYS = ("model.", "rl.algo", *registry.state_keys())


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, old value, new value) for every dotted key that differs between two config dicts."""
    a, b = _flatten(old), _flatten(new)
    missing = object()
    changes = []
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key, missing), b.get(key, missing)
        if x != y:
            changes.append((key, None if x is missing else x, None if y is missing else y))
    return changes


def changes_text(changes) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)


def check_resume_config(cfg: config_lib.TrainConfig) -> list[tuple[str, object, object]]:
    """``--resume`` with a config that no longer describes the run: the keys that change the
    checkpointed state or the method are refused in one line (old -> new); the others (steps,
    evaluation, logging, learning rate, ...) are allowed and returned (``preflight.check`` reports
    them in one line).
    Without a saved ``config.yaml`` (nothing run yet) there is nothing to compare."""
    import yaml

    path = os.path.join(cfg.run.out_dir, "config.yaml")
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            old = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise configlib.PreflightError(f"--resume: cannot read the run's {path}: {e}") from None
    try:  # the saved keys over this version's defaults, as the run would build them today
        old = config_lib.config_to_dict(configlib.build(config_lib.TrainConfig, old))
        changes = config_changes(old, config_lib.config_to_dict(cfg))
    except (TypeError, ValueError):  # written by another version: compare the keys it has
        keys = _flatten(old).keys()
        changes = [c for c in config_changes(old, config_lib.config_to_dict(cfg)) if c[0] in keys]
    refused = [c for c in changes if any(c[0].startswith(k) for k in STATE_KEYS)]
    if refused:
        raise configlib.PreflightError(
            f"--resume: the config differs from the run's {path} in keys that change the "
            f"checkpointed state or the method: {changes_text(refused)}; resume with the run's "
            "values, or start a new run (another run.out_dir, or --overwrite)"
        )
    return changes
