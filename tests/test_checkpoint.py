"""Tests for jaxrlvr.checkpoint: round trips of a real TrainState-like pytree, resharding on
restore, retention, errors, and atomicity under SIGKILL (in a subprocess)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlvr import checkpoint


@struct.dataclass
class _TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    rng: jax.Array
    ref_params: nnx.State | None = None


class _Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.down = nnx.Linear(16, 8, rngs=rngs)


def _state(seed: int = 0) -> _TrainState:
    _, params = nnx.split(_Tiny(nnx.Rngs(seed)), nnx.Param)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    # One real optimizer step so mu/nu/count are non-trivial.
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return _TrainState(
        step=jnp.asarray(7, jnp.int32),
        params=params,
        opt_state=opt_state,
        rng=jax.random.key(seed + 1),
    )


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        # Exact: a checkpoint is a byte copy, any difference is a bug.
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _shard(state, mesh, spec_for_matrix):
    """Matrices get ``spec_for_matrix``, everything else is replicated."""

    def sharding(x):
        return NamedSharding(mesh, spec_for_matrix if x.ndim == 2 else P())

    shardings = jax.tree.map(sharding, state)
    return jax.device_put(state, shardings), shardings


def test_round_trip_with_typed_key_and_extra(tmp_path):
    mesh = _mesh((8,), ("data",))
    state, _ = _shard(_state(), mesh, P(None, "data"))
    extra = {"data_position": 123, "config": {"lr": 1e-5, "name": "demo"}, "host_rng": [1, 2, 3]}
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(7, state, extra)
        assert ckpt.latest_step() == 7
        restored, restored_extra = ckpt.restore(7, checkpoint.abstract_like(state))
    _assert_trees_equal(restored, state)
    assert restored.ref_params is None
    assert jnp.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)  # still a typed key
    # The restored key draws the same numbers as the original.
    np.testing.assert_array_equal(
        jax.random.uniform(restored.rng, (4,)), jax.random.uniform(state.rng, (4,))
    )
    assert restored_extra == extra


def test_restore_into_different_sharding(tmp_path):
    state, _ = _shard(_state(), _mesh((2, 4), ("data", "model")), P("data", "model"))
    target_mesh = _mesh((4, 2), ("fsdp", "tensor"))
    target = jax.tree.map(
        lambda x: NamedSharding(target_mesh, P("tensor", "fsdp") if x.ndim == 2 else P()), state
    )
    ckpt = checkpoint.Checkpointer(tmp_path)
    ckpt.save(1, state, {})
    restored, _ = ckpt.restore(1, checkpoint.abstract_like(state, target))
    _assert_trees_equal(restored, state)
    for x, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert x.sharding == want
    # The kernel of `up` is [8, 16]: split 2-way on rows and 4-way on columns -> [4, 4] shards.
    kernel = restored.params["up"]["kernel"][...]
    assert kernel.sharding.spec == P("tensor", "fsdp")
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 4)}
    ckpt.close()


def test_restore_onto_single_sharding_from_abstract_tree(tmp_path):
    """An abstract tree from eval_shape plus one Sharding for every leaf."""
    state, _ = _shard(_state(), _mesh((8,), ("data",)), P("data", None))
    ckpt = checkpoint.Checkpointer(tmp_path)
    ckpt.save(3, state, {"a": 1})
    target = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    abstract = checkpoint.abstract_like(jax.eval_shape(lambda: _state()), target)
    restored, extra = ckpt.restore(None, abstract)  # None: the newest
    _assert_trees_equal(restored, state)
    assert all(x.sharding == target for x in jax.tree.leaves(restored))
    assert extra == {"a": 1}


def test_keep_last_n_and_steps(tmp_path):
    state = _state()
    ckpt = checkpoint.Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 5, 9):
        ckpt.save(step, state.replace(step=jnp.asarray(step, jnp.int32)), {"step": step})
    assert ckpt.all_steps() == [5, 9]
    assert ckpt.latest_step() == 9
    assert sorted(os.listdir(tmp_path)) == ["5", "9"]
    # A fresh instance (a resumed process) sees the same steps and restores the right one.
    again = checkpoint.Checkpointer(tmp_path, keep=2)
    assert again.all_steps() == [5, 9]
    restored, extra = again.restore(5, checkpoint.abstract_like(state))
    assert int(restored.step) == 5 and extra == {"step": 5}


def test_errors(tmp_path):
    state = _state()
    missing = tmp_path / "no_such_dir"
    ckpt = checkpoint.Checkpointer(missing)
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    with pytest.raises(FileNotFoundError, match=f"no complete checkpoint in {missing}$"):
        ckpt.restore(None, checkpoint.abstract_like(state))
    assert not missing.exists()  # looking did not create it
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=str(empty)):
        checkpoint.Checkpointer(empty).restore(None, checkpoint.abstract_like(state))

    ckpt.save(4, state, {})
    with pytest.raises(FileNotFoundError, match=r"step 3 .* \(have \[4\]\)"):
        ckpt.restore(3, checkpoint.abstract_like(state))
    with pytest.raises(ValueError, match="step 4 already exists"):
        ckpt.save(4, state, {})
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        ckpt.save(5, state, {"x": object()})
    no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with pytest.raises(ValueError, match=r"leaf .*step.* sharding="):
        ckpt.restore(4, no_sharding)
    with pytest.raises(ValueError, match="keep must be"):
        checkpoint.Checkpointer(tmp_path, keep=0)


_WRITER = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from jaxrlvr import checkpoint

    ckpt = checkpoint.Checkpointer(sys.argv[1], keep=100)
    for step in range(1, 1000):
        # 32 arrays x 1M float32 = 128 MiB, so a save takes long enough to be caught midway.
        state = {"w": [jnp.full((1024, 1024), float(step), jnp.float32) for _ in range(32)],
                 "step": jnp.asarray(step, jnp.int32)}
        ckpt.save(step, state, {"step": step})
    """
)


