"""Every check of a run's configuration, in the order a user would fix the problems they find.

1. The config's own values, then its sections against each other: ``config.check_config``,
   which ``TrainConfig.__post_init__`` runs (every way of making a config is checked, once, in
   one order). It lives in ``config``, not here: ``TrainConfig`` may run nothing that imports
   ``config`` (no import cycle), and this module asks the phases.
2. What a command will read and the machine it runs on (``check(cfg, mode=...)``): the run
   directory (``rundir``), the method's own needs (routing replay, teachers), the model and
   tokenizer (hub ids resolved to local snapshots by ``hub``), the data files (each named by its
   own problem, say a missing question column, before the batch sizes they must fill), the vLLM
   interpreter or servers. It reads no weights and builds nothing, so a mistyped path costs a
   second, not an SFT phase; it raises ``configlib.PreflightError``, one line naming the key.
3. The config against the job and the prompts, which need the devices, the mesh, the tokenizer
   and the problems (``check_sampler_devices``, ``check_microbatches_fit_mesh``,
   ``check_data_shards``, ``check_lengths``): ``assembly.assemble`` runs them as soon as each
   exists, before the builders that rely on them and before any weight is loaded.

The phases own their checks (``Phase.check``, ``Phase.geometry``, ``Phase.data_files``); this
module asks the run's phases (``phases.plan``) for them, importing the phases (and so the model)
only when a run is checked. The library's own config classes keep their invariants at
construction: they are used without a run. Not here: checks that need a part built (the
sandbox's start in ``builders.build_reward_fn``, a teacher's vocabulary in
``assembly.load_teachers``, a batch's arrays in ``algos.batch``); the hub (``hub``) and the run
directory (``rundir``: ``--overwrite`` moves an old run aside, last, once every check passed;
call ``check`` on process 0 only in a multi-host job when it may move files).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Literal

from jaxrlvr import config as config_lib
from jaxrlvr import configlib, hub, prompts, rundir, teachers

Mode = Literal["train", "eval", "pairs", "export"]
MODES = ("train", "eval", "pairs", "export")

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

# ----------------------------------------------------------------------------------------------
# Single inputs


def check_model_dir(path: str, key: str = "model.path") -> None:
    """A local Hugging Face model directory: config.json and *.safetensors weights."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise configlib.PreflightError(f"{key}={path!r}: no config.json in {path}")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        found = ", ".join(sorted(os.listdir(path))[:6]) or "nothing"
        raise configlib.PreflightError(
            f"{key}={path!r}: no *.safetensors weights in {path} (found {found})"
        )


