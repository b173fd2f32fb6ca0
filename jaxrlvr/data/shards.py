"""Data shards of a multi-process job: which prompts each process reads, and their order.

The training items (problems, SFT pairs) are split by the seed into ``num_shards`` fixed, disjoint
shards (``split``): the same seed and shard count always give the same split, so a job restarted
with the same shards reads the same rows. A process owns a contiguous range of shards (its block
of the batch rows, ``algos.step.process_row_block``) and keeps only those rows. Every step takes
``batch_size`` items from each shard, in shard order (``ShardedIterator``): the global batch of a
step is the same whichever processes hold the shards, so one process holding both shards of a
two-shard run trains exactly as two processes holding one shard each.

With one shard, ``split`` returns the items as they are and the iterator is the plain one: a
single-process run is unchanged.

Left out: streaming datasets too large for a host's memory (each process still parses the
whole file before it keeps its rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def split(items: Sequence[Any], num_shards: int, seed: int) -> list[list[Any]]:
    """``items`` in ``num_shards`` disjoint shards of (nearly) equal size, chosen by ``seed``;
    each shard keeps the items' original order. One shard: ``[list(items)]``."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards == 1:
        return [list(items)]
    if len(items) < num_shards:
        raise ValueError(f"{len(items)} items cannot be split into {num_shards} data shards")
    perm = np.random.default_rng([seed, 7727]).permutation(len(items))
    return [[items[j] for j in sorted(perm[i::num_shards])] for i in range(num_shards)]


def owned(num_shards: int, block: int, blocks: int) -> range:
    """The shards that row block ``block`` of ``blocks`` reads."""
    if num_shards % blocks:
        raise ValueError(
            f"data.shards={num_shards} does not split over {blocks} process row blocks"
        )
    per = num_shards // blocks
    return range(block * per, (block + 1) * per)


class ShardedIterator:
    """One iterator per owned shard (``make(items, seed)``), each giving ``batch_size`` items;
    ``next_batch`` concatenates them in shard order. ``state_dict`` is a collective in a
    multi-process job: ``gather`` (e.g. ``distributed.allgather_json``) collects every process's
    shard states, so a checkpoint written by process 0 holds them all."""

    def __init__(
        self,
        shards: dict[int, Sequence[Any]],
        make: Callable[[Sequence[Any], int], Any],
        *,
        seed: int,
        gather: Callable[[Any], list[Any]] | None = None,
    ):
        self.iterators = {i: make(items, seed + i) for i, items in sorted(shards.items())}
        self.gather = gather

    def next_batch(self) -> list[Any]:
        return [x for it in self.iterators.values() for x in it.next_batch()]

    def update(self, ids, rewards) -> None:
        """Curriculum statistics: each shard's iterator sees the rewards of its own items."""
        for it in self.iterators.values():
            it.update(ids, rewards)

    def retire(self, ids) -> None:
        """No-Positive-Resampling: each shard's iterator retires the ids it holds."""
        for it in self.iterators.values():
            it.retire(ids)

    @property
    def num_retired(self) -> int:
        """Problems retired by this process's shard iterators."""
        return sum(it.num_retired for it in self.iterators.values())

    def state_dict(self) -> dict:
        """``{"shards": {"<i>": state}}`` over every process's shards (via ``gather``)."""
        mine = {str(i): it.state_dict() for i, it in self.iterators.items()}
        merged = {}
        for states in self.gather(mine) if self.gather else [mine]:
            merged.update(states)
        return {"shards": merged}

    def load_state_dict(self, state: dict) -> None:
        shards = state.get("shards")
        if shards is None:
            raise ValueError("a data-iterator state without shards cannot resume a sharded run")
        for i, it in self.iterators.items():
            if str(i) not in shards:
                raise ValueError(
                    f"the checkpoint has no state for data shard {i} (it has {sorted(shards)}): "
                    "resume with the same data.shards"
                )
            it.load_state_dict(shards[str(i)])
