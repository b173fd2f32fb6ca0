"""The one sampler interface that the training loop talks to.

Defines what goes into a rollout request (`SamplingParams`), what comes back (`Completion`) and the
`Sampler` protocol that both the embedded `JaxSampler` and the HTTP `VLLMSampler` implement, plus
helpers they share: prompt-major ordering checks and the Qwen3-style thinking budget (the one
implementation of it: both samplers run it on the host around their plain generation).

Contract shared by every sampler:

- `generate(prompt_token_ids, n, sampling_params)` returns a flat list of
  `len(prompt_token_ids) * n` completions in PROMPT-MAJOR order: prompt 0's n samples first, then
  prompt 1's, ... so that contiguous groups of n are what group-normalised advantages (GRPO)
  expect. Never a partial batch: a sampler raises rather than return fewer completions.
- `Completion.logprobs[i]` is the sampler's log-probability (float32 value) of `token_ids[i]` under
  the distribution it actually sampled from (after temperature / top-p / top-k), so that the trainer
  can compute truncated importance weights and report the sampler-trainer gap.
- Tokens that a sampler appended without sampling them (the thinking-budget early-exit text) are
  flagged in `Completion.forced` and carry logprob 0.0; the trainer should mask them out of the
  policy-gradient loss (they are not actions of the policy).
- `update_weights(weights, version=...)` moves the sampler to the trainer's new weights (the Flax
  NNX `State` of `nnx.Param`, as `nnx.state(model, nnx.Param)`) and returns timings in seconds.
  Every completion carries the version of the weights that generated all of its tokens
  (`Completion.weight_version`): a generation in flight when new weights arrive finishes on the
  weights it started with, and one that has not started yet runs on the new ones.

Left out on purpose: batching, bucketing and transport, which belong to each implementation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable


class SamplerError(RuntimeError):
    """A sampler cannot serve (a server that died of a fatal error, that will not start, that
    rejects requests); the message's first line names the cause and where to read more."""


FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length")

# Qwen3's early-exit text: appended when a completion spends its thinking budget without closing
# its thinking block, so that the model moves on to the answer.
DEFAULT_THINKING_END_TEXT = (
    "\n\nConsidering the limited time, I have to give the solution based on the thinking directly"
    " now.\n</think>"
)
# A completion has closed its thinking block once its text contains this marker.
THINK_CLOSE = "</think>"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What to sample; the same meaning for every sampler.

    Attributes:
      temperature: softmax temperature; 0 means greedy (argmax).
      top_p: nucleus mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; 0 disables it.
      max_tokens: most new tokens per completion (forced thinking-budget tokens included).
      stop_token_ids: extra token ids that end a completion (EOS ends it unless `ignore_eos`); the
        stop token itself is kept in `token_ids`.
      stop: stop strings; generation ends when the text contains one (the string is not kept).
      seed: makes sampling reproducible when set.
      logprobs: return per-token logprobs of the sampled tokens.
      ignore_eos: keep generating past EOS (benchmarks).
      thinking_budget: when set, a completion that has generated this many tokens without closing
        ``</think>`` gets `thinking_end_text` appended (as forced tokens) and goes on to answer.
      thinking_end_text: the early-exit text (Qwen3's by default); must contain ``</think>``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False
    thinking_budget: int | None = None
    thinking_end_text: str = DEFAULT_THINKING_END_TEXT

    def __post_init__(self):
        # Lists are accepted for convenience and stored as tuples so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.thinking_budget is not None and not (
            isinstance(self.thinking_budget, int) and 1 <= self.thinking_budget < self.max_tokens
        ):
            raise ValueError(
                "thinking_budget must be None or an int in [1, max_tokens), got "
                f"{self.thinking_budget!r} with max_tokens={self.max_tokens}"
            )
        if THINK_CLOSE not in self.thinking_end_text:
            raise ValueError(
                f"thinking_end_text must contain {THINK_CLOSE!r}, got {self.thinking_end_text!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """One sampled completion.

    Attributes:
      prompt_index: index of its prompt in the `generate` call.
      token_ids: the new tokens (prompt excluded).
      logprobs: sampler logprob of each token in `token_ids` (float32 values; 0.0 for forced
        tokens); empty when logprobs were not requested.
      text: decoded text of the completion.
      finish_reason: "stop" (EOS, stop id or stop string) or "length" (max_tokens reached).
      forced: per token, True where the sampler appended the token instead of sampling it
        (thinking-budget early exit); None when no token was forced.
      weight_version: the sampler's weight version that produced every token (the ``version``
        of the `update_weights` call before it: the JaxSampler's own counter, the vLLM server's
        ``update_weight_version``); None when the sampler has no version yet.
      routes: MoE routing replay (``algos.routing``): the experts the sampler sent every token
        it computed to, int8 (E <= 127) or int16 [P + C - 1, L, k] (prompt tokens and every
        completion token but the last, i.e. the rows' ``input_ids``; L MoE layers, top-k in
        the router's order), -1 where unknown; None when the sampler recorded none.
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    forced: list[bool] | None = None
    weight_version: int | None = None
    routes: Any = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries for {len(self.token_ids)} tokens"
            )
        if self.forced is not None and len(self.forced) != len(self.token_ids):
            raise ValueError(
                f"forced has {len(self.forced)} entries for {len(self.token_ids)} tokens"
            )

    @property
    def forced_mask(self) -> list[bool]:
        """Per token, True where the token was forced (never sampled); all False if none was."""
        return list(self.forced) if self.forced is not None else [False] * len(self.token_ids)


