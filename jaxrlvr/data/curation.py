"""Data curation before RL: the steps of ``jaxrlvr curate`` over a run's training problems, the
curated files and the report.

The steps run in a fixed order, each a switch of ``CurateConfig`` with its own report line:

1. ``decontam``: drop problems that overlap an evaluation problem (``decontam``: exact after
   normalisation, or shared 13-grams) of the config's held-out split(s) and of benchmark files;
2. ``guessable``: drop true/false, yes/no and multiple-choice problems (``filters``);
3. ``no_cot``: drop problems the policy solves with its thinking cut off;
4. ``difficulty``: keep problems the policy solves sometimes (best-of-k).

Steps 3 and 4 sample from the policy; ``curate`` gets them as a ``PassRates`` callable (the
command's: ``jaxrlvr.curate``), so this module stays plain Python. A problem dropped by one step
is not seen by the next. The curated rows are the input rows unchanged (the same layout, so the
config's ``data.*`` field names still apply), written as jsonl; the report counts kept and
dropped problems per step and per domain, and lists every dropped problem with its reason.

Not here: loading the config's data (``jaxrlvr.curate``) and the rules themselves (``decontam``,
``filters``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxrlvr.data import decontam, filters, loading

STEPS = ("decontam", "guessable", "no_cot", "difficulty")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurateConfig:
    """The ``curate:`` section of a curation YAML (docs/curation.md): one record per step, in
    the order they run (module docstring). ``checkpoint``: the run directory whose newest
    checkpoint is the policy of the sampling steps (None: the config's initial model, e.g.
    ``model.path``). ``batch_size``: problems per sampler call."""

    decontam: decontam.DecontamConfig = dataclasses.field(default_factory=decontam.DecontamConfig)
    guessable: filters.GuessableConfig = dataclasses.field(default_factory=filters.GuessableConfig)
    no_cot: filters.NoCoTConfig = dataclasses.field(default_factory=filters.NoCoTConfig)
    difficulty: filters.DifficultyConfig = dataclasses.field(
        default_factory=filters.DifficultyConfig
    )
    checkpoint: str | None = None
    batch_size: int = 64

    def __post_init__(self):
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"curate.batch_size={self.batch_size!r}: expected an int >= 1")

    @property
    def samples(self) -> bool:
        """Whether a step samples from the policy."""
        return self.no_cot.enabled or self.difficulty.enabled


@dataclasses.dataclass
class Source:
    """One training source of the config.

    Attributes:
      name: the curated file's stem and the report's row name (unique).
      key: the config key that names it (``data.train``, ``data.mixture[1].data.train``).
      domain: its problems' domain for the report ("default" when they have none).
      problems: its training problems, in file order.
      rows: the row written for each problem when it is kept (the input row as read).
      held_out: its held-out problems (the split the config evaluates on), for decontamination.
      generated: a generated task (its held-out split is written out too).
    """

    name: str
    key: str
    domain: str
    problems: list[loading.Problem]
    rows: list[dict[str, Any]]
    held_out: list[loading.Problem] = dataclasses.field(default_factory=list)
    generated: bool = False


class PassRates(Protocol):
    """``fn(problems, *, step) -> rates``: each problem's share of correct samples under the
    policy, for ``step`` "no_cot" (thinking cut off) or "difficulty" (the run's sampling)."""

    def __call__(self, problems: list[loading.Problem], *, step: str) -> Sequence[float]: ...


@dataclasses.dataclass
class CurationResult:
    """What ``curate`` decided: the kept rows per source name, every dropped problem
    (``{"source", "id", "domain", "step", "detail"}``) and the report (``report``)."""

    kept: dict[str, list[dict[str, Any]]]
    dropped: list[dict[str, Any]]
    report: dict[str, Any]


def read_eval_texts(spec: decontam.EvalSetSpec, key: str) -> list[str]:
    """The problem texts of a benchmark file. Raises ``loading.DataFileError`` (one line naming
    ``key``) when the file cannot be read or lacks ``question_field``."""
    if not os.path.exists(spec.path):
        raise loading.DataFileError(f"{key}.path={spec.path!r}: no such file")
    rows = loading.read_rows(spec.path, key=f"{key}.path")
    texts = [r.get(spec.question_field) for r in rows]
    if not any(isinstance(t, str) and t.strip() for t in texts):
        columns = sorted(set().union(*(r.keys() for r in rows)))
        raise loading.DataFileError(
            f"{key}.question_field={spec.question_field!r} is not a text column of "
            f"{spec.path!r} (columns: {columns})"
        )
    return [t for t in texts if isinstance(t, str) and t.strip()]


def eval_set_name(spec: decontam.EvalSetSpec) -> str:
    return spec.name or os.path.splitext(os.path.basename(spec.path))[0]


def _no_bar(total: int, desc: str):
    class _Bar:
        def update(self, n=1): ...
        def close(self): ...

    return _Bar()


def curate(
    sources: Sequence[Source],
    cfg: CurateConfig,
    eval_sets: dict[str, list[str]],
    pass_rates: PassRates | None = None,
    progress: Callable[[int, str], Any] = _no_bar,
) -> CurationResult:
    """Runs the enabled steps (module docstring) over ``sources``.

    Args:
      sources: the training sources.
      cfg: the steps.
      eval_sets: evaluation set name -> problem texts (benchmarks); each source's ``held_out``
        is added as "<source name>:held_out" when ``cfg.decontam.held_out``.
      pass_rates: the policy's pass rates (needed when ``no_cot`` or ``difficulty`` is on).
      progress: ``progress(total, desc)`` -> a bar with ``update(n)`` and ``close()`` (tqdm).

    Raises:
      ValueError: a sampling step is on and ``pass_rates`` is None.
    """
    if cfg.samples and pass_rates is None:
        raise ValueError("curate: no_cot / difficulty need the policy's pass rates")
    alive = [(s, i) for s in sources for i in range(len(s.problems))]
    dropped: list[dict[str, Any]] = []
    counts = {s.name: {step: 0 for step in STEPS} for s in sources}
    table: dict[str, dict[str, int]] = {}

    def drop(src: Source, i: int, step: str, detail: str):
        p = src.problems[i]
        dropped.append(
            {"source": src.name, "id": p.id, "domain": src.domain, "step": step, "detail": detail}
        )
        counts[src.name][step] += 1

    d = cfg.decontam
    if d.enabled:
        sets = dict(eval_sets)
        if d.held_out:
            for s in sources:
                if s.held_out:
                    sets[f"{s.name}:held_out"] = [p.question for p in s.held_out]
        index = decontam.EvalIndex(sets, d)
        bar = progress(len(alive), "decontaminate")
        matches = decontam.find_overlaps(
            [s.problems[i].question for s, i in alive], index, bar.update
        )
        bar.close()
        survivors = []
        for (s, i), m in zip(alive, matches, strict=True):
            if m is None:
                survivors.append((s, i))
                continue
            row = table.setdefault(s.name, {"exact": 0, "ngram": 0})
            row[m.rule] += 1
            row[f"{m.rule}:{m.eval_set}"] = row.get(f"{m.rule}:{m.eval_set}", 0) + 1
            what = "exact match" if m.rule == "exact" else f"{m.shared} shared {d.n}-grams"
            drop(s, i, "decontam", f"{what} with {m.eval_set}[{m.eval_index}]")
        alive = survivors
        eval_sizes = {name: len(texts) for name, texts in sets.items()}
    else:
        eval_sizes = {}

    if cfg.guessable.enabled:
        survivors = []
        for s, i in alive:
            p = s.problems[i]
            reason = filters.guessable_reason(p.question, p.answer)
            if reason is None:
                survivors.append((s, i))
            else:
                drop(s, i, "guessable", reason)
        alive = survivors

    for step, step_cfg in (("no_cot", cfg.no_cot), ("difficulty", cfg.difficulty)):
        if not step_cfg.enabled or not alive:
            continue
        rates = list(pass_rates([s.problems[i] for s, i in alive], step=step))
        if len(rates) != len(alive):
            raise RuntimeError(f"pass_rates gave {len(rates)} rates for {len(alive)} problems")
        survivors = []
        for (s, i), rate in zip(alive, rates, strict=True):
            if step == "no_cot":
                out = filters.solved_without_cot(rate, step_cfg.threshold)
                detail = f"solved in {rate:.2f} of {step_cfg.k} samples without thinking"
            else:
                out = not filters.informative(rate, step_cfg.low, step_cfg.high)
                detail = f"pass rate {rate:.2f} over {step_cfg.k} samples"
            if out:
                drop(s, i, step, detail)
            else:
                survivors.append((s, i))
        alive = survivors

    kept_ids = {(s.name, i) for s, i in alive}
    kept = {s.name: [r for i, r in enumerate(s.rows) if (s.name, i) in kept_ids] for s in sources}
    report = build_report(sources, cfg, counts, kept, table, eval_sizes)
    return CurationResult(kept=kept, dropped=dropped, report=report)


def build_report(sources, cfg, counts, kept, table, eval_sizes) -> dict[str, Any]:
    """The JSON report: steps in order with their settings, per source and per domain the
    problems loaded, dropped by each step and kept, and the decontamination table."""
    per_source = {}
    for s in sources:
        per_source[s.name] = {
            "key": s.key,
            "domain": s.domain,
            "loaded": len(s.problems),
            "dropped": counts[s.name],
            "kept": len(kept[s.name]),
        }
    per_domain: dict[str, dict[str, Any]] = {}
    for row in per_source.values():
        dom = per_domain.setdefault(
            row["domain"], {"loaded": 0, "dropped": {k: 0 for k in STEPS}, "kept": 0}
        )
        dom["loaded"] += row["loaded"]
        dom["kept"] += row["kept"]
        for k in STEPS:
            dom["dropped"][k] += row["dropped"][k]
    steps = {
        "decontam": cfg.decontam.enabled,
        "guessable": cfg.guessable.enabled,
        "no_cot": cfg.no_cot.enabled,
        "difficulty": cfg.difficulty.enabled,
    }
    return {
        "order": list(STEPS),
        "enabled": steps,
        "settings": dataclasses.asdict(cfg),
        "sources": per_source,
        "domains": per_domain,
        "decontam": {"eval_sets": eval_sizes, "by_source": table},
    }


def format_report(report: dict[str, Any]) -> str:
    """The printed report: one line per step (on or off) with its drops per domain, the kept
    counts, and the decontamination table (source x eval set x rule)."""
    lines = []
    domains = report["domains"]
    for step in report["order"]:
        if not report["enabled"][step]:
            lines.append(f"{step:<11} off")
            continue
        total = sum(d["dropped"][step] for d in domains.values())
        per = ", ".join(f"{name} {d['dropped'][step]}" for name, d in domains.items())
        lines.append(f"{step:<11} dropped {total} ({per})")
    for name, d in domains.items():
        lines.append(f"domain {name}: loaded {d['loaded']}, kept {d['kept']}")
    table = report["decontam"]["by_source"]
    if report["enabled"]["decontam"]:
        sets = report["decontam"]["eval_sets"]
        if not sets:
            lines.append("decontamination: no evaluation set (no held-out split, no against)")
            return "\n".join(lines)
        lines.append("decontamination against " + ", ".join(f"{k} ({v})" for k, v in sets.items()))
        lines.append(f"  {'source':<24} {'eval set':<28} {'exact':>6} {'ngram':>6}")
        for source, row in table.items():
            for name in sets:
                exact, ngram = row.get(f"exact:{name}", 0), row.get(f"ngram:{name}", 0)
                if exact or ngram:
                    lines.append(f"  {source:<24} {name:<28} {exact:>6} {ngram:>6}")
        if not table:
            lines.append("  no overlap found")
    return "\n".join(lines)


def write(result: CurationResult, out_dir: str) -> dict[str, str]:
    """Writes ``<source name>.jsonl`` per source (the kept rows), ``dropped.jsonl`` and
    ``report.json`` into ``out_dir``; returns source name -> curated file path."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name, rows in result.kept.items():
        path = os.path.join(out_dir, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        paths[name] = path
    with open(os.path.join(out_dir, "dropped.jsonl"), "w", encoding="utf-8") as f:
        for row in result.dropped:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    report = {**result.report, "files": paths}
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    return paths
