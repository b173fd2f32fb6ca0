"""Shape buckets: a bounded set of sizes that inputs are padded up to, so that a jitted program
(the sampler's generate, the trainer's update) compiles once per bucket rather than once per size.

One implementation for the sampler (prompt, generation and batch buckets) and the driver's
training batches (power-of-two sequence lengths).
"""

from collections.abc import Sequence


def bucket(value: int, buckets: Sequence[int], *, multiple_of: int = 1) -> int:
    """Smallest bucket >= value (rounded up to `multiple_of`); past the largest bucket, the next
    multiple of the largest bucket, so that any size works with a bounded number of programs."""
    for b in sorted(buckets):
        b = -(-b // multiple_of) * multiple_of
        if b >= value:
            return b
    top = max(buckets)
    top = -(-top // multiple_of) * multiple_of
    return -(-value // top) * top


def power_of_two_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """minimum, 2 * minimum, 4 * minimum, ... up to the first one >= maximum."""
    out = [minimum]
    while out[-1] < maximum:
        out.append(out[-1] * 2)
    return tuple(out)


def length_bucket(length: int, *, minimum: int = 16, maximum: int | None = None) -> int:
    """Smallest power-of-two multiple of ``minimum`` >= ``length``, capped at ``maximum`` (but
    never below ``length``)."""
    b = bucket(length, power_of_two_buckets(minimum, length))
    return b if maximum is None else min(b, max(maximum, length))