def _tmp_dirs(directory):
    return [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n]


# Not marked slow: ~4-9 s here, and it is the only proof that a killed save is never used.
def test_sigkill_during_save_never_leaves_a_usable_partial(tmp_path):
    directory = tmp_path / "ckpt"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(directory)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        # Wait for one complete checkpoint, then kill as soon as the next save has started.
        while time.monotonic() < deadline:
            if directory.is_dir() and "1" in os.listdir(directory) and _tmp_dirs(directory):
                proc.send_signal(signal.SIGKILL)
                break
            assert proc.poll() is None, "writer exited early"
            time.sleep(0.001)
        else:
            pytest.fail("writer never started a second save")
    finally:
        proc.kill()
        proc.wait()

    partial = _tmp_dirs(directory)
    # The kill must have landed inside a save, or this test proves nothing.
    assert len(partial) == 1, f"kill missed the save window: {os.listdir(directory)}"
    partial_step = int(partial[0].split(".")[0])
    assert partial_step >= 2

    ckpt = checkpoint.Checkpointer(directory, keep=100)
    assert ckpt.latest_step() == partial_step - 1
    assert partial_step not in ckpt.all_steps()

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        "w": [jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=sharding)] * 32,
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding),
    }
    restored, extra = ckpt.restore(None, abstract)
    assert extra == {"step": partial_step - 1}
    assert int(restored["step"]) == partial_step - 1
    assert all(bool(jnp.all(w == partial_step - 1)) for w in restored["w"])

    # The resumed run can write the step the killed one did not finish.
    state = jax.tree.map(lambda x: jnp.full_like(x, partial_step), restored)
    ckpt.save(partial_step, state, {"step": partial_step})
    assert ckpt.latest_step() == partial_step
    # Reopening scheduled the partial one for deletion; orbax finishes that before any save.
    assert _tmp_dirs(directory) == []


# -- faults: corrupted checkpoints on resume, disk full during a save ----------------------------


def _single(state):
    return jax.tree.map(
        lambda x: jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0])), state
    )


def _two_checkpoints(directory):
    """Steps 1 and 2 with different arrays; returns (ckpt, state1, state2)."""
    state1, state2 = _single(_state(0)), _single(_state(1))
    ckpt = checkpoint.Checkpointer(directory, keep=5)
    ckpt.save(1, state1, {"step": 1})
    ckpt.save(2, state2, {"step": 2})
    return ckpt, state1, state2


def _corrupt_data_files(step_dir):
    """Truncates every array data file of a step (what a bad disk or partial copy leaves)."""
    files = [
        os.path.join(root, f)
        for root, _, names in os.walk(os.path.join(step_dir, "state"))
        for f in names
        if os.path.basename(root) == "d"
    ]
    assert files, "no data files found to corrupt"
    for f in files:
        os.truncate(f, 3)


def test_restore_latest_skips_a_corrupted_newest_checkpoint(tmp_path, capsys):
    ckpt, state1, _ = _two_checkpoints(tmp_path / "ckpt")
    _corrupt_data_files(tmp_path / "ckpt" / "2")
    seen = []

    def target(step, extra):
        seen.append((step, extra["step"]))
        return checkpoint.abstract_like(state1)

    found = checkpoint.Checkpointer(tmp_path / "ckpt").restore_latest(target)
    assert found is not None
    step, tree, extra = found
    assert (step, extra) == (1, {"step": 1}) and seen == [(2, 2), (1, 1)]
    _assert_trees_equal(tree, state1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        f"[jaxrlvr] checkpoint step 2 in {tmp_path / 'ckpt'} does not restore (ValueError: "
    )
    assert lines[0].endswith("); trying the next older one")
    # Nothing was deleted: both steps are still listed (the user may want to inspect step 2).
    assert ckpt.all_steps() == [1, 2]


