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
    assert set(classes) <= {"matmul", "broadcast", "copy", "scan_slices", "while", "elementwise"}
    assert all(v >= 0 for v in classes.values())
