"""``jaxrlvr curate CONFIG --out DIR``: curate a run's training data before RL.

CONFIG is a run's YAML with a ``curate:`` section (``data.curation.CurateConfig``); it usually
starts ``base: my_run.yaml`` so the run's own file stays as ``jaxrlvr train`` reads it (which
refuses a ``curate:`` key). ``key=value`` overrides apply to both parts (``curate.no_cot.k=8``,
``data.train=...``). The command reads the configured training data (``data.train``, or each
``data.mixture`` source; local files or a generated task), the held-out split(s) and the
benchmark files of ``curate.decontam.against``, runs the enabled steps (``data.curation``: in
the order decontam, guessable, no_cot, difficulty), and writes into DIR one curated jsonl per
source (the rows kept, in their input layout), ``dropped.jsonl`` (every dropped problem and why),
``report.json``, and, for a generated task, its held-out split as ``<name>_held_out.jsonl``. It
prints the report and the ``data.*`` overrides that point a run at the output.

The sampling steps (no_cot, difficulty) load the policy (``curate.checkpoint``, else the
config's initial model) with the run's sampler and grader (``assembly``, as ``jaxrlvr pairs``)
and sample ``k`` completions of each problem, ``curate.batch_size`` problems per call, with a
progress bar. no_cot appends the forced close-think text (``filters.FORCED_TEXT`` by template,
or ``curate.no_cot.forced_text``) to each prompt and grades that text plus the completion, so
the answer is scored as if the model had closed its thinking at once (a thinking budget of 0;
``sampler.thinking_budget`` itself must be >= 1).

Not here: the rules (``data.decontam``, ``data.filters``) and the steps (``data.curation``).
Code data (``data.code_layout``, ``synthetic_code``) is refused: its problems are programs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np

from jaxrlvr import config as config_lib
from jaxrlvr import configlib, prompts
from jaxrlvr.data import curation, filters, loading


def load(
    path: str, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[config_lib.TrainConfig, curation.CurateConfig]:
    """(the run's config, the ``curate:`` section) of a curation YAML; ``curate.*`` overrides
    go to the section, the others to the run's config."""
    return load_dict(config_lib.load_config_dict(path), overrides)


def load_dict(
    data: dict, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[config_lib.TrainConfig, curation.CurateConfig]:
    """``load`` of a config already read (a dict with an optional ``curate`` section)."""
    data = dict(data)
    section = data.pop("curate", None) or {}
    if not isinstance(section, dict):
        raise configlib.ConfigKeyError(f"curate: expected a section, got {section!r}")
    own = [o.removeprefix("curate.") for o in overrides if o.startswith("curate.")]
    rest = [o for o in overrides if not o.startswith("curate.")]
    cfg = configlib.build(config_lib.TrainConfig, configlib.apply_overrides(data, rest))
    ccfg = configlib.build(
        curation.CurateConfig, configlib.apply_overrides(section, own), prefix="curate"
    )
    return cfg, ccfg


def _file_source(d, key: str, name: str, domain: str) -> curation.Source:
    """A local data file as a ``Source``: its problems as the run loads them, and each one's
    input row."""
    if d.code_layout is not None:
        raise ValueError(f"{key}: curate does not take code data (data.code_layout)")
    path = d.train
    if not os.path.exists(path):
        raise FileNotFoundError(f"{key}={path!r}: no such file (curate reads local files)")

    def data_cfg(path, split, key):
        return loading.DataConfig(
            key=key,
            path=path,
            split=split,
            question_field=d.question_field,
            answer_field=d.answer_field,
            solution_field=d.solution_field,
            on_bad_row=d.on_bad_row,
        )

    dc = data_cfg(path, d.split, key)
    rows, _, _ = loading.load_rows(dc)
    problems, stats = loading.load_problems(dc)
    if not problems:
        raise ValueError(f"{key}={path!r}: no usable problems (dropped {stats.reasons})")
    # load_problems names a row "<file stem>-<row index>" (no id field in a run's data section).
    out_rows = [dict(rows[int(p.id.rsplit("-", 1)[1])]) for p in problems]
    held_out = []
    if d.eval:
        eval_key = key.removesuffix("train") + "eval"
        if not os.path.exists(d.eval):
            raise FileNotFoundError(f"{eval_key}={d.eval!r}: no such file")
        held_out, _ = loading.load_problems(data_cfg(d.eval, d.eval_split, eval_key))
    problems = [dataclasses.replace(p, domain=p.domain or domain) for p in problems]
    return curation.Source(name, key, domain, problems, out_rows, held_out)


def _generated_source(cfg, key: str, name: str, domain: str) -> curation.Source:
    """A generated task (synthetic, scratchpad, multiplication) as a ``Source``: rows in the
    MATH layout (``problem``, ``answer``, ``id``)."""
    from jaxrlvr import builders  # deferred: it imports JAX, which file sources do not need

    train, held_out = builders.load_splits(cfg)
    rows = [{"problem": p.question, "answer": p.answer, "id": p.id} for p in train]
    train = [dataclasses.replace(p, domain=p.domain or domain) for p in train]
    return curation.Source(name, key, domain, train, rows, held_out, generated=True)


def sources(cfg: config_lib.TrainConfig) -> list[curation.Source]:
    """The config's training sources: ``data.train``, or each ``data.mixture`` source."""
    d = cfg.data
    if not d.mixture:
        parts = [(d, "data.train", d.domain or "default", cfg)]
    else:
        parts = [
            (
                m.data,
                f"data.mixture[{i}].data.train",
                m.domain,
                dataclasses.replace(cfg, data=m.data),
            )
            for i, m in enumerate(d.mixture)
        ]
    out = []
    for data, key, domain, source_cfg in parts:
        if data.train == "synthetic_code":
            raise ValueError(f"{key}=synthetic_code: curate does not take code data")
        if data.train in config_lib.GENERATED_TASKS or data.train == "multiplication":
            name = domain if d.mixture else data.train
            out.append(_generated_source(source_cfg, key, name, domain))
        else:
            stem = os.path.splitext(os.path.basename(data.train))[0]
            out.append(_file_source(data, key, domain if d.mixture else stem, domain))
    return out


def eval_sets(ccfg: curation.CurateConfig) -> dict[str, list[str]]:
    """The benchmark files of ``curate.decontam.against``, by name."""
    out = {}
    for i, spec in enumerate(ccfg.decontam.against):
        key = f"curate.decontam.against[{i}]"
        name = curation.eval_set_name(spec)
        if name in out:
            raise ValueError(f"{key}: eval set name {name!r} is used twice; set its name")
        out[name] = curation.read_eval_texts(spec, key)
    return out


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="problem", file=sys.stderr, dynamic_ncols=True)


class PolicyPassRates:
    """``curation.PassRates`` of the policy: ``k`` samples of each problem from the run's
    sampler, graded by the run's grader, ``batch_size`` problems per call (a progress bar)."""

    def __init__(self, cfg: config_lib.TrainConfig, ccfg: curation.CurateConfig):
        from jaxrlvr import assembly, preflight

        run_dir = ccfg.checkpoint
        if run_dir is not None:
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=run_dir))
        cfg = preflight.check(cfg, mode="eval", checkpoint=run_dir)
        self.cfg, self.ccfg = cfg, ccfg
        self.ctx, _ = assembly.assemble(cfg, mode="pairs", checkpoint=run_dir)

    def close(self) -> None:
        self.ctx.close()

    def __call__(self, problems: list[loading.Problem], *, step: str) -> np.ndarray:
        ctx, c = self.ctx, self.ccfg
        base = prompts.sampling_params(self.cfg.sampler, ctx.tokenizer)
        if step == "no_cot":
            k, seed = c.no_cot.k, c.no_cot.seed
            forced = c.no_cot.forced_text
            if forced is None:
                forced = filters.FORCED_TEXT[self.cfg.data.template]
            max_tokens = c.no_cot.max_tokens or base.max_tokens
            params = dataclasses.replace(base, max_tokens=max_tokens, thinking_budget=None)
        else:
            k, seed, forced, params = c.difficulty.k, c.difficulty.seed, "", base
        rates = []
        bar = _progress(len(problems), step)
        for start in range(0, len(problems), c.batch_size):
            chunk = problems[start : start + c.batch_size]
            texts = [ctx.render(p) + forced for p in chunk]
            ids = prompts.encode_many(ctx.tokenizer, texts)
            chunk_params = dataclasses.replace(params, seed=seed * 1_000_003 + start)
            completions = ctx.sampler.generate(ids, k, chunk_params)
            scores, _ = ctx.grader.grade(chunk, [forced + x.text for x in completions], k)
            rewards = np.asarray([s["answer_reward"] for s in scores], np.float64)
            rates.extend(rewards.reshape(len(chunk), k).mean(axis=1).tolist())
            bar.update(len(chunk))
        bar.close()
        return np.asarray(rates)


