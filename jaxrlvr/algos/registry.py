"""The training methods by name: each ``algos/<method>.py`` registers its ``Method`` here.

A method's module declares, next to the method itself (verl's ``@register_policy_loss``):

- ``name``: what ``rl.algo`` (or a phase) calls it;
- ``section``: its one config record, the dataclass YAML builds directly at ``rl.<name>`` (None:
  the method reads only the shared sections, ``rl.loss`` and the like);
- ``build(cfg, graphdef, params_shape, mesh, microbatches)``: its ``Algorithm`` record from the
  run's config, the model and the mesh;
- ``data``: what it trains on: "rollouts" (sampled and graded online), "pairs" (an offline
  preference file) or "examples" (SFT's prompt/response pairs: a phase's method, not an
  ``rl.algo`` choice);
- ``asynchronous``: whether it trains on stale rollouts (``rl.max_staleness`` > 0);
- ``state_keys``: the dotted config keys whose change the checkpointed state cannot follow (a
  resume refuses them);
- ``check(rl)``: its one-line checks of the ``rl`` section that its record cannot make alone.

The registry is filled by importing every module of ``jaxrlvr.algos`` once, on the first
question asked of it (``methods``): a new method is one new module, and no list elsewhere names
it. The config's choices, the "unknown method" error, async support and the state keys are read
from here.

Not here: any method's math or record (their modules), the config's other sections (``config``).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from typing import Any, Literal

from jaxrlvr.algos import algorithm as algorithm_lib

Data = Literal["rollouts", "pairs", "examples"]
# The rl.algo value of an SFT-only run (no method of its own: the SFT phase's).
NONE = "none"
SFT = "sft"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
    """One training method's registration; see the module docstring."""

    name: str
    build: Callable[..., algorithm_lib.Algorithm]
    data: Data = "rollouts"
    section: type | None = None
    asynchronous: bool = False
    state_keys: tuple[str, ...] = ()
    check: Callable[[Any], None] | None = None


_METHODS: dict[str, Method] = {}
_LOADED = False


def register(method: Method) -> Method:
    """Adds ``method`` (called by the method's own module when it is imported)."""
    if method.name in _METHODS and _METHODS[method.name] != method:
        raise ValueError(f"method {method.name!r} is registered twice")
    if method.name == NONE:
        raise ValueError(f"method name {NONE!r} is reserved for an SFT-only run")
    _METHODS[method.name] = method
    return method


def _load() -> None:
    """Imports every module of ``jaxrlvr.algos`` once (each registers its methods)."""
    global _LOADED
    if _LOADED:
        return
    package = importlib.import_module("jaxrlvr.algos")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"jaxrlvr.algos.{info.name}")
    _LOADED = True


def methods() -> dict[str, Method]:
    """Every registered method by name, in name order."""
    _load()
    return dict(sorted(_METHODS.items()))


def rl_choices() -> tuple[str, ...]:
    """The values ``rl.algo`` accepts: every method that trains on rollouts or pairs, and
    ``none`` (an SFT-only run)."""
    return (*(n for n, m in methods().items() if m.data != "examples"), NONE)


def get(name: str) -> Method:
    """The method called ``name`` (a phase's, or a checkpoint's); unknown: a one-line error."""
    found = methods().get(name)
    if found is None:
        raise ValueError(f"method {name!r} is not registered (have {list(methods())})")
    return found


def rl_method(name: str) -> Method | None:
    """The method ``rl.algo`` names (None for "none": an SFT-only run); any other name outside
    ``rl_choices`` is the one-line "unknown method" error."""
    if name == NONE:
        return None
    if name not in rl_choices():
        raise ValueError(f"rl.algo={name!r}: no such method; expected one of {list(rl_choices())}")
    return methods()[name]


def asynchronous() -> tuple[str, ...]:
    """The methods that train on stale rollouts."""
    return tuple(n for n, m in methods().items() if m.asynchronous)


def state_keys() -> tuple[str, ...]:
    """Every method's checkpointed-state config keys (their union, in name order)."""
    return tuple(dict.fromkeys(k for m in methods().values() for k in m.state_keys))


def sections() -> dict[str, type]:
    """The config record of each method that has one, by the method's name (``rl.<name>``)."""
    return {n: m.section for n, m in methods().items() if m.section is not None}


def build(
    name: str, cfg: Any, graphdef: Any, params_shape: Any, mesh: Any, *, microbatches=None
) -> algorithm_lib.Algorithm:
    """The ``Algorithm`` record of method ``name`` for the run config ``cfg`` (its ``rl`` and
    the sections the method reads). ``microbatches``: the RL record's microbatch count (default
    ``rl.microbatches``; a token budget chooses others); an SFT record keeps ``sft``'s."""
    method = get(name)
    if method.data != "examples" and microbatches is None:
        microbatches = cfg.rl.microbatches
    return method.build(cfg, graphdef, params_shape, mesh, microbatches)