@runtime_checkable
class Sampler(Protocol):
    """What the training loop needs from a rollout engine."""

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling_params: SamplingParams,
    ) -> list[Completion]:
        """Samples `n` completions per prompt; flat, prompt-major, never partial."""
        ...

    def update_weights(self, weights: Any, *, version: int | None = None) -> dict[str, float]:
        """Moves to new weights (an NNX `State` of `nnx.Param`); returns timings in seconds."""
        ...

    def close(self) -> None:
        """Releases servers, threads and buffers."""
        ...


def check_prompt_major(completions: Sequence[Completion], num_prompts: int, n: int) -> None:
    """Raises unless `completions` is a full, prompt-major batch of `num_prompts * n`."""
    if len(completions) != num_prompts * n:
        raise RuntimeError(
            f"sampler returned {len(completions)} completions, expected {num_prompts} prompts x {n}"
        )
    for i, c in enumerate(completions):
        if c.prompt_index != i // n:
            raise RuntimeError(
                f"completion {i} belongs to prompt {c.prompt_index}, expected {i // n} "
                "(prompt-major order)"
            )


def generate(
    generate_plain: Callable[[list[list[int]], int, SamplingParams], list[Completion]],
    prompt_token_ids: Sequence[Sequence[int]],
    n: int,
    sampling_params: SamplingParams,
    tokenizer: Callable[[], Any],
    *,
    budget_segment: Callable[[list[list[int]], int, SamplingParams], list[Completion]]
    | None = None,
) -> list[Completion]:
    """Every sampler's ``generate``: the checks all samplers share, then the dispatch.

    ``n`` must be an int >= 1 and every prompt needs a token (prompts become lists of ints);
    no prompt gives no completion. Stop strings and a thinking budget need a tokenizer
    (``tokenizer()``, called only then, returns it or raises). With a thinking budget the
    samples run through ``generate_with_thinking_budget`` (segments by ``budget_segment``,
    default ``generate_plain``), otherwise ``generate_plain(prompts, n, sampling_params)``.
    """
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    prompts = [list(map(int, p)) for p in prompt_token_ids]
    if not prompts:
        return []
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if sampling_params.thinking_budget is not None:
        return generate_with_thinking_budget(
            budget_segment or generate_plain, prompts, n, sampling_params, tokenizer()
        )
    return generate_plain(prompts, n, sampling_params)


