"""Every check of a run's configuration, in the order a user would fix the problems they find.

1. The config's own values, section by section, then the sections against each other:
   ``config.check_config``, which ``TrainConfig.__post_init__`` runs, so every way of making a
   config (YAML, ``key=value`` overrides, ``TrainConfig(...)`` in code and tests,
   ``dataclasses.replace``) is checked with no entry point to remember, once per config and in
   one fixed order (not the YAML's key order); the sections themselves are plain records. A
   section's message reads ``<section>: <problem>`` (``configlib.ConfigKeyError``). It lives in
   ``config``, not here, because what ``TrainConfig`` runs may import nothing that imports
   ``config`` (tests/test_package_imports.py: no cycle, not even a lazy one), and this module
   asks the phases.
2. What a command will read and the machine it runs on (``check(cfg, mode=...)``): the run
   directory, the method's own needs (routing replay, teachers), the model and tokenizer, the
   data files (each named by its own problem, say a missing question column, before the batch
   sizes they must fill), the vLLM interpreter or servers. It reads no weights and builds
   nothing, so a mistyped path costs a second, not an SFT phase; it raises
   :class:`PreflightError` with one line naming the config key or argument.
3. The config against the job and the prompts, which need the devices, the mesh, the tokenizer
   and the problems (``check_sampler_devices``, ``check_microbatches_fit_mesh``,
   ``check_data_shards``, ``check_lengths``): ``assembly.assemble`` runs them as soon as each
   exists, before any weight is loaded.

The phases own their checks (``Phase.check``, ``Phase.geometry``, ``Phase.data_files``); this
module asks the run's phases (``phases.plan``) for them, importing the phases (and so the model)
only when a run is checked. The library's own config classes (``PolicyLossConfig``,
``OptimizerConfig``, ...) keep their invariants at construction: they are used without a run.
Not here: checks that need a part built (the sandbox's start in ``builders.build_reward_fn``,
a teacher's vocabulary in ``assembly.load_teachers``, a batch's arrays in ``algos.batch``).

Model and tokenizer sources that are not local directories are Hugging Face hub ids: a copy in the
local hub cache is used when there is one; otherwise the hub is asked only when it is reachable
(not with ``HF_HUB_OFFLINE=1``, and after a short connection probe), and the error says what was
tried. ``check`` returns the config with such ids replaced by the local snapshot directories, so
that the loaders (which read local directories only) see what was checked.

Side effect, on purpose and last: ``mode="train", overwrite=True`` moves the files of a run that
already lives in ``run.out_dir`` into ``out_dir/previous-<UTC time>/`` (nothing is deleted), so two
runs never share one metrics file or checkpoint directory. Call ``check`` on process 0 only in a
multi-host job when it may move files. Not checked here: hub *dataset* names (``data.train`` that
is neither "synthetic" nor a local path) are resolved by ``datasets`` when loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import sys
import time
from typing import Literal

from jaxrlvr import config as config_lib
from jaxrlvr import configlib

Mode = Literal["train", "eval", "export"]
MODES = ("train", "eval", "export")

HUB_ENDPOINT = "https://huggingface.co"

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
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class PreflightError(ValueError):
    """A command's input is missing or unusable; the message is one line naming the key."""