def test_a_failed_restores_leftover_callbacks_are_quiet(monkeypatch):
    """TensorStore reads still in flight when a restore fails finish after orbax closed the
    restore's event loop; their callback's "Event loop is closed" reaches ``sys.unraisablehook``
    once per read. The hook ``restore_latest`` installs drops exactly those, and passes any other
    unraisable exception to the hook before it."""
    import asyncio
    import gc

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    checkpoint.quiet_failed_restore_callbacks()
    checkpoint.quiet_failed_restore_callbacks()  # once: a second call wraps nothing more
    loop = asyncio.new_event_loop()
    loop.close()

    class Leftover:  # raises where TensorStore's callback does: in loop.call_soon_threadsafe
        def __del__(self):
            loop.call_soon_threadsafe(print)

    class Other:
        def __del__(self):
            raise RuntimeError("something else")

    class Pending:  # a TensorStore read not yet done: suspends the coroutine awaiting it
        def __await__(self):
            yield

    async def _read_array_index_and_device_put():  # orbax's read: BaseException -> Exception
        try:
            await Pending()
        except BaseException as e:
            raise Exception("Encountered error while reading array index: (slice(0, 4, 1),)") from e

    read = _read_array_index_and_device_put()
    read.send(None)  # suspended at its await, as a read in flight is when its restore fails
    Leftover(), Other()
    del read  # closing it throws GeneratorExit in; its handler raises: "Exception ignored in"
    gc.collect()
    assert seen == ["something else"]
    # The restore's other failed reads, which asyncio reports when their tasks are collected.
    import logging

    def record(coro):
        msg = f"Task exception was never retrieved\nfuture: <Task finished coro=<{coro}() done>>"
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    asyncio_log = logging.getLogger("asyncio")
    assert not asyncio_log.filter(record("async_deserialize"))
    assert asyncio_log.filter(record("my_own_task"))


def test_restore_latest_when_every_checkpoint_is_unreadable(tmp_path):
    _, state1, _ = _two_checkpoints(tmp_path / "ckpt")
    for step in ("1", "2"):
        _corrupt_data_files(tmp_path / "ckpt" / step)
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt")
    with pytest.raises(checkpoint.CheckpointError) as err:
        ckpt.restore_latest(lambda s, e: checkpoint.abstract_like(state1), log=lambda m: None)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"no checkpoint in {tmp_path / 'ckpt'} restores: step 2: ValueError: ")
    assert "; step 1: ValueError: " in msg


def test_restore_latest_empty_and_explicit_step(tmp_path):
    assert checkpoint.Checkpointer(tmp_path / "none").restore_latest(lambda s, e: None) is None
    _, state1, state2 = _two_checkpoints(tmp_path / "ckpt")
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt")
    step, tree, _ = ckpt.restore_latest(lambda s, e: checkpoint.abstract_like(state1), step=1)
    assert step == 1
    _assert_trees_equal(tree, state1)
    with pytest.raises(checkpoint.CheckpointError, match=r"for step 7 .*\(have \[1, 2\]\)"):
        ckpt.restore_latest(lambda s, e: checkpoint.abstract_like(state1), step=7)
    # An explicit step that does not restore is an error, never a silent fallback.
    _corrupt_data_files(tmp_path / "ckpt" / "2")
    with pytest.raises(checkpoint.CheckpointError, match=r"restores: step 2: ValueError: "):
        ckpt.restore_latest(lambda s, e: checkpoint.abstract_like(state2), step=2)


def test_disk_full_during_save_keeps_previous_checkpoints(tmp_path, monkeypatch):
    import errno

    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jch

    ckpt, state1, state2 = _two_checkpoints(tmp_path / "ckpt")

    async def no_space(self, x, directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata"))

    monkeypatch.setattr(jch.JsonCheckpointHandler, "_save_fn", no_space)
    with pytest.raises(checkpoint.CheckpointError) as err:
        ckpt.save(3, state2, {"step": 3})
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"cannot save step 3 in {tmp_path / 'ckpt'}: no space left on device (ENOSPC) writing "
    )
    assert msg.endswith("; the previous checkpoints (steps [1, 2]) are intact")
    monkeypatch.undo()
    # No half-written step is listed or left behind, and the older ones restore bit for bit.
    assert ckpt.all_steps() == [1, 2] and _tmp_dirs(tmp_path / "ckpt") == []
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]
    fresh = checkpoint.Checkpointer(tmp_path / "ckpt")
    tree, extra = fresh.restore(2, checkpoint.abstract_like(state2))
    _assert_trees_equal(tree, state2)
    assert extra == {"step": 2}
    # Once space is back, the same Checkpointer saves the step.
    ckpt.save(3, state2, {"step": 3})
    assert ckpt.all_steps() == [1, 2, 3]


def test_tensorstore_write_error_during_save_is_one_line(tmp_path, monkeypatch):
    from orbax.checkpoint._src.handlers import standard_checkpoint_handler as sch

    ckpt, _, state2 = _two_checkpoints(tmp_path / "ckpt")

    async def fails(self, *a, **k):
        raise ValueError(
            'RESOURCE_EXHAUSTED: Error writing local file "d/abc": No space left on device\nmore'
        )

    monkeypatch.setattr(sch.StandardCheckpointHandler, "async_save", fails)
    with pytest.raises(checkpoint.CheckpointError, match=r"no space left on device \(ENOSPC\);"):
        ckpt.save(3, state2, {"step": 3})
    monkeypatch.undo()
    assert ckpt.all_steps() == [1, 2] and _tmp_dirs(tmp_path / "ckpt") == []
