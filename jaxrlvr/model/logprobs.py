"""Log-probabilities of chosen tokens and token entropies from logits: the one implementation the
trainer (``algos``), the course's functions (``algos.losses``) and the sampler share, so sampler
and trainer log-probs cannot drift apart by formula.

Everything is float32 whatever the logits' dtype. With m = max(z) (no gradient), e = exp(z - m),
s = sum(e):

    log p(label) = (z[label] - m) - log s,      H = log s - sum(e * (z - m)) / s.

The label's logit is picked with a compare-and-sum over V (no gather: the backward pass is an
elementwise select instead of a scatter), and the entropy reuses ``e``, so XLA fuses both into
reductions over V without another [..., V] array. A -inf logit (a masked token) contributes 0 to
the value and to the gradient.

``logprobs_from_hidden`` runs the lm_head and the above over chunks of positions from the final
hidden states, each chunk under ``jax.checkpoint`` inside ``lax.map``: only one chunk's
[B, chunk, V] float32 logits exist at a time, in the forward pass and in the backward pass (which
recomputes them), instead of the whole [B, T, V]. The same arithmetic per position, so values and
gradients equal the unchunked ones up to float summation order. Given the head's ``weight`` inside
an open ``grad_sink.sink`` (the microbatched update), the loop is ``grad_sink.map_chunks``
instead: the same recomputation, with each chunk's weight gradient added into the update's
accumulator in place.

``vocab_parallel_head`` is the head to chunk with on a mesh whose batch is sharded: it splits
the vocabulary of a chunk's logits over the batch shards instead of gathering the whole FSDP
weight on every device.

Not here: chunking over the vocabulary within a device (with chunks of a hundred positions the
per-chunk logits are already small) and skipping prompt positions (their count varies per row,
so static shapes keep them; the loss masks them).
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlvr.model import grad_sink, sharding

_f32 = jnp.float32


def _normalizer(logits: jax.Array):
    """(z - m, e, s, log s) of float32 logits; m carries no gradient."""
    z = logits.astype(_f32)
    zs = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    e = jnp.exp(zs)
    s = jnp.sum(e, axis=-1)
    return zs, e, s, jnp.log(s)


def _picked(zs: jax.Array, labels: jax.Array) -> jax.Array:
    vocab_ids = jax.lax.broadcasted_iota(labels.dtype, zs.shape, zs.ndim - 1)
    return jnp.sum(jnp.where(vocab_ids == labels[..., None], zs, 0.0), axis=-1)


def _entropy(zs, e, s, log_s) -> jax.Array:
    # where() before the product: a -inf logit has e = 0 and must contribute 0 (and a zero
    # gradient), not 0 * -inf = NaN.
    return log_s - jnp.sum(e * jnp.where(e > 0, zs, 0.0), axis=-1) / s


def label_logprobs(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log softmax(logits)[label], float32 [...], for logits [..., V] and integer labels [...]."""
    zs, _, _, log_s = _normalizer(logits)
    return _picked(zs, labels) - log_s


def entropy(logits: jax.Array) -> jax.Array:
    """Entropy in nats of softmax(logits) over the last axis, float32 [...]."""
    return _entropy(*_normalizer(logits))


