"""Shared dimension legend and array type aliases.

Dimension letters used in einsums, shape comments and variable-name suffixes across jaxrlvr:

    B  batch (sequences)              G  samples per prompt (group size)
    T  tokens (sequence length)       S  key/value length (KV-cache slots)
    V  vocabulary                     D  embedding (hidden) size
    N  query heads                    K  key/value heads
    H  head dimension                 F  MLP (intermediate) size
    L  layers

A suffix names the shape where it is ambiguous: ``logp_bt`` is [B, T], ``adv_b`` is [B].
"""

from typing import Any

import jax

Array = jax.Array
PyTree = Any
