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
