"""Two-byte floats moved as their bits (uint16), where XLA:CPU has no bfloat16 kernel.

XLA:CPU runs no bfloat16 dynamic-slice or dynamic-update-slice: it converts the whole operand
to float32 and back around each one, a copy of the whole buffer per slice (the layer scan's
saved inputs, every layer's KV cache at each decode step, the MoE block loop's rows). Integer
slices run as they are, and a bitcast is free on every backend, so these helpers slice and write
a 2-byte float array through its uint16 view; the values are unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_bits(a: jax.Array) -> jax.Array:
    """The uint16 view of a 2-byte float array; any other array as it is."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype.itemsize == 2 else a


def from_bits(a: jax.Array, dtype) -> jax.Array:
    """The inverse of ``as_bits`` for an array whose values are of ``dtype``."""
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype != dtype else a


def write_slice(buf: jax.Array, new: jax.Array, index, *, axis: int) -> jax.Array:
    """``buf`` with ``new`` (cast to buf's dtype) written at [index, index + len) along
    ``axis``, in place, through the bits of a 2-byte float buffer."""
    new = new.astype(buf.dtype)
    out = jax.lax.dynamic_update_slice_in_dim(as_bits(buf), as_bits(new), index, axis=axis)
    return from_bits(out, buf.dtype)