def log(msg: str) -> None:
    print(f"[jaxrlvr] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The hub


def hub_offline() -> bool:
    """True when the environment forbids hub access (``HF_HUB_OFFLINE``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", HUB_ENDPOINT).rstrip("/")


def hub_unreachable_reason(timeout_s: float = 3.0) -> str | None:
    """None when the hub answers within ``timeout_s``; else why not, as a short phrase."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    import httpx

    endpoint = hub_endpoint()
    try:
        httpx.head(endpoint, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        return f"tried {endpoint}: {type(e).__name__}{': ' + detail if detail else ''}"
    return None


def _cached_snapshot(repo_id: str) -> str | None:
    """The local hub cache's snapshot of ``repo_id``, or None (no network access)."""
    try:
        import huggingface_hub
    except ImportError:
        return None
    try:
        return huggingface_hub.snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, or an invalid id: the caller reports it
        return None


def _download_snapshot(repo_id: str, key: str) -> str:
    import huggingface_hub

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
    try:
        return huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        raise PreflightError(
            f"{key}={repo_id!r}: not a local directory, and the Hugging Face hub did not "
            f"provide it ({type(e).__name__}: {detail})"
        ) from None


def _looks_local(value: str) -> bool:
    """A path the user meant as local: absolute, ./ ../ ~, or with more than one separator."""
    return (
        os.path.isabs(value)
        or value.startswith(("./", "../", "~", "." + os.sep))
        or value.count("/") > 1
        or os.path.exists(value)
    )


def resolve_hf_source(value: str, key: str, *, hub_timeout_s: float = 3.0) -> str:
    """``value`` (a local directory or a hub id) as a local directory, or PreflightError.

    A hub id is looked up in the local hub cache first; the hub is asked only when reachable.
    """
    if os.path.isdir(os.path.expanduser(value)):
        return os.path.expanduser(value)
    if os.path.exists(os.path.expanduser(value)):
        raise PreflightError(f"{key}={value!r}: is a file, expected a model directory")
    if _looks_local(value):
        raise PreflightError(f"{key}={value!r}: no such directory")
    cached = _cached_snapshot(value)
    if cached is not None:
        return cached
    reason = hub_unreachable_reason(hub_timeout_s)
    if reason is not None:
        raise PreflightError(
            f"{key}={value!r}: not a local directory and the Hugging Face hub is unreachable "
            f"({reason})"
        )
    return _download_snapshot(value, key)


# ----------------------------------------------------------------------------------------------
# Single inputs


def check_model_dir(path: str, key: str = "model.path") -> None:
    """A local Hugging Face model directory: config.json and *.safetensors weights."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PreflightError(f"{key}={path!r}: no config.json in {path}")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        found = ", ".join(sorted(os.listdir(path))[:6]) or "nothing"
        raise PreflightError(f"{key}={path!r}: no *.safetensors weights in {path} (found {found})")


def check_tokenizer_dir(path: str, key: str = "model.tokenizer") -> None:
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise PreflightError(
            f"{key}={path!r}: no tokenizer files in {path} (expected one of "
            f"{', '.join(TOKENIZER_FILES)})"
        )


def is_local_data(value: str) -> bool:
    """The driver's rule: a data source with a path separator or a file suffix is a local file."""
    return os.sep in value or "/" in value or value.endswith(DATA_SUFFIXES)


def check_data_file(
    value: str, key: str, on_bad_row: str = "skip", *, question_field: str | None = None
) -> int:
    """A local jsonl/json/parquet data file must exist (hub dataset names are not checked); a
    json one must hold rows, each line a JSON object (``data.on_bad_row=raise``) or the
    malformed lines reported as skipped, and, with ``question_field``, that column (checked
    here, before the batch sizes: a file without its question column is named as such even
    when it is also too small for a batch). Returns the number of rows of a json file (else 0)."""
    from jaxrlvr.data import loading

    if not is_local_data(value):
        return 0
    if os.path.isdir(value):
        raise PreflightError(f"{key}={value!r}: is a directory, expected a jsonl/json/parquet file")
    if not os.path.isfile(value):
        raise PreflightError(f"{key}={value!r}: file not found")
    if not value.endswith(DATA_SUFFIXES):
        raise PreflightError(
            f"{key}={value!r}: unknown data format (expected {', '.join(DATA_SUFFIXES)})"
        )
    if value.endswith(".parquet"):
        return 0
    try:
        rows, skipped = loading.read_json_rows(value, on_bad_row=on_bad_row, key=key)
    except loading.DataFileError as e:
        raise PreflightError(str(e)) from None
    if skipped:
        lines = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        log(f"{key}={value!r}: skipping {len(skipped)} malformed lines (line {lines})")
    columns = set().union(*rows) if rows else set()
    if question_field is not None and rows and question_field not in columns:
        raise PreflightError(
            f"{key}={value!r}: no row has the question column data.question_field="
            f"{question_field!r} (columns: {sorted(columns)})"
        )
    return len(rows)


def check_batch_rows(rows: int, needed: int, key: str, size_key: str) -> None:
    """A file of ``rows`` rows (0: unknown, not a json file) fills one batch of ``needed``."""
    if 0 < rows < needed:
        raise PreflightError(
            f"{key}: {rows} rows, fewer than one batch of {size_key}={needed}; add rows or "
            f"lower {size_key}"
        )


def check_rows(cfg: config_lib.TrainConfig, rows: dict[str, int]) -> None:
    """Each data file (``rows``: its rows by key) fills one step's batch of the phases that
    read it (``Phase.data_files``)."""
    from jaxrlvr import phases  # the phases import the model: only when a run is checked

    for cls in phases.plan(cfg):
        for f in cls.data_files(cls.view(cfg)):
            check_batch_rows(rows.get(f.key, 0), f.batch, f.key, f.batch_key)


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
        raise PreflightError(f"{flag} {run_dir}: no such directory")
    steps = complete_steps(ckpt_dir)
    if not steps:
        raise PreflightError(f"{flag} {run_dir}: no complete checkpoint in {ckpt_dir}")
    if step is not None and step not in steps:
        raise PreflightError(
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
        raise PreflightError(f"{key}={path!r}: cannot write there ({e.strerror or e})") from None
    finally:
        for directory in made:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def check_run_dir(out_dir: str, *, resume: bool, overwrite: bool) -> None:
    """Refuses to start a new run where one already lives, unless resume or overwrite, and a
    run directory nothing can be written to."""
    if resume and overwrite:
        raise PreflightError("--resume and --overwrite exclude each other: pick one")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise PreflightError(f"run.out_dir={out_dir!r}: is a file, expected a directory")
    check_writable_dir(out_dir, "run.out_dir")
    held = existing_run(out_dir)
    if held and not resume and not overwrite:
        raise PreflightError(
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


# ----------------------------------------------------------------------------------------------
# What the sampler will need


def vllm_interpreter(sampler: config_lib.SamplerSection) -> tuple[str, str]:
    """(the Python that runs the vLLM servers, the key or variable that chose it): the same rule
    as ``builders.build_sampler``."""
    if sampler.vllm_python:
        return sampler.vllm_python, "sampler.vllm_python"
    if os.environ.get("JAXRLVR_VLLM_PYTHON"):
        return os.environ["JAXRLVR_VLLM_PYTHON"], "JAXRLVR_VLLM_PYTHON"
    return sys.executable, "sampler.vllm_python (unset: this interpreter)"


def check_vllm_python(python: str, key: str) -> None:
    """The interpreter exists, runs, and can import vllm (a spec lookup: no vLLM import)."""
    import shutil
    import subprocess

    found = shutil.which(python) if os.sep not in python else python
    if found is None or not os.path.isfile(found):
        raise PreflightError(f"{key}={python!r}: no such interpreter (scripts/setup_vllm.sh)")
    if not os.access(found, os.X_OK):
        raise PreflightError(f"{key}={python!r}: not executable")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        proc = subprocess.run([found, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PreflightError(f"{key}={python!r}: does not run ({e})") from None
    if proc.returncode != 0:
        raise PreflightError(
            f"{key}={python!r}: cannot import vllm (install it with scripts/setup_vllm.sh)"
        )


def check_vllm_url(url: str, timeout_s: float = 5.0) -> None:
    """A given server answers ``/health``."""
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise PreflightError(
            f"sampler.vllm_urls: {url} is not reachable ({type(e).__name__}: {e})"
        ) from None
    if response.status_code != 200:
        raise PreflightError(f"sampler.vllm_urls: {url}/health answered {response.status_code}")


def check_bind_address(host: str) -> None:
    """``sampler.vllm_host`` is an address of this machine that a server can listen on."""
    import socket

    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind(address)
    except OSError as e:
        raise PreflightError(
            f"sampler.vllm_host={host!r}: a server cannot listen there ({e.strerror or e})"
        ) from None


def check_sampler(s: config_lib.SamplerSection) -> None:
    """What the chosen sampler needs: for vLLM, the servers' interpreter with vllm (servers this
    run starts) and an address to listen on, or the given servers answering."""
    if s.kind != "vllm":
        return
    if s.vllm_urls:
        for url in s.vllm_urls:
            check_vllm_url(url)
        return
    check_vllm_python(*vllm_interpreter(s))
    check_bind_address(s.vllm_host)


# ----------------------------------------------------------------------------------------------
# --resume against the run's config

# Keys whose change makes the run's checkpoints another run's: the model (shapes, dtypes, layer
# layout), the method, and what the train state holds for it (PPO's critic, the KL reference copy
# that exists only with kl_coef > 0). Prefixes end with a dot.
STATE_KEYS = ("model.", "rl.algo", "rl.ppo.", "rl.loss.kl_coef")


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


def _changes_text(changes) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)


def check_resume_config(cfg: config_lib.TrainConfig) -> list[tuple[str, object, object]]:
    """``--resume`` with a config that no longer describes the run: the keys that change the
    checkpointed state or the method are refused in one line (old -> new); the others (steps,
    evaluation, logging, learning rate, ...) are allowed, reported in one line, and returned.
    Without a saved ``config.yaml`` (nothing run yet) there is nothing to compare."""
    import yaml

    path = os.path.join(cfg.run.out_dir, "config.yaml")
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            old = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise PreflightError(f"--resume: cannot read the run's {path}: {e}") from None
    try:  # the saved keys over this version's defaults, as the run would build them today
        old = config_lib.config_to_dict(configlib.build(config_lib.TrainConfig, old))
        changes = config_changes(old, config_lib.config_to_dict(cfg))
    except (TypeError, ValueError):  # written by another version: compare the keys it has
        keys = _flatten(old).keys()
        changes = [c for c in config_changes(old, config_lib.config_to_dict(cfg)) if c[0] in keys]
    refused = [c for c in changes if any(c[0].startswith(k) for k in STATE_KEYS)]
    if refused:
        raise PreflightError(
            f"--resume: the config differs from the run's {path} in keys that change the "
            f"checkpointed state or the method: {_changes_text(refused)}; resume with the run's "
            "values, or start a new run (another run.out_dir, or --overwrite)"
        )
    if changes:
        log(f"--resume: continuing with config changes from {path}: {_changes_text(changes)}")
    return changes


# ----------------------------------------------------------------------------------------------
# The config against the job and the prompts: ``assembly.assemble`` runs these as soon as the
# devices, the mesh, the tokenizer and the problems exist, before any weight is loaded.


def check_sampler_devices(s: config_lib.SamplerSection, devices: int) -> None:
    """``sampler.jax_devices`` leaves the trainer at least one of the host's ``devices``."""
    if s.kind == "jax" and 0 < s.jax_devices and s.jax_devices >= devices:
        raise configlib.ConfigKeyError(
            f"sampler.jax_devices={s.jax_devices}: the host has {devices} devices, and the "
            "trainer needs at least one"
        )


def check_expert_mesh(model_cfg, expert: int) -> None:
    """``mesh.expert`` > 1 needs a MoE model whose experts it divides and a dispatch that
    compiles here (``model.expert_parallel.check``): one-line config error otherwise."""
    from jaxrlvr.model import expert_parallel

    try:
        expert_parallel.check(model_cfg, expert)
    except ValueError as e:
        raise configlib.ConfigKeyError(str(e)) from None


def check_microbatches_fit_mesh(cfg: config_lib.TrainConfig, mesh) -> None:
    """One-line config error unless every microbatch's rows divide over the mesh's batch
    shards ('data' x 'fsdp'), for each phase the run has (``Phase.geometry``), and unless each
    phase can run in this job (``Phase.check``).

    Unpacked, a step's rows (the rollouts, the SFT batch, the preference pairs) must be a
    multiple of microbatches x shards (otherwise a microbatch has a remainder or fewer rows than
    devices, which XLA replicates: "Involuntary full rematerialization"). Packed, the row count
    is rounded up to such a multiple, so only a multiple above the number of sequences (rows
    that could only be padding) is refused. A token budget (``rl.max_tokens_per_microbatch``)
    must hold one row per batch shard, each row at least ``rl.max_tokens_per_row`` positions
    (longer rows are refused at the step that packs them, by ``rollout.budget_rows``).
    """
    import jax

    from jaxrlvr import phases
    from jaxrlvr.algos import step as step_lib

    shards = step_lib.batch_shard_count(mesh)
    axes = ("data", "fsdp") + (("expert",) if mesh.shape.get("expert", 1) > 1 else ())
    where = " x ".join(f"mesh.{a}={mesh.shape.get(a, 1)}" for a in axes)
    plan = phases.plan(cfg)
    for cls in plan:
        cls.check(cls.view(cfg), processes=jax.process_count(), shards=shards, where=where)
    # The train phase's batch first: its message is the one a user of the run meets first.
    for g in [cls.geometry(cls.view(cfg)) for cls in reversed(plan)]:
        if g is None:
            continue
        n = g.microbatches
        unit = n * shards
        if (unit <= g.rows) if g.packed else (g.rows % unit == 0):
            continue
        fits = [m for m in range(n, 0, -1) if g.rows % (m * shards) == 0]
        hint = f"{g.section}.microbatches={fits[0]}" if fits else f"a multiple of {shards}"
        raise configlib.ConfigKeyError(
            f"{g.section}.microbatches={n} x {shards} batch shards ({where}) = {unit} rows "
            f"{'exceed' if g.packed else 'do not divide'} {g.rows_key} = {g.rows}: each "
            f"microbatch's rows must split evenly over the batch shards; try {hint}"
        )


def check_data_shards(cfg: config_lib.TrainConfig, blocks: int) -> int:
    """The run's number of data shards (``data.shards``, by default one per process row block,
    of which the job has ``blocks``); one-line config errors when the shards do not divide the
    blocks or a phase's batch per step (``Phase.geometry``)."""
    from jaxrlvr import phases

    n = cfg.data.shards or blocks
    if n % blocks:
        raise configlib.ConfigKeyError(
            f"data.shards={n} does not split over the {blocks} process row blocks of this job"
        )
    for cls in reversed(phases.plan(cfg)):
        g = cls.geometry(cls.view(cfg))
        if g is not None and g.per_shard is not None and g.per_shard[0] % n:
            count, key = g.per_shard
            raise configlib.ConfigKeyError(
                f"{key}={count} is not a multiple of the {n} data shards"
            )
    return n


def check_lengths(
    template: str, s: config_lib.SamplerSection, tokenizer, max_positions: int, splits: dict
) -> None:
    """One-line config error, before any compute, unless the longest rendered prompt of each
    split (``{"data.train": problems, "data.eval": problems}``) plus the tokens the sampler may
    add fits the model's positions and, for vLLM, ``sampler.vllm_max_model_len`` (past them the
    JAX sampler would have no position left and vLLM would refuse the request mid-run);
    ``template``: ``data.template``."""
    from jaxrlvr import prompts

    budgets = {"data.train": ("sampler.max_tokens", s.max_tokens)}
    budgets["data.eval"] = (
        ("sampler.eval_max_tokens", s.eval_max_tokens)
        if s.eval_max_tokens
        else ("sampler.max_tokens", s.max_tokens)
    )
    limits = [("the model's max_position_embeddings", max_positions)]
    if s.kind == "vllm":
        limits.append(("sampler.vllm_max_model_len", s.vllm_max_model_len))
    for split, problems in splits.items():
        if not problems:
            continue
        lengths = [
            len(ids)
            for ids in prompts.encode_many(
                tokenizer, [prompts.render(template, p, tokenizer) for p in problems]
            )
        ]
        i = max(range(len(lengths)), key=lengths.__getitem__)
        key, new_tokens = budgets[split]
        for what, limit in limits:
            if lengths[i] + new_tokens > limit:
                raise configlib.ConfigKeyError(
                    f"{key}={new_tokens}: the longest rendered prompt of {split} "
                    f"(problem {problems[i].id!r}, {lengths[i]} tokens) plus {new_tokens} new "
                    f"tokens is {lengths[i] + new_tokens}, more than {what}={limit}; lower {key} "
                    f"or drop the longest prompts"
                )


# ----------------------------------------------------------------------------------------------
# A whole command


def check_routing_replay(cfg: config_lib.TrainConfig) -> None:
    """``rl.routing_replay=r3`` with vLLM servers this run starts: they must be able to return
    the routed experts (``--enable-return-routed-experts``, Model Runner V2, which needs Triton,
    so a GPU: the CPU build 0.32 refuses it). Servers given by URL are not asked; a batch
    without routes shows as ``routing/covered`` 0."""
    s = cfg.sampler
    if cfg.rl.routing_replay != "r3" or s.kind != "vllm" or s.vllm_urls:
        return
    from jaxrlvr import placement

    key = "rl.routing_replay=r3 with sampler.kind=vllm"
    if placement.resolve_device(s.vllm_device, placement.host_gpus()) == "cpu":
        raise PreflightError(
            f"{key}: vLLM on the CPU cannot return routed experts (they need Model Runner V2, "
            "i.e. Triton and a GPU); use sampler.kind=jax, which records its own"
        )
    if "--enable-return-routed-experts" not in s.vllm_extra_args:
        raise PreflightError(
            f"{key}: add --enable-return-routed-experts to sampler.vllm_extra_args"
        )


def check_teachers(cfg: config_lib.TrainConfig) -> None:
    """``rl.algo: distill``: each teacher of ``rl.distill`` is a model folder (config.json and
    safetensors) or a vLLM server that answers ``/health``. Its tokenizer, vocabulary and the
    problems' domains are checked once it is loaded (``assembly.load_teachers``)."""
    if cfg.rl.algo != "distill":
        return
    d = cfg.rl.distill
    configured = [m.domain for m in cfg.data.mixture] or [cfg.data.domain or "default"]
    missing = [x for x in configured if x not in d.sources]
    if missing and d.teacher is None:
        where = "data.mixture" if cfg.data.mixture else "data.domain"
        raise PreflightError(
            f"{where}: domain {missing[0]!r} has no teacher in rl.distill.teachers "
            f"(have {sorted(d.sources)}) and rl.distill.teacher is not set"
        )
    for domain, source in d.sources.items():
        key = (
            "rl.distill.teacher"
            if domain == "default" and d.teacher
            else (f"rl.distill.teachers.{domain}")
        )
        if source.startswith(("http://", "https://")):
            try:
                check_vllm_url(source)
            except PreflightError as e:
                raise PreflightError(str(e).replace("sampler.vllm_urls", key)) from None
        else:
            check_model_dir(source, key)


def check(
    cfg: config_lib.TrainConfig,
    *,
    mode: Mode = "train",
    resume: bool = False,
    overwrite: bool = False,
    checkpoint: str | None = None,
    step: int | None = None,
    hub_timeout_s: float = 3.0,
) -> config_lib.TrainConfig:
    """Validates what ``mode`` will read (and, for train, the run directory it will write).

    Args:
      cfg: the run's config.
      mode: "train" (train and sft), "eval" or "export".
      resume: train: continue the run in ``run.out_dir``.
      overwrite: train: start over in an ``out_dir`` that holds a run; its files are moved to
        ``out_dir/previous-<UTC time>/`` once every other check has passed.
      checkpoint: eval/export: the run directory whose ``checkpoints/`` is read; it must hold a
        complete checkpoint (eval without it evaluates ``model.path`` and needs none).
      step: export: the checkpoint step (default: the newest).
      hub_timeout_s: how long the hub's reachability probe may take.

    Returns:
      ``cfg``, with ``model.path`` / ``model.tokenizer`` that were hub ids replaced by their local
      snapshot directories (otherwise unchanged).

    Raises:
      PreflightError: one line naming the key or flag at the first problem found.
    """
    if mode not in MODES:
        raise ValueError(f"preflight mode={mode!r}: expected one of {MODES}")
    if mode != "train" and (resume or overwrite):
        raise PreflightError(f"{mode}: --resume/--overwrite apply to train and sft only")
    if mode == "train":
        check_run_dir(cfg.run.out_dir, resume=resume, overwrite=overwrite)
        check_routing_replay(cfg)
        check_teachers(cfg)
    if checkpoint is not None:
        check_checkpoint(checkpoint, "--checkpoint" if mode == "eval" else "export RUN_DIR", step)
    elif mode == "export":
        raise PreflightError("export: a run directory with a checkpoint is required")

    m = cfg.model
    model_path = m.path
    if model_path is not None:
        model_path = resolve_hf_source(model_path, "model.path", hub_timeout_s=hub_timeout_s)
        check_model_dir(model_path, "model.path")
    tokenizer = m.tokenizer
    if tokenizer is not None and tokenizer != "char":
        if tokenizer == m.path:
            tokenizer = model_path
        else:
            tokenizer = resolve_hf_source(tokenizer, "model.tokenizer", hub_timeout_s=hub_timeout_s)
        check_tokenizer_dir(tokenizer, "model.tokenizer")
    elif tokenizer is None and model_path is not None:
        check_tokenizer_dir(model_path, "model.path (its tokenizer)")

    d = cfg.data
    rows = {}  # rows of each json data file, checked against the batch sizes once all exist
    question = d.question_field if d.code_layout is None else None  # code layouts: own columns
    if d.train not in config_lib.GENERATED_TASKS:
        rows["data.train"] = check_data_file(
            d.train, "data.train", d.on_bad_row, question_field=question
        )
    if d.eval is not None:
        check_data_file(d.eval, "data.eval", d.on_bad_row, question_field=question)
    if mode == "train":
        from jaxrlvr import phases

        for cls in phases.plan(cfg):
            for f in cls.data_files(cls.view(cfg)):
                if f.path is None:
                    raise PreflightError(f.missing)
                if f.key not in rows and f.key != "data.train":
                    rows[f.key] = check_data_file(f.path, f.key, d.on_bad_row)
    if mode == "train":
        check_rows(cfg, rows)

    if mode in ("train", "eval"):
        check_sampler(cfg.sampler)

    if mode == "train" and overwrite and existing_run(cfg.run.out_dir):
        moved = move_run_aside(cfg.run.out_dir)
        log(f"--overwrite: moved the previous run in {cfg.run.out_dir} to {moved}")

    if model_path != m.path or tokenizer != m.tokenizer:
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(m, path=model_path, tokenizer=tokenizer)
        )
    if mode == "train" and resume:  # against the saved config, which holds the resolved paths
        check_resume_config(cfg)
    return cfg