def check_tokenizer_dir(path: str, key: str = "model.tokenizer") -> None:
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise configlib.PreflightError(
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
        raise configlib.PreflightError(
            f"{key}={value!r}: is a directory, expected a jsonl/json/parquet file"
        )
    if not os.path.isfile(value):
        raise configlib.PreflightError(f"{key}={value!r}: file not found")
    if not value.endswith(DATA_SUFFIXES):
        raise configlib.PreflightError(
            f"{key}={value!r}: unknown data format (expected {', '.join(DATA_SUFFIXES)})"
        )
    if value.endswith(".parquet"):
        return 0
    try:
        rows, skipped = loading.read_json_rows(value, on_bad_row=on_bad_row, key=key)
    except loading.DataFileError as e:
        raise configlib.PreflightError(str(e)) from None
    if skipped:
        lines = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        prompts.log(f"{key}={value!r}: skipping {len(skipped)} malformed lines (line {lines})")
    columns = set().union(*rows) if rows else set()
    if question_field is not None and rows and question_field not in columns:
        raise configlib.PreflightError(
            f"{key}={value!r}: no row has the question column data.question_field="
            f"{question_field!r} (columns: {sorted(columns)})"
        )
    return len(rows)


def check_batch_rows(rows: int, needed: int, key: str, size_key: str) -> None:
    """A file of ``rows`` rows (0: unknown, not a json file) fills one batch of ``needed``."""
    if 0 < rows < needed:
        raise configlib.PreflightError(
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


# ----------------------------------------------------------------------------------------------
# What the sampler will need


def vllm_interpreter(sampler: config_lib.SamplerSection) -> tuple[str, str]:
    """(the Python that runs the vLLM servers, the key or variable that chose it): the servers'
    own rule (``vllm_server.server_python``)."""
    from jaxrlvr.sampling import vllm_server

    python, origin = vllm_server.server_python(sampler.vllm_python)
    keys = {
        "given": "sampler.vllm_python",
        "this interpreter": "sampler.vllm_python (unset: this interpreter)",
    }
    return python, keys.get(origin, origin)


def check_vllm_python(python: str, key: str) -> None:
    """The interpreter exists, runs, and can import vllm (a spec lookup: no vLLM import)."""
    import shutil
    import subprocess

    found = shutil.which(python) if os.sep not in python else python
    if found is None or not os.path.isfile(found):
        raise configlib.PreflightError(
            f"{key}={python!r}: no such interpreter (scripts/setup_vllm.sh)"
        )
    if not os.access(found, os.X_OK):
        raise configlib.PreflightError(f"{key}={python!r}: not executable")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        proc = subprocess.run([found, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise configlib.PreflightError(f"{key}={python!r}: does not run ({e})") from None
    if proc.returncode != 0:
        raise configlib.PreflightError(
            f"{key}={python!r}: cannot import vllm (install it with scripts/setup_vllm.sh)"
        )


def check_vllm_url(url: str, timeout_s: float = 5.0) -> None:
    """A given server answers ``/health``."""
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise configlib.PreflightError(
            f"sampler.vllm_urls: {url} is not reachable ({type(e).__name__}: {e})"
        ) from None
    if response.status_code != 200:
        raise configlib.PreflightError(
            f"sampler.vllm_urls: {url}/health answered {response.status_code}"
        )


def check_bind_address(host: str) -> None:
    """``sampler.vllm_host`` is an address of this machine that a server can listen on."""
    import socket

    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind(address)
    except OSError as e:
        raise configlib.PreflightError(
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


def check_data_shards(cfg: config_lib.TrainConfig, blocks: int) -> None:
    """One-line config errors unless the run's data shards (``data.shards``, by default one per
    process row block, of which the job has ``blocks``) divide the blocks and each phase's batch
    per step (``Phase.geometry``)."""
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


def check_lengths(
    template: str, s: config_lib.SamplerSection, tokenizer, max_positions: int, splits: dict
) -> None:
    """One-line config error, before any compute, unless the longest rendered prompt of each
    split (``{"data.train": problems, "data.eval": problems}``) plus the tokens the sampler may
    add fits the model's positions and, for vLLM, ``sampler.vllm_max_model_len`` (past them the
    JAX sampler would have no position left and vLLM would refuse the request mid-run);
    ``template``: ``data.template``."""
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
        raise configlib.PreflightError(
            f"{key}: vLLM on the CPU cannot return routed experts (they need Model Runner V2, "
            "i.e. Triton and a GPU); use sampler.kind=jax, which records its own"
        )
    if "--enable-return-routed-experts" not in s.vllm_extra_args:
        raise configlib.PreflightError(
            f"{key}: add --enable-return-routed-experts to sampler.vllm_extra_args"
        )


def check_schedule_covers_epochs(cfg: config_lib.TrainConfig) -> None:
    """A cosine schedule counts optimiser updates, and an RL step with ``rl.epochs_per_step``
    E makes E of them: ``optim.total_steps`` below ``rl.steps`` x E would decay to the final rate
    part-way through the run and train the rest there (the usual slip: ``total_steps`` =
    ``rl.steps``, then epochs raised)."""
    r, o = cfg.rl, cfg.optim
    if o.schedule != "cosine" or r.epochs_per_step <= 1 or r.steps <= 0 or r.algo == "none":
        return
    if r.preference or o.total_steps is None:
        return
    updates = r.steps * r.epochs_per_step
    if o.total_steps < updates:
        raise configlib.PreflightError(
            f"optim.total_steps={o.total_steps} counts optimiser updates: rl.steps={r.steps} x "
            f"rl.epochs_per_step={r.epochs_per_step} = {updates}, so the cosine schedule would "
            f"reach its final rate at RL step {o.total_steps // r.epochs_per_step}; "
            f"set optim.total_steps={updates}"
        )


def check_teachers(cfg: config_lib.TrainConfig) -> None:
    """Each teacher ``rl.distill`` names is a model folder (config.json and safetensors) or a
    vLLM server that answers ``/health``, and the configured domains have one. Its tokenizer,
    vocabulary and the problems' domains are checked once it is loaded
    (``teachers.load_registry``, by the rollout pass ``passes.teacher_scores``)."""
    if not cfg.rl.distill.sources:
        return
    d = cfg.rl.distill
    configured = [m.domain for m in cfg.data.mixture] or [cfg.data.domain or "default"]
    missing = teachers.missing_domain(configured, d.sources, d.teacher is not None)
    if missing is not None:
        where = "data.mixture" if cfg.data.mixture else "data.domain"
        raise configlib.PreflightError(
            f"{where}: domain {missing!r} has no teacher in rl.distill.teachers "
            f"(have {sorted(d.sources)}) and rl.distill.teacher is not set"
        )
    for domain, source in d.sources.items():
        key = (
            "rl.distill.teacher"
            if domain == "default" and d.teacher
            else (f"rl.distill.teachers.{domain}")
        )
        if teachers.is_url(source):
            try:
                check_vllm_url(source)
            except configlib.PreflightError as e:
                raise configlib.PreflightError(str(e).replace("sampler.vllm_urls", key)) from None
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
      mode: "train" (train and sft), "eval", "pairs" (what eval reads, the training split
        sampled) or "export".
      resume: train: continue the run in ``run.out_dir``.
      overwrite: train: start over in an ``out_dir`` that holds a run; its files are moved to
        ``out_dir/previous-<UTC time>/`` once every other check has passed.
      checkpoint: eval/pairs/export: the run directory whose ``checkpoints/`` is read; it must
        hold a complete checkpoint (eval without it evaluates ``model.path`` and needs none).
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
        raise configlib.PreflightError(f"{mode}: --resume/--overwrite apply to train and sft only")
    if mode == "train":
        rundir.check_run_dir(cfg.run.out_dir, resume=resume, overwrite=overwrite)
        check_routing_replay(cfg)
        check_teachers(cfg)
        check_schedule_covers_epochs(cfg)
    if checkpoint is not None:
        flag = "export RUN_DIR" if mode == "export" else "--checkpoint"
        rundir.check_checkpoint(checkpoint, flag, step)
    elif mode == "export":
        raise configlib.PreflightError("export: a run directory with a checkpoint is required")

    m = cfg.model
    model_path = m.path
    if model_path is not None:
        model_path = hub.resolve_hf_source(model_path, "model.path", hub_timeout_s=hub_timeout_s)
        check_model_dir(model_path, "model.path")
    tokenizer = m.tokenizer
    if tokenizer is not None and tokenizer != "char":
        if tokenizer == m.path:
            tokenizer = model_path
        else:
            tokenizer = hub.resolve_hf_source(
                tokenizer, "model.tokenizer", hub_timeout_s=hub_timeout_s
            )
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
                    raise configlib.PreflightError(f.missing)
                if f.key not in rows and f.key != "data.train":
                    rows[f.key] = check_data_file(f.path, f.key, d.on_bad_row)
    if mode == "train":
        check_rows(cfg, rows)

    if mode != "export":
        check_sampler(cfg.sampler)

    if mode == "train" and overwrite and rundir.existing_run(cfg.run.out_dir):
        moved = rundir.move_run_aside(cfg.run.out_dir)
        prompts.log(f"--overwrite: moved the previous run in {cfg.run.out_dir} to {moved}")

    if model_path != m.path or tokenizer != m.tokenizer:
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(m, path=model_path, tokenizer=tokenizer)
        )
    if mode == "train" and resume:  # against the saved config, which holds the resolved paths
        changes = rundir.check_resume_config(cfg)
        if changes:
            saved = os.path.join(cfg.run.out_dir, "config.yaml")
            prompts.log(
                f"--resume: continuing with config changes from {saved}: "
                f"{rundir.changes_text(changes)}"
            )
    return cfg
