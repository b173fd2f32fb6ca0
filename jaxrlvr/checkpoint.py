"""Training checkpoints: the train state (any JAX pytree) plus a JSON side-car, via orbax.

One checkpoint per step lives in ``<directory>/<step>/`` with two items: ``state`` (the arrays:
params, optimizer state, step, PRNG key; orbax's standard pytree format, sharded writes) and
``extra`` (a JSON dict: data-iterator position, resolved config, host-side RNG state).

Guarantees this module relies on orbax for, and tests:

- Atomic saves. Orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>``
  only once every item is written, so a process killed mid-save leaves a temporary directory that
  is never listed as a step; a later ``Checkpointer`` on that directory deletes it in the
  background (finished before its first save).
- The newest ``keep`` complete checkpoints are kept; older ones are deleted after each save.
- Restores go into an abstract state whose leaves are ``jax.ShapeDtypeStruct`` with ``sharding``
  set (build it with :func:`abstract_like`), so arrays come back laid out for the current mesh,
  whatever mesh they were saved from. A restore without target shardings is refused.

New-style typed PRNG keys (``jax.random.key``) are saved and restored as typed keys by orbax.

Deliberately left out: asynchronous saves (a save blocks until it is committed: simpler, and a
training step on this project's scale is much slower than a save), best-k retention by metric,
and remote storage specifics. Export to a Hugging Face folder lives with the model weights code.
"""

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_STATE = "state"
_EXTRA = "extra"


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """A pytree of ``jax.ShapeDtypeStruct`` with target shardings, for :meth:`Checkpointer.restore`.

    Args:
      tree: a pytree whose leaves are ``jax.Array`` or ``jax.ShapeDtypeStruct`` (for example the
        live train state, or ``jax.eval_shape`` of its initialiser).
      shardings: where each leaf should land: a pytree of ``jax.sharding.Sharding`` with the same
        structure as ``tree``, a single ``Sharding`` for every leaf, or ``None`` to keep each leaf's
        own ``.sharding`` (an error for a leaf that has none).
    """
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return jax.tree_util.tree_map_with_path(lambda p, x: _abstract_leaf(p, x, shardings), tree)
    return jax.tree_util.tree_map_with_path(_abstract_leaf, tree, shardings)


def _abstract_leaf(path, leaf, sharding):
    if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        raise TypeError(
            f"abstract_like: leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}; "
            "expected a jax.Array or jax.ShapeDtypeStruct"
        )
    if sharding is None:
        sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        raise ValueError(
            f"abstract_like: leaf {jax.tree_util.keystr(path)} has no sharding; pass shardings="
        )
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


class Checkpointer:
    """Saves and restores ``(state, extra)`` pairs by step in one directory.

    ``Checkpointer(run_dir / "checkpoints", keep=3)``; ``save(step, state, extra)`` blocks until
    the checkpoint is committed. Use one instance per directory; multi-host runs call every method
    on every process with the same arguments (orbax coordinates the writes).

    Args:
      directory: the checkpoint directory; created on the first save, not before (so a mistyped
        path given for restoring is reported, not silently created).
      keep: how many of the newest complete checkpoints to keep (>= 1).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep = keep
        self._manager: ocp.CheckpointManager | None = None
        if os.path.isdir(self.directory):
            self._open()

    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep,
                create=True,
                # Partial checkpoints from a killed process are never listed as steps; this
                # also deletes their temporary directories (in the background, awaited by
                # orbax before the first save).
                cleanup_tmp_directories=True,
                enable_async_checkpointing=False,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=(_STATE, _EXTRA)
            )
        return self._manager

    def save(self, step: int, state: Any, extra: dict[str, Any]) -> None:
        """Writes checkpoint ``step`` (blocking) and prunes to the newest ``keep``.

        Args:
          step: the training step; must be newer than every existing checkpoint.
          state: any JAX pytree of arrays (None fields are fine: they hold no leaves).
          extra: a JSON-serialisable dict, restored as is (tuples come back as lists).
        """
        if not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"extra is not JSON-serialisable: {e}") from None
        manager = self._open()
        latest = manager.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(
                f"cannot save step {step} in {self.directory}: step {latest} already exists "
                "and steps must increase"
            )
        saved = manager.save(
            step,
            args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(state), _EXTRA: ocp.args.JsonSave(extra)}
            ),
        )
        manager.wait_until_finished()
        if not saved:  # orbax's save policy declined; never let that pass silently
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}")

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        if self._manager is None:
            if not os.path.isdir(self.directory):
                return []
            self._open()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Reads checkpoint ``step`` (None: the newest) into ``abstract_state``'s shardings.

        Args:
          step: which checkpoint; None for :meth:`latest_step`.
          abstract_state: the target pytree, leaves ``jax.ShapeDtypeStruct`` with ``sharding``
            (see :func:`abstract_like`); same structure as the saved state.

        Returns:
          ``(state, extra)``: the arrays placed with the target shardings, and the JSON dict.
        """
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_state):
            if not isinstance(leaf, jax.ShapeDtypeStruct) or leaf.sharding is None:
                raise ValueError(
                    f"restore: abstract_state leaf {jax.tree_util.keystr(path)} must be a "
                    "jax.ShapeDtypeStruct with sharding= (build it with abstract_like)"
                )
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        if step is None:
            step = steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory} (have {steps})"
            )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    _STATE: ocp.args.StandardRestore(abstract_state),
                    _EXTRA: ocp.args.JsonRestore(),
                }
            ),
        )
        return restored[_STATE], restored[_EXTRA]

    def read_arrays(self, step: int | None = None) -> dict[str, Any]:
        """The saved state as nested dicts of host arrays, with no target shardings: for
        inspection and tests on one host. Training resumes with :meth:`restore`."""
        step, _ = self.restore_extra(step)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore()})
        )
        return jax.tree.map(np.asarray, restored[_STATE])

    def restore_extra(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """Reads only the JSON ``extra`` of checkpoint ``step`` (None: the newest): the caller
        learns what the state looks like (e.g. its training phase) before restoring it."""
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory} (have {steps})"
            )
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_EXTRA: ocp.args.JsonRestore()})
        )
        return step, restored[_EXTRA]

    def close(self) -> None:
        """Waits for pending work and releases orbax's resources."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