def logprobs_and_entropy(
    logits: jax.Array, labels: jax.Array, *, entropy_grad: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(``label_logprobs``, ``entropy``) in one pass over V. The entropy carries a gradient only
    when ``entropy_grad`` (an entropy bonus); as a metric it is free in the backward pass."""
    zs, e, s, log_s = _normalizer(logits)
    stats = (zs, e, s, log_s) if entropy_grad else jax.lax.stop_gradient((zs, e, s, log_s))
    return _picked(zs, labels) - log_s, _entropy(*stats)


def logprobs_from_hidden(
    hidden_btd: jax.Array,
    lm_head_fn: Callable[[jax.Array], jax.Array],
    labels_bt: jax.Array,
    *,
    chunk_size: int | None = None,
    entropy_grad: bool = False,
    mask_bt: jax.Array | None = None,
    weight: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(log p(label), entropy), float32 [B, T], from final hidden states, in position chunks.

    Args:
      hidden_btd: [B, T, D] final hidden states (after the last norm).
      lm_head_fn: [B, C, D] -> [B, C, V] logits (e.g. ``Qwen2ForCausalLM.lm_logits``), called
        as ``lm_head_fn(h)``, or ``lm_head_fn(h, weight)`` when ``weight`` is given. It is
        called inside the chunk loop, so any weights it reads (and casts) are captured whole and
        their gradient accumulates in their own (float32 master) dtype.
      labels_bt: [B, T] integer labels.
      chunk_size: positions per chunk; None (or >= T) computes all logits at once. T need not
        be a multiple: the last chunk is zero-padded and the padding dropped.
      entropy_grad: as ``logprobs_and_entropy``.
      mask_bt: optional [B, T] (nonzero: a position the caller reads, e.g. the loss mask). Both
        outputs are 0 where it is 0, and a chunk where it is 0 in every row skips the lm_head
        (``lax.cond``): the prompt and padding chunks of right-padded rows cost nothing.
      weight: the head's weight (the float32 master array ``lm_head_fn`` reads), passed
        explicitly so that, chunked inside an open ``grad_sink.sink`` that offers it an
        accumulator, each chunk's weight gradient is added into that accumulator in place
        (``grad_sink.map_chunks``) instead of into a loop carry of its own.
    """

    def head(h, w):
        return lm_head_fn(h) if w is None else lm_head_fn(h, w)

    b, t = labels_bt.shape
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"logprob chunk_size must be None or >= 1, got {chunk_size!r}")
    keep = jnp.ones((b, t), bool) if mask_bt is None else mask_bt != 0

    def masked(logp, ent, keep):
        return jnp.where(keep, logp, 0.0), jnp.where(keep, ent, 0.0)

    if chunk_size is None or chunk_size >= t:
        out = logprobs_and_entropy(head(hidden_btd, weight), labels_bt, entropy_grad=entropy_grad)
        return out if mask_bt is None else masked(*out, keep)
    n = -(-t // chunk_size)
    pad = n * chunk_size - t
    if pad:
        hidden_btd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
        labels_bt = jnp.pad(labels_bt, ((0, 0), (0, pad)))
        keep = jnp.pad(keep, ((0, 0), (0, pad)))
    # [n, B, C, ...]: the chunk axis leads (the loop axis); rows keep their batch sharding.
    h = hidden_btd.reshape(b, n, chunk_size, -1).swapaxes(0, 1)
    lab = labels_bt.reshape(b, n, chunk_size).swapaxes(0, 1)
    kp = keep.reshape(b, n, chunk_size).swapaxes(0, 1)

    def compute(h_c, l_c, k_c, w=weight):
        return masked(*logprobs_and_entropy(head(h_c, w), l_c, entropy_grad=entropy_grad), k_c)

    def skip(h_c, l_c, k_c):
        zeros = jnp.zeros(l_c.shape, _f32)
        return zeros, zeros

    acc = None if weight is None else grad_sink.claim(weight)
    if acc is not None:
        active = jnp.any(kp, axis=(1, 2))
        logp, ent = grad_sink.map_chunks(
            lambda w, h_c, lk: compute(h_c, *lk, w=w), weight, acc, h, (lab, kp), active
        )
    else:

        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
        def one(xs):
            h_c, l_c, k_c = xs
            if mask_bt is None:
                return compute(h_c, l_c, k_c)
            return jax.lax.cond(jnp.any(k_c), compute, skip, h_c, l_c, k_c)

        logp, ent = jax.lax.map(one, (h, lab, kp))

    def merge(x):
        return x.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :t]

    return merge(logp), merge(ent)


def vocab_parallel_head(
    vocab_size: int,
    mesh: Mesh | None,
    dtype,
    weight_vd_fn: Callable[[jax.Array], jax.Array] = lambda w: w,
) -> Callable[[jax.Array, jax.Array], jax.Array] | None:
    """An lm_head ``head(h_bcd, weight)`` for ``logprobs_from_hidden`` (pass ``weight=``) that
    splits the vocabulary, not the rows, over the batch shards ('data', 'fsdp'); None where it
    does not apply (no mesh, one batch shard, or V not divisible by the shards).

    With rows over the batch shards and an FSDP-sharded [V, D] weight, the plain head gathers
    the whole weight on every device and builds its gradient as a whole float32 [V, D] buffer
    per device before the reduce-scatter (0.9 GiB each at V = 152k, D = 1536). Here a chunk's
    (small) hidden rows are gathered instead, the ``dtype`` weight is resharded to
    [V / shards, D], and every device computes its vocabulary slice of the chunk's logits
    [B, C, V / shards]: the log-softmax reductions over V become all-reduces of [B, C], and the
    weight's gradient stays a slice. The same arithmetic per logit as ``lm_logits`` (a ``dtype``
    product accumulated in float32).

    Args:
      vocab_size: V.
      mesh: the device mesh, or None.
      dtype: the compute dtype of the product.
      weight_vd_fn: the float32 master weight as passed -> [V, D] (e.g. a transpose of an
        lm_head kernel [D, V]); applied inside the chunk loop, so the gradient of the weight
        accumulates in float32.
    """
    if mesh is None:
        return None
    axes = tuple(a for a in sharding.BATCH_AXES if mesh.shape.get(a, 1) > 1)
    shards = 1
    for a in axes:
        shards *= mesh.shape[a]
    if shards == 1 or vocab_size % shards:
        return None
    vocab = axes if len(axes) > 1 else axes[0]

    def head(h_bcd: jax.Array, weight: jax.Array) -> jax.Array:
        w_vd = weight_vd_fn(weight).astype(dtype)
        w_vd = jax.lax.with_sharding_constraint(w_vd, NamedSharding(mesh, PartitionSpec(vocab)))
        h = jax.lax.with_sharding_constraint(
            h_bcd.astype(dtype), NamedSharding(mesh, PartitionSpec())
        )
        logits = jnp.einsum("BCD,VD->BCV", h, w_vd, preferred_element_type=_f32)
        spec = PartitionSpec(None, None, vocab)
        return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, spec))

    return head
