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

Faults, each reported in one line (:class:`CheckpointError`):

- A save that fails (disk full: ``ENOSPC``, or any write error) removes its temporary directory
  and raises; the previous checkpoints stay as they were and no step is listed for the failed one.
- :meth:`Checkpointer.restore_latest` (resume) tries checkpoints newest-first and skips one that
  does not restore (a corrupted or missing data file: a TensorStore error), logging the skipped
  step and why; when none restores it raises, naming each step's reason.

Deliberately left out: asynchronous saves (a save blocks until it is committed: simpler, and a
training step on this project's scale is much slower than a save), best-k retention by metric,
and remote storage specifics. Export to a Hugging Face folder lives with the model weights code.
"""

import errno
import glob
import inspect
import json
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

# The one checkpoint error (defined with the model's weight I/O, which raises it too); named here
# as ``checkpoint.CheckpointError`` for the driver and the CLI.
from jaxrlvr.model import sharding as sharding_lib
from jaxrlvr.model.weights import CheckpointError

_STATE = "state"
_EXTRA = "extra"


def _log(msg: str) -> None:
    print(f"[jaxrlvr] {msg}", file=sys.stderr, flush=True)


def _closed_loop_callback(exc_type, exc, tb) -> bool:
    """Whether an uncaught exception is a failed restore's leftover: TensorStore reads still in
    flight when one read failed finish after orbax has closed the event loop the restore ran on,
    and their completion callback (``loop.call_soon_threadsafe``) raises "Event loop is
    closed" on TensorStore's own thread."""
    if exc_type is not RuntimeError or str(exc) != "Event loop is closed":
        return False
    return any(
        f.name == "call_soon_threadsafe" and f.filename.endswith("base_events.py")
        for f in traceback.extract_tb(tb)
    )


def quiet_failed_restore_callbacks() -> None:
    """Installs, once per process, a ``sys.unraisablehook`` that drops ``_closed_loop_callback``'s
    error and hands every other one to the hook it replaces, and a filter on asyncio's logger
    that drops its report of the restore's other failed reads (``_drop_orphaned_restore_reads``).
    TensorStore reports an exception of its callback thread as unraisable; after a restore that
    fails and is reported in one line (``restore_latest``), the user would otherwise see a
    traceback per read that was in flight, long after the run moved on to an older checkpoint."""
    if getattr(sys.unraisablehook, "_jaxrlvr_quiet_restores", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        e = unraisable
        if _closed_loop_callback(e.exc_type, e.exc_value, e.exc_traceback):
            return
        if _orphaned_read_coroutine(e.object, e.exc_value):
            return
        previous(unraisable)

    hook._jaxrlvr_quiet_restores = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_drop_orphaned_restore_reads)


def _orphaned_read_coroutine(obj: Any, exc: BaseException | None) -> bool:
    """Whether an unraisable error is an orbax read coroutine of a failed restore closed by the
    garbage collector: orbax's read catches ``BaseException`` (so also the ``GeneratorExit`` that
    closing a suspended coroutine throws in) and raises its own "Encountered error while reading
    array index", which Python can only report as "Exception ignored in: <coroutine ...>"."""
    return (
        inspect.iscoroutine(obj)
        and exc is not None
        and "Encountered error while reading array index" in str(exc)
    )


def _drop_orphaned_restore_reads(record: logging.LogRecord) -> bool:
    """A logging filter for asyncio's logger: False (drop) for its "Task exception was never
    retrieved" of an orbax read (``async_deserialize``) that failed beside the one read whose
    error the failed restore already reported; every other record passes."""
    msg = record.getMessage()
    if "exception was never retrieved" not in msg.split("\n", 1)[0]:
        return True
    # Task / Future / _GatheringFuture variants: an orbax read, by its coroutine or its error
    exc = record.exc_info[1] if record.exc_info else None
    read_error = exc is not None and "Encountered error while reading array index" in str(exc)
    return not ("coro=<async_deserialize()" in msg or read_error)


def describe_error(exc: BaseException, limit: int = 240) -> str:
    """One line for an exception from orbax/TensorStore: ENOSPC named as such, else the first
    line of the innermost cause (TensorStore's own message; orbax wraps it in a bare Exception
    whose text is a multi-line spec dump)."""
    chain, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            where = f" writing {e.filename}" if e.filename else ""
            return f"no space left on device (ENOSPC){where}"
        if "No space left on device" in str(e):
            return "no space left on device (ENOSPC)"
    inner = chain[-1]
    text = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    line = f"{type(inner).__name__}: {text}" if text else type(inner).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


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


def abstract_state(algorithm: Any, params_shape: Any, mesh: Any, rng: int = 0) -> tuple[Any, Any]:
    """(abstract state, its shardings) of a record's ``algorithm.init(params, rng)`` on
    ``mesh``: what a checkpoint of that record restores into (every ``nnx.Variable`` sharded by
    its logical axes, the rest replicated, as ``algos.step.state_shardings``)."""
    shape = jax.eval_shape(lambda p: algorithm.init(p, rng), params_shape)
    shardings = sharding_lib.logical_shardings(shape, mesh)
    return abstract_like(shape, shardings), shardings


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
        previous = sorted(manager.all_steps())
        try:
            saved = manager.save(
                step,
                args=ocp.args.Composite(
                    **{_STATE: ocp.args.StandardSave(state), _EXTRA: ocp.args.JsonSave(extra)}
                ),
            )
            manager.wait_until_finished()
        except Exception as e:
            self._discard_partial_save(step)
            raise CheckpointError(
                f"cannot save step {step} in {self.directory}: {describe_error(e)}; "
                f"the previous checkpoints (steps {previous}) are intact"
            ) from e
        if not saved:  # orbax's save policy declined; never let that pass silently
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}")

    def _discard_partial_save(self, step: int) -> None:
        """After a failed save: drop orbax's state and the step's temporary directories, so the
        step is never listed and the space is freed; a fresh manager is opened on the next call."""
        manager, self._manager = self._manager, None
        if manager is not None:
            for finish in (manager.wait_until_finished, manager.close):
                try:
                    finish()
                except Exception:
                    pass
        # Writes of the other item may still be landing for a moment after the failure: remove
        # until the temporary directory stays gone.
        pattern = os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")
        for _ in range(50):
            paths = glob.glob(pattern)
            if not paths:
                break
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
            time.sleep(0.1)

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        if self._manager is None:
            if not os.path.isdir(self.directory):
                return []
            self._open()
        return sorted(self._manager.all_steps())

    def set_aside_newer_than(self, step: int) -> list[str]:
        """Moves the checkpoints newer than ``step`` (ones a resume skipped as unreadable) out
        of the directory, into ``<directory>.unreadable/<step>``, so that the resumed run can
        save those steps again; nothing is deleted. Returns the new paths."""
        newer = [s for s in self.all_steps() if s > step]
        if not newer:
            return []
        self.close()
        aside = self.directory.rstrip(os.sep) + ".unreadable"
        os.makedirs(aside, exist_ok=True)
        moved = []
        for s in newer:
            dest = os.path.join(aside, str(s))
            suffix = 1
            while os.path.exists(dest):
                dest = os.path.join(aside, f"{s}-{suffix}")
                suffix += 1
            os.rename(os.path.join(self.directory, str(s)), dest)
            moved.append(dest)
        self._open()
        return moved

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

    def restore_latest(
        self,
        make_target: Callable[[int, dict[str, Any]], Any],
        *,
        step: int | None = None,
        log: Callable[[str], None] | None = None,
    ) -> tuple[int, Any, dict[str, Any]] | None:
        """Restores the newest checkpoint that restores cleanly (resume).

        Tries the complete checkpoints newest-first: reads a step's ``extra``, calls
        ``make_target(step, extra)`` for the abstract state (as :meth:`restore` takes it; it may
        depend on ``extra``, e.g. the training phase), and restores into it. A step that fails
        (corrupted or missing files, a TensorStore error, a structure mismatch) is skipped with
        one logged line naming it and why. ``make_target`` may be called once per step tried, so
        it should not change the caller's state.

        Args:
          make_target: ``(step, extra) -> abstract_state``.
          step: restore exactly this step, no fallback (None: newest that restores).
          log: where the skip lines go (default: stderr, prefixed ``[jaxrlvr]``).

        Returns:
          ``(step, state, extra)``, or None when the directory holds no complete checkpoint.

        Raises:
          CheckpointError: ``step`` was given and does not restore, or no checkpoint restores.
        """
        log = log or _log
        steps = self.all_steps()
        if not steps:
            if step is not None:
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            return None
        if step is not None and step not in steps:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.directory} (have {steps})"
            )
        candidates = [step] if step is not None else steps[::-1]
        failures = []
        quiet_failed_restore_callbacks()  # before a read fails: its leftovers may come at once
        for s in candidates:
            try:
                _, extra = self.restore_extra(s)
                tree, _ = self.restore(s, make_target(s, extra))
            except Exception as e:  # noqa: BLE001 - any failure to read means: try an older one
                reason = describe_error(e)
                failures.append(f"step {s}: {reason}")
                if step is None and s != candidates[-1]:
                    log(
                        f"checkpoint step {s} in {self.directory} does not restore ({reason}); "
                        "trying the next older one"
                    )
                continue
            return s, tree, extra
        raise CheckpointError(f"no checkpoint in {self.directory} restores: {'; '.join(failures)}")

    def read_arrays(self, step: int | None = None) -> dict[str, Any]:
        """The saved state as nested dicts of host arrays: for inspection and tests on one host,
        whatever mesh and processes saved it (every array is read onto this process's first
        device, shapes from the checkpoint's metadata). Training resumes with :meth:`restore`."""
        step, _ = self.restore_extra(step)
        with ocp.StandardCheckpointer() as reader:
            meta = reader.metadata(os.path.join(self.directory, str(step), _STATE)).item_metadata
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta
        )
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)})
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
