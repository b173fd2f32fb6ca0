"""``bench update --op-classes``: XLA:CPU's per-thunk trace sorted into op classes."""

import jax
import jax.numpy as jnp

from jaxrlvr.bench import update


def test_op_classes_of_a_scanned_matmul_program():
    """A scanned matmul chain with a stacked output: the trace shows the matmul fusions, the
    while loop and the per-iteration slices; nothing from Python frames or the executor."""

    def body(x, w):
        y = jnp.tanh(x @ w)
        return y, y  # stacked per iteration: the scan's dynamic-update-slice

    f = jax.jit(lambda x, ws: jax.lax.scan(body, x, ws))
    x, ws = jnp.ones((256, 128)), jnp.ones((3, 128, 128)) * 0.01
    jax.block_until_ready(f(x, ws))
    classes = update.op_classes(lambda: jax.block_until_ready(f(x, ws)), steps=3)
    assert classes["matmul"] > 0 and classes["while"] > 0
    assert set(classes) <= {
        "matmul", "scatter", "gather", "sort", "broadcast", "copy", "scan_slices", "while",
        "elementwise",
    }  # fmt: skip
    assert all(v >= 0 for v in classes.values())


def test_the_host_waiting_for_a_step_is_not_an_op():
    """The host's wait for a result (``np.asarray(jax.Array)``, as long as the step it waits
    for), the executor's spans and Python frames are not ops: counted as ops they made the
    elementwise class look like two thirds of the demo's update."""
    events = [
        {"ph": "X", "name": "np.asarray(jax.Array)", "dur": 9000},
        {"ph": "X", "name": "ThunkExecutor::Execute (wait for completion)", "dur": 9000},
        {"ph": "X", "name": "$train.py:1 step", "dur": 9000},
        {"ph": "X", "name": "PjitFunction(update)", "dur": 500},
        {"ph": "X", "name": "SlinkyThreadPool::Await", "dur": 300},
        {"ph": "X", "name": "end: ynn_fusion.3", "dur": 100},
        {"ph": "X", "name": "ynn_fusion.3", "dur": 6000},
        {"ph": "X", "name": "add_bitcast_fusion.1", "dur": 1000},
        {"ph": "X", "name": "wrapped_broadcast", "dur": 400},
        {"ph": "i", "name": "add_bitcast_fusion.2", "dur": 7000},  # not a complete event
    ]
    assert update.classify(events, steps=2) == {
        "matmul": 3.0,
        "elementwise": 0.5,
        "broadcast": 0.2,
    }


def _thunk(module, run, op, dur, ts):
    args = {"hlo_module": module, "hlo_op": op, "run_id": run}
    return {"ph": "X", "name": op, "dur": dur, "ts": ts, "args": args}


def test_bench_ops_splits_programs_by_name_ops_and_runs():
    """``bench ops``: milliseconds by program and op class; two programs of one name (the SFT
    step and the GRPO update are both ``jit_update``) numbered by first run; calls = runs."""
    from jaxrlvr.bench import ops

    events = [
        _thunk("jit_update", "1", "ynn_fusion.1", 4000, 10),  # SFT step, run 1
        _thunk("jit_update", "1", "gather.2", 1000, 11),
        _thunk("jit_update", "2", "ynn_fusion.1", 6000, 20),  # SFT step, run 2
        _thunk("jit_update", "2", "gather.2", 1000, 21),
        _thunk("jit__traced_generate", "3", "while.4", 500, 30),
        _thunk("jit_update", "4", "ynn_fusion.7", 9000, 40),  # the GRPO update: other ops
        {"ph": "X", "name": "PjitFunction(update)", "dur": 99000, "ts": 5},  # host span
        {"ph": "X", "name": "np.asarray(jax.Array)", "dur": 99000, "ts": 6,
         "args": {"hlo_module": "jit_update", "run_id": "1"}},  # the host waiting: no op
    ]  # fmt: skip
    got = ops.profile(events)
    assert got["jit_update#1"] == {
        "calls": 2, "ms": {"matmul": 10.0, "gather": 2.0}, "total_ms": 12.0
    }  # fmt: skip
    assert got["jit_update#2"] == {"calls": 1, "ms": {"matmul": 9.0}, "total_ms": 9.0}
    assert got["jit__traced_generate"] == {"calls": 1, "ms": {"while": 0.5}, "total_ms": 0.5}
    text = ops.table(got)
    assert text.splitlines()[2].startswith("| `jit_update#1` | 2 | 6.0 | 12 | 83 % |")


def test_bench_ops_reads_a_real_trace():
    """On a real XLA:CPU trace: two programs both named ``update`` with different ops (as the
    SFT step and the GRPO update) come apart as ``jit_update#1`` (3 runs) and ``#2`` (1 run),
    each with its matmul; the events carry the program's name and run id ``profile`` reads."""
    from jaxrlvr.bench import ops

    def make(sort: bool):
        def update(x, w):
            y = jnp.tanh(x @ w)
            return jnp.sort(y, axis=-1)[:, -1].sum() if sort else y.sum()

        return jax.jit(update)

    first, second = make(False), make(True)
    x, w = jnp.ones((64, 64)), jnp.ones((64, 64))
    jax.block_until_ready((first(x, w), second(x, w)))

    def run():
        for fn in (first, first, second, first):
            jax.block_until_ready(fn(x, w))

    got = ops.profile(ops.trace(run))
    assert got["jit_update#1"]["calls"] == 3 and got["jit_update#2"]["calls"] == 1, got
    assert got["jit_update#1"]["ms"]["matmul"] > 0 and got["jit_update#2"]["ms"]["sort"] > 0