def run(
    cfg: config_lib.TrainConfig, ccfg: curation.CurateConfig, out_dir: str
) -> tuple[curation.CurationResult, dict[str, str]]:
    """Curates the config's training data into ``out_dir``; returns the result and the
    ``data.*`` overrides that point a run at the output."""
    srcs = sources(cfg)
    benchmarks = eval_sets(ccfg) if ccfg.decontam.enabled else {}
    pass_rates = PolicyPassRates(cfg, ccfg) if ccfg.samples else None
    try:
        result = curation.curate(srcs, ccfg, benchmarks, pass_rates, progress=_progress)
    finally:
        if pass_rates is not None:
            pass_rates.close()
    paths = curation.write(result, out_dir)
    pointers = {}
    for s in srcs:
        pointers[s.key] = paths[s.name]
        if s.generated and s.held_out:
            path = os.path.join(out_dir, f"{s.name}_held_out.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                for p in s.held_out:
                    f.write(json.dumps({"problem": p.question, "answer": p.answer, "id": p.id}))
                    f.write("\n")
            pointers[s.key.removesuffix("train") + "eval"] = path
    return result, pointers


def curate_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="jaxrlvr curate",
        description="Decontaminate and filter a run's training problems before RL; write the "
        "curated files and a report (docs/curation.md).",
    )
    p.add_argument("config", help="a run's YAML with a curate: section (often base: RUN.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. curate.no_cot.k=8")
    p.add_argument("--out", required=True, help="directory for the curated files and report")
    args = p.parse_args(argv)
    cfg, ccfg = load(args.config, args.overrides)
    result, pointers = run(cfg, ccfg, args.out)
    print(curation.format_report(result.report))
    print(f"wrote {args.out}/ (report.json, dropped.jsonl); point the run at it with:")
    print("  " + " ".join(f"{k}={v}" for k, v in pointers.items()))
    return 0
