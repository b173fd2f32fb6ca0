"""A vLLM teacher for on-policy distillation: a served model's log-probs of the student's own
prompt + completion tokens, from vLLM's ``prompt_logprobs``.

Each prompt + completion goes to ``/v1/completions`` as one token-id prompt with
``prompt_logprobs`` (``VLLMSampler.prompt_logprobs``: the same HTTP client, concurrency, retries
and supervision of `VLLMServer` processes as rollouts). vLLM returns one entry per prompt
position, the first None (the first token has no context), so the teacher's log-prob of
completion token j, at sequence position len(prompt) + j, is entry len(prompt) + j: the offset
open-instruct PR 1740 had to fix. Prompt log-probs are vLLM's raw log-softmax of the logits
(temperature 1 whatever ``--logprobs-mode`` says), so they are the teacher's distribution itself.

The teacher's server is any vLLM server of a model with the student's tokenizer (``jaxrlvr
serve-vllm --model TEACHER_DIR``, or a `VLLMServer` started here); its weights never change.
Top-k: ``completion_topk`` returns the teacher's k most likely tokens at every completion
position (vLLM's prompt top-k), for the JSD over the teacher's top-k (``algos.distill``).

Not here: routing problems to teachers and checking tokenizers (``teachers.registry``), the local
JAX teacher (``teachers.local``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrlvr.sampling import vllm_sampler, vllm_server


class VLLMTeacher:
    """Teacher log-probs from one or more vLLM servers (module docstring).

    Args:
      servers: server URLs or `VLLMServer` objects (started if not alive; restarted when they
        die, as for rollouts).
      name: how errors and metrics call it (default: the first server's model folder or URL).
      tokenizer: the teacher's tokenizer or its folder (default: a `VLLMServer`'s model folder);
        ``teachers.registry.check_teacher`` compares it with the student's.
      vocab_size: the teacher's vocabulary size (default: read from a `VLLMServer`'s
        config.json; None when only URLs are given).
      timeout_s, max_retries, max_concurrency: as `VLLMSampler`.
    """

    def __init__(
        self,
        servers: str | vllm_server.VLLMServer | Sequence[str | vllm_server.VLLMServer],
        *,
        name: str | None = None,
        tokenizer: Any = None,
        vocab_size: int | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        max_concurrency: int = 64,
    ):
        listed = [servers] if isinstance(servers, str | vllm_server.VLLMServer) else list(servers)
        owned = [s for s in listed if isinstance(s, vllm_server.VLLMServer)]
        folder = os.fspath(owned[0].model_dir) if owned else None
        self.name = name or folder or str(listed[0])
        try:
            # No weights are ever exported to a teacher: the sampler's model config is unused.
            self._client = vllm_sampler.VLLMSampler(
                None,
                listed,
                timeout_s=timeout_s,
                max_retries=max_retries,
                max_concurrency=max_concurrency,
            )
        except vllm_sampler.VLLMError as e:
            raise vllm_sampler.VLLMError(f"teacher {self.name!r} cannot be served: {e}") from None
        self.tokenizer = (
            tokenizer if tokenizer is not None else (owned[0].tokenizer if owned else None)
        )
        if vocab_size is None and owned:
            for d in (owned[0].model_dir, owned[0].tokenizer):
                config = os.path.join(d, "config.json")
                if os.path.exists(config):
                    with open(config) as f:
                        vocab_size = int(json.load(f)["vocab_size"])
                    break
        self.vocab_size = vocab_size

    def completion_logprobs(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[np.ndarray]:
        """log p_teacher of each completion token given its prompt and the completion's earlier
        tokens: one float32 array per completion."""
        seqs = _sequences(prompts, completions)
        out = []
        for p, c, entries in zip(prompts, completions, self._client.prompt_logprobs(seqs)):
            start = len(p)  # entry j is log p(seq[j] | seq[:j]); entry 0 is None
            out.append(
                np.asarray([entries[start + j][int(tok)] for j, tok in enumerate(c)], np.float32)
            )
        return out

    def completion_topk(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], k: int
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per completion, (ids [L, k] int32, log-probs [L, k] float32): the teacher's ``k`` most
        likely tokens at each completion position, most likely first."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        seqs = _sequences(prompts, completions)
        out = []
        for p, c, entries in zip(prompts, completions, self._client.prompt_logprobs(seqs, top_k=k)):
            ids = np.zeros((len(c), k), np.int32)
            vals = np.zeros((len(c), k), np.float32)
            for j in range(len(c)):
                # The sampled token is always listed; it is among the top k only if it ranks so.
                ranked = sorted(entries[len(p) + j].items(), key=lambda kv: -kv[1])[:k]
                ids[j] = [t for t, _ in ranked]
                vals[j] = [v for _, v in ranked]
            out.append((ids, vals))
        return out

    def close(self) -> None:
        """Closes the HTTP client (servers passed in are left running)."""
        self._client.close()

    def __enter__(self) -> VLLMTeacher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _sequences(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
) -> list[list[int]]:
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    return [list(p) + list(c) for p, c in zip(prompts, completions)]