def generate_with_thinking_budget(
    generate_segment: Callable[[list[list[int]], int, SamplingParams], list[Completion]],
    prompt_token_ids: Sequence[Sequence[int]],
    n: int,
    sampling_params: SamplingParams,
    tokenizer: Any,
) -> list[Completion]:
    """Runs `generate_segment` under a thinking budget (Qwen3's early exit).

    First every sample generates up to `thinking_budget` tokens. A sample that ran into the
    budget is continued from prompt + its tokens with the remaining `max_tokens`; if its text has
    not closed ``</think>`` yet, the token ids of `thinking_end_text` are appended first, as
    forced tokens (logprob 0.0, `forced` True). When the forced text does not fit, it is cut and
    the completion ends with "length". (`sampling_params` fields.)

    Args:
      generate_segment: a sampler's plain generation (no thinking budget), prompt-major.
      prompt_token_ids: B prompts.
      n: samples per prompt.
      sampling_params: must have `thinking_budget` set.
      tokenizer: Hugging Face style, with `encode(text, add_special_tokens=False)`.

    Returns:
      B * n completions, prompt-major.
    """
    budget = sampling_params.thinking_budget
    if budget is None:
        raise ValueError(
            "generate_with_thinking_budget needs sampling_params.thinking_budget to be set"
        )
    prompts = [list(p) for p in prompt_token_ids]
    first = generate_segment(
        prompts, n, dataclasses.replace(sampling_params, max_tokens=budget, thinking_budget=None)
    )
    check_prompt_major(first, len(prompts), n)
    forced_ids = list(tokenizer.encode(sampling_params.thinking_end_text, add_special_tokens=False))
    close_ids = list(tokenizer.encode(THINK_CLOSE, add_special_tokens=False))

    out: list[Completion | None] = [None] * len(first)
    # remaining-token count -> list of (slot, prefix ids, forced ids) continued with that budget.
    todo: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    for slot, c in enumerate(first):
        if c.finish_reason == "stop" or len(c.token_ids) < budget:
            out[slot] = c
            continue
        add = [] if thinking_closed(c, close_ids) else forced_ids
        room = sampling_params.max_tokens - len(c.token_ids)
        if len(add) >= room:
            add = add[:room]
            out[slot] = _join(c, add, None, tokenizer, sampling_params.logprobs)
            continue
        todo.setdefault(room - len(add), []).append((slot, prompts[c.prompt_index], add))

    for k, (room, items) in enumerate(sorted(todo.items())):
        seg_params = dataclasses.replace(
            sampling_params,
            max_tokens=room,
            thinking_budget=None,
            # A distinct seed per continuation batch keeps reruns reproducible without reusing
            # the first segment's random stream.
            seed=None if sampling_params.seed is None else sampling_params.seed + 1 + k,
        )
        cont_prompts = [p + first[slot].token_ids + add for slot, p, add in items]
        rest = generate_segment(cont_prompts, 1, seg_params)
        check_prompt_major(rest, len(cont_prompts), 1)
        for (slot, _, add), r in zip(items, rest, strict=True):
            out[slot] = _join(first[slot], add, r, tokenizer, sampling_params.logprobs)
    assert all(c is not None for c in out)
    return out  # type: ignore[return-value]


def thinking_closed(c: Completion, close_ids: Sequence[int]) -> bool:
    """Whether `c` has closed its thinking block: in its text or, when ``</think>`` is a special
    token that detokenisation drops, in its token ids."""
    if THINK_CLOSE in c.text:
        return True
    k = len(close_ids)
    ids = c.token_ids
    return k > 0 and any(list(ids[i : i + k]) == list(close_ids) for i in range(len(ids) - k + 1))


def _join(
    head: Completion, forced_ids: list[int], tail: Completion | None, tokenizer: Any, logprobs: bool
) -> Completion:
    """Concatenates head + forced tokens + tail into one completion of head's prompt."""
    tail_ids = tail.token_ids if tail is not None else []
    forced_text = tokenizer.decode(forced_ids, skip_special_tokens=False) if forced_ids else ""
    return Completion(
        prompt_index=head.prompt_index,
        token_ids=head.token_ids + forced_ids + tail_ids,
        logprobs=(head.logprobs + [0.0] * len(forced_ids) + (tail.logprobs if tail else []))
        if logprobs
        else [],
        text=head.text + forced_text + (tail.text if tail is not None else ""),
        finish_reason=tail.finish_reason if tail is not None else "length",
        forced=[False] * len(head.token_ids) + [True] * len(forced_ids) + [False] * len(tail_ids),
        weight_version=head.weight_version,
    )
