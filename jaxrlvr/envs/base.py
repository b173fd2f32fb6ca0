"""The environment protocol of multi-turn rollouts, and the tool environment built on it.

A multi-turn rollout alternates model turns and environment turns (``envs.multi_turn``). The
environment sees each model turn as text and answers with an ``EnvStep``: an observation to append
(tokenized once, never trained on), a reward, and whether the episode is over.

    env.reset(prompt, problem)          before the first model turn; may return an opening text
    env.step(model_turn_text) -> EnvStep(observation, reward, done, info)
    env.close()

``ToolEnvironment`` is the environment of tool use: a model turn that ends with a call
``<tag>argument</tag>`` of one of its tools (the ``Tool`` protocol: ``PythonTool`` runs code in the
code-reward sandbox, ``Calculator`` evaluates arithmetic) gets the tool's output back as
``<output>...</output>``; a turn without a call is the final answer and ends the episode. The
task's verifier still grades the whole trajectory (``envs.multi_turn``); the environment's step
rewards are added to it (both tools here give 0).

``split_trace`` cuts a written trace (an SFT example) into model and environment pieces, so that
SFT on tool-call traces trains only on what the model writes, as RL does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """What an environment answers to one model turn.

    Attributes:
      observation: text appended after the model's turn (tokenized once, masked out of the loss);
        None appends nothing.
      reward: added to the trajectory's verifier reward.
      done: the episode is over (no further model turn).
      info: per-step facts for metrics: ``tool`` (name), ``error`` (bool), ``seconds``.
    """

    observation: str | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (``envs.multi_turn`` makes one per trajectory).

    ``stop``: strings that end a model turn so that the environment can act on it (a tool's
    closing tag); the rollout adds them to the sampler's stop strings.
    """

    stop: tuple[str, ...]

    def reset(self, prompt: str, problem: Any = None) -> str | None:
        """Starts an episode on ``prompt`` (the rendered problem; ``problem`` when the caller has
        it); returns text to append before the first model turn, or None."""
        ...

    def step(self, action: str) -> EnvStep:
        """The environment's answer to one model turn (its text, stop string included)."""
        ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """A tool's answer: its output text, whether it failed (an exception, a timeout, a call it
    could not parse), and the wall-clock seconds it took."""

    output: str
    error: bool
    seconds: float


class Tool(Protocol):
    """A tool the model calls as ``<tag>argument</tag>``."""

    name: str
    tag: str

    def __call__(self, argument: str) -> ToolResult: ...


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


class ToolEnvironment:
    """Tool use: the model's turn ends with ``<tag>argument</tag>``; the tool's output comes back
    as ``<output>text</output>`` (clipped to ``max_output_chars``). A turn without a call of one
    of the tools ends the episode (the final answer).

    The last complete call in the turn is the one run (the sampler stops the turn at the call's
    closing tag, so it is also the turn's end).
    """

    def __init__(self, tools: Sequence[Tool], *, max_output_chars: int = 256):
        if not tools:
            raise ValueError("ToolEnvironment needs at least one tool")
        tags = [t.tag for t in tools]
        if len(set(tags)) != len(tags):
            raise ValueError(f"tools must have distinct tags, got {tags}")
        self.tools = {t.tag: t for t in tools}
        self.max_output_chars = max_output_chars
        self.stop = tuple(f"</{t.tag}>" for t in tools)
        alternatives = "|".join(re.escape(t) for t in self.tools)
        self._call = re.compile(rf"<({alternatives})>(.*?)</\1>", re.DOTALL)

    def reset(self, prompt: str, problem: Any = None) -> str | None:
        return None

    def find_call(self, action: str) -> tuple[Tool, str] | None:
        """The turn's last complete tool call, as (tool, argument), or None."""
        calls = list(self._call.finditer(action))
        if not calls:
            return None
        last = calls[-1]
        return self.tools[last.group(1)], last.group(2)

    def step(self, action: str) -> EnvStep:
        call = self.find_call(action)
        if call is None:
            return EnvStep(observation=None, done=True)
        tool, argument = call
        result = tool(argument)
        text = _clip(result.output, self.max_output_chars)
        return EnvStep(
            observation=f"{OUTPUT_OPEN}{text}{OUTPUT_CLOSE}",
            info={"tool": tool.name, "error": result.error, "seconds": result.seconds},
        )

    def close(self) -> None:
        return None


_OBSERVATION = re.compile(re.escape(OUTPUT_OPEN) + r".*?" + re.escape(OUTPUT_CLOSE), re.DOTALL)


def split_trace(text: str) -> list[tuple[str, bool]]:
    """A written tool-use trace as (piece, written by the environment) pairs, in order: every
    ``<output>...</output>`` observation is an environment piece, the rest the model's.
    Concatenating the pieces gives ``text`` back."""
    pieces, start = [], 0
    for m in _OBSERVATION.finditer(text):
        if m.start() > start:
            pieces.append((text[start : m.start()], False))
        pieces.append((m.group(0), True))
        start = m.end()
    if start < len(text):
        pieces.append((text[start:], False))
    return pieces
