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

Not here: chunking over the vocabulary or the sequence (callers bound memory by microbatching).
"""

import jax
import jax.numpy as jnp

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
