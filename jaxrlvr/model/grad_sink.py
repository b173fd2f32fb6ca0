"""Gradient accumulation in place for the scanned decoder stack and the chunked lm_head.

A microbatched update sums each microbatch's gradient into an accumulator. Done the plain way,
``acc + grad(loss)(params)``, the microbatch's whole gradient exists next to the accumulator
before the add: for the 1.5B model's stacked layers that is a second float32 copy of 4.9 GiB,
and the chunked head's loop keeps its own float32 [V, D] carry (0.87 GiB). Here the backward
pass adds each layer's (each chunk's) weight gradient into the accumulator as soon as it is
computed, in place (a loop carry updated with ``dynamic_update_slice`` / an add), so only one
layer's (one chunk's) gradient exists at a time.

How it is used (``algos.engine.accumulate_gradients``): inside the differentiated loss,
``with sink(params, acc):`` offers every parameter leaf's accumulator. The model ``claim``s the
accumulators of the arrays it reads inside a loop: the stacked layers (``decoder._run_layers``,
scanned and rematerialised) and the head weight (``logprobs.logprobs_from_hidden``, chunked).
The gradient JAX then returns for a claimed leaf is ``acc + grad`` (already accumulated), for
every other leaf the plain ``grad``; the set ``sink`` yields tells the caller which is which.
Each accumulator is claimed at most once per trace, so an array read twice in one loss (a
second forward; the tied embedding's lookup next to the head) adds its other gradients the
plain way, through JAX's sum of cotangents: the total stays ``acc + g1 + g2``.

``scan_layers`` and ``map_chunks`` recompute one layer (chunk) at a time under ``jax.vjp`` in
the backward pass, what ``jax.checkpoint`` with ``nothing_saveable`` does around the scanned body
(only each layer's input is saved). Values and gradients equal the plain remat loop up to float
summation order.

Claiming is by object identity of the traced leaves (``nnx.merge``/``nnx.split`` pass them
through unchanged), at trace time; a sink is thread-local and only affects model calls traced
inside its ``with`` block.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxrlvr.model import bits

_state = threading.local()


def _offers() -> dict[int, list]:
    return getattr(_state, "offers", None) or {}


@contextlib.contextmanager
def sink(params: Any, acc: Any) -> Iterator[set]:
    """Offer ``acc`` (same tree as ``params``) as the in-place gradient accumulator of
    ``params`` for the model calls traced inside the block. Yields the set of claimed leaf
    paths (``jax.tree_util.keystr`` of the path in ``params``), filled as the model claims."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    acc_leaves = jax.tree.leaves(acc)
    if len(leaves) != len(acc_leaves):
        raise ValueError(f"sink: {len(acc_leaves)} accumulators for {len(leaves)} parameters")
    claimed: set = set()
    offers = {
        id(x): [jax.tree_util.keystr(path), a, claimed]
        for (path, x), a in zip(leaves, acc_leaves, strict=True)
    }
    previous = getattr(_state, "offers", None)
    _state.offers = offers
    try:
        yield claimed
    finally:
        _state.offers = previous


def claim(tree: Any) -> Any | None:
    """The accumulators offered for every leaf of ``tree`` (same structure), marked claimed;
    None when no sink is open or any leaf has no unclaimed offer (then nothing is claimed)."""
    offers = _offers()
    leaves, treedef = jax.tree.flatten(tree)
    entries = [offers.get(id(x)) for x in leaves]
    if not leaves or any(e is None or e[0] in e[2] for e in entries):
        return None
    for path, _, claimed in entries:
        claimed.add(path)
    return jax.tree.unflatten(treedef, [a for _, a, _ in entries])


