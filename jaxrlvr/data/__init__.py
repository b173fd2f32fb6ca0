"""Problems, prompts and the synthetic task: host-side Python (no JAX).

Submodules:

- ``loading``: ``Problem``, ``DataConfig``, ``load_problems`` (jsonl/parquet/hub via ``datasets``).
- ``iterators``: ``PromptIterator`` (seeded epoch shuffles, saved/restored position) and
  ``CurriculumPromptIterator`` with its ``SuccessRateTracker``.
- ``templates``: ``render_prompt`` for the R1-Zero, question-only and chat templates.
- ``synthetic``: seeded multi-step arithmetic problems and disjoint ``make_splits``.
- ``scratchpad``: seeded arithmetic whose worked solutions (``Problem.solution``) write a
  variable amount of work before the answer, for RL runs where response length can move.
- ``tokenizer``: ``build_char_tokenizer`` for tiny from-scratch models.
- ``decontam``, ``filters``, ``curation``: decontamination against held-out and benchmark
  problems, the guessable / no-CoT / difficulty filters, and the steps of ``jaxrlvr curate``
  (docs/curation.md).
- ``samples/``: small hand-written MATH-style (jsonl, parquet) and GSM8K-style (jsonl) files;
  ``sample_path(name)`` gives their location.

The names below are re-exported for the training loop and users. ``tokenizer`` is not imported
here (it pulls in transformers); import it as ``from jaxrlvr.data import tokenizer``.
"""

import importlib.resources

from jaxrlvr.data import iterators, loading, scratchpad, synthetic, templates
from jaxrlvr.data.iterators import CurriculumPromptIterator, PromptIterator, SuccessRateTracker
from jaxrlvr.data.loading import DataConfig, LoadStats, Problem, load_problems
from jaxrlvr.data.templates import render_prompt


def sample_path(name: str) -> str:
    """Filesystem path of a shipped sample file, e.g. ``sample_path("math_sample.jsonl")``."""
    return str(importlib.resources.files("jaxrlvr.data") / "samples" / name)


__all__ = [
    "CurriculumPromptIterator",
    "DataConfig",
    "LoadStats",
    "Problem",
    "PromptIterator",
    "SuccessRateTracker",
    "iterators",
    "load_problems",
    "loading",
    "render_prompt",
    "sample_path",
    "scratchpad",
    "synthetic",
    "templates",
]