def scan_layers(
    layer_fn: Callable[[Any, jax.Array, Any, Any], tuple[jax.Array, Any]],
    x: jax.Array,
    stacked: Any,
    acc: Any,
    consts: Any,
    xs: Any = None,
) -> tuple[jax.Array, Any]:
    """``x`` through ``layer_fn(layer_params, x, consts, xs_l) -> (x, out_l)`` for every layer of
    ``stacked`` (leaves [L, ...]), as ``lax.scan``; returns (x, the ``out_l`` stacked over layers).
    Differentiated, the cotangent returned for ``stacked`` is ``acc + d/d stacked`` (``acc`` has
    ``stacked``'s structure, shapes and dtypes), added layer by layer in place; ``acc``,
    ``consts`` (positions, masks) and ``xs`` (per-layer inputs [L, ...] such as forced expert
    ids, or None) get none. The per-layer outputs (a MoE layer's router statistics) pass their
    cotangents back through their layer: float leaves carry one (the router's auxiliary loss),
    integer leaves (expert ids) none."""

    def body(consts, h, layer):
        p, x_l = layer
        return layer_fn(p, h, consts, x_l)

    @jax.custom_vjp
    def run(stacked, acc, x, consts, xs):
        del acc
        return jax.lax.scan(functools.partial(body, consts), x, (stacked, xs))

    # The layer inputs saved for the backward pass are stored as their bits when 2-byte
    # floats (``bits``): XLA:CPU runs no bfloat16 dynamic-slice, so it widened the whole saved
    # stack to float32 outside the backward loop (1.5x its size), where integer slices are
    # taken as they are.
    save = bits.as_bits

    def load(h):
        return bits.from_bits(h, x.dtype)

    def fwd(stacked, acc, x, consts, xs):
        def step(h, layer):
            out, per_layer = body(consts, h, layer)
            return out, (per_layer, save(h))

        out, (per_layer, inputs) = jax.lax.scan(step, x, (stacked, xs))
        return (out, per_layer), (stacked, acc, inputs, consts, xs)

    def bwd(res, cts):
        stacked, acc, inputs, consts, xs = res
        ct_out, ct_layers = cts
        num = jax.tree.leaves(stacked)[0].shape[0]
        # Integer outputs (expert ids) come with float0 cotangents: no gradient flows there.
        ct_float = [c for c in jax.tree.leaves(ct_layers) if c.dtype != jax.dtypes.float0]

        def step(carry, i):
            ct_h, acc = carry
            at = functools.partial(jax.lax.dynamic_index_in_dim, index=i, keepdims=False)
            p, x_l = jax.tree.map(at, (stacked, xs))
            # The barrier keeps XLA from hoisting the layer's float32 cast of its input out of
            # the loop, which would build a float32 copy of all L saved inputs.
            h = jax.lax.optimization_barrier(load(at(inputs)))

            def differentiable(p, h):
                out, per_layer = layer_fn(p, h, consts, x_l)
                floats = [
                    o
                    for o in jax.tree.leaves(per_layer)
                    if jax.numpy.issubdtype(o.dtype, jax.numpy.inexact)
                ]
                return out, floats

            _, vjp = jax.vjp(differentiable, p, h)
            ct_p, ct_h = vjp((ct_h, [at(c) for c in ct_float]))
            acc = jax.tree.map(
                lambda a, g: jax.lax.dynamic_update_index_in_dim(
                    a, at(a) + g.astype(a.dtype), i, 0
                ),
                acc,
                ct_p,
            )
            return (ct_h, acc), None

        (ct_x, acc), _ = jax.lax.scan(step, (ct_out, acc), jax.numpy.arange(num), reverse=True)
        none = jax.tree.map(lambda _: None, (consts, xs))
        return acc, None, ct_x, *none

    run.defvjp(fwd, bwd)
    return run(stacked, acc, x, consts, xs)


def map_chunks(
    chunk_fn: Callable[[jax.Array, Any, Any], Any],
    weight: jax.Array,
    acc: jax.Array,
    xs: Any,
    consts: Any,
    active: jax.Array,
) -> Any:
    """``chunk_fn(weight, xs[c], consts[c])`` for every chunk c of the leading axis (as
    ``lax.map``), zeros where ``active[c]`` is False (the chunk is neither computed nor
    differentiated). Differentiated, the cotangent returned for ``weight`` is ``acc + d/d weight``,
    added chunk by chunk in place; ``consts`` and ``active`` get none, ``xs`` its own. Each
    chunk's forward is recomputed in the backward pass (what ``jax.checkpoint`` around the
    chunk does), so only one chunk's intermediates exist at a time."""
    out_shape = jax.eval_shape(chunk_fn, weight, *jax.tree.map(lambda a: a[0], (xs, consts)))

    def zeros():
        return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), out_shape)

    @jax.custom_vjp
    def run(weight, acc, xs, consts, active):
        del acc

        def one(args):
            x, c, a = args
            return jax.lax.cond(a, lambda: chunk_fn(weight, x, c), zeros)

        return jax.lax.map(one, (xs, consts, active))

    def fwd(weight, acc, xs, consts, active):
        return run(weight, acc, xs, consts, active), (weight, acc, xs, consts, active)

    def bwd(res, ct_ys):
        weight, acc, xs, consts, active = res

        def step(acc, args):
            x, c, a, ct_y = args

            def compute(acc):
                _, vjp = jax.vjp(lambda w, x: chunk_fn(w, x, c), weight, x)
                ct_w, ct_x = vjp(ct_y)
                return acc + ct_w.astype(acc.dtype), ct_x

            def skip(acc):
                return acc, jax.tree.map(jax.numpy.zeros_like, x)

            return jax.lax.cond(a, compute, skip, acc)

        acc, ct_xs = jax.lax.scan(step, acc, (xs, consts, active, ct_ys))
        return acc, None, ct_xs, None, None

    run.defvjp(fwd, bwd)
    return run(weight, acc, xs, consts, active)
