"""The offline preference phase (``rl.algo``: dpo, ipo, simpo, orpo): pairs from a file.

``pref.data`` holds (prompt, chosen, rejected) rows (``jaxrlvr pairs`` writes them from graded
samples). A step is the next ``pref.batch_size`` pairs as stacked rows (the chosen, then the
rejected, ``algos.preference``) -> the compiled prepare (the frozen reference's log-probs, unless
cached) -> update -> the sampler gets the weights (held-out evaluation samples from them). With
``pref.cache_reference`` the reference's per-token log-probs of every pair are computed once, up
front, through the same ``prepare``. The pair order is derived from ``run.seed`` and
fast-forwarded on resume, so the position is the step count alone.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxrlvr import configlib, rollout
from jaxrlvr import prompts as prompt_lib
from jaxrlvr.algos import preference
from jaxrlvr.data import iterators, loading
from jaxrlvr.phases import base

log = prompt_lib.log


class PreferencePhase(base.RLStepsPhase):
    name = "preference"
    reward_metric = "reward_accuracy"
    sections = ("rl", "pref", "optim", "data", "run", "eval")

    @classmethod
    def wanted(cls, cfg: base.Sections) -> bool:
        return cfg.rl.preference

    @classmethod
    def geometry(cls, cfg):
        if cfg.rl.steps <= 0:
            return None
        # Stacked pair rows: each half (the pairs) is split over microbatches and shards.
        return base.BatchGeometry(
            rows=cfg.pref.batch_size,
            rows_key="pref.batch_size",
            microbatches=cfg.rl.microbatches,
            section="rl",
            packed=False,
        )

    @classmethod
    def check(cls, cfg, *, processes, shards, where):
        if processes > 1:
            raise configlib.ConfigKeyError(
                f"rl.algo={cfg.rl.algo}: the offline preference phase runs in one process only"
            )

    @classmethod
    def data_files(cls, cfg):
        if cfg.rl.steps <= 0:
            return []
        missing = f"rl.algo={cfg.rl.algo}: set pref.data (a jsonl of pairs)"
        pref = cfg.pref
        return [base.DataFile("pref.data", pref.data, pref.batch_size, "pref.batch_size", missing)]

    def prepare(self, batch):
        batch, metrics = self.compiled.prepare(self.state, batch)
        return jax.block_until_ready(batch), metrics

    def _preference_pairs(self) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected) rows of ``pref.data`` (``data.loading.read_rows``)."""
        pref = self.cfg.pref
        on_bad_row = self.cfg.data.on_bad_row
        rows = loading.read_rows(pref.data, on_bad_row=on_bad_row, key="pref.data")
        keys = (pref.prompt_field, pref.chosen_field, pref.rejected_field)
        pairs = [tuple(row.get(k) for k in keys) for row in rows]
        good = [p for p in pairs if all(isinstance(x, str) for x in p) and p[1] and p[2]]
        if len(good) < len(pairs):
            log(f"{pref.data}: skipped {len(pairs) - len(good)} rows without {'/'.join(keys)}")
        if not good:
            raise ValueError(f"pref.data={pref.data!r}: no usable {'/'.join(keys)} rows")
        return good

    def _preference_batch(self, pairs: list[tuple]):
        """Stacked pair rows (``algos.preference``): the P chosen, then the P rejected, each
        prompt + response + EOS, right-padded (unpacked), cut to the model's context. Pairs
        that carry cached reference log-probs (``_cache_reference``: per response token, two
        more entries) fill ``ref_logp`` at the response positions, so ``prepare`` runs no
        reference forward."""
        limit = self.ctx.model_cfg.max_position_embeddings
        tok = self.ctx.tokenizer
        eos = tok.eos_token_id
        prompts, responses = [], []
        for side in (1, 2):
            for pair in pairs:
                p = prompt_lib.encode(tok, pair[0])[: limit - 1]
                r = prompt_lib.encode(tok, pair[side]) + [eos]
                prompts.append(p)
                responses.append(r[: max(limit - len(p), 0)])
        packed = rollout.pack(prompts, responses, pad_id=self.ctx.pad_id, max_length=limit)
        batch = rollout.to_batch(packed)
        if all(len(pair) == 5 for pair in pairs):
            mask = np.asarray(batch.loss_mask) > 0
            ref = np.zeros(mask.shape, np.float32)
            for row, values in enumerate([p[3] for p in pairs] + [p[4] for p in pairs]):
                ref[row, mask[row]] = values
            batch = batch.replace(ref_logp=ref)
        return batch

    def _cache_reference(self, pairs: list[tuple[str, str, str]]) -> list[tuple]:
        """``pairs``, each with the frozen reference's per-token log-probs of its chosen and
        of its rejected response appended (``pref.cache_reference``): one reference pass over
        the data set, through the record's ``prepare``, in batches of ``pref.batch_size`` pairs
        (the last filled up with pairs from the start, whose values are dropped)."""
        from jax.experimental import multihost_utils

        t0 = time.perf_counter()
        size, n = self.cfg.pref.batch_size, len(pairs)
        out = []
        for start in range(0, n, size):
            chunk = [pairs[(start + j) % n] for j in range(size)]
            batch = self._preference_batch(chunk)
            prepared, _ = self.prepare(batch)
            ref = np.asarray(multihost_utils.process_allgather(prepared.ref_logp, tiled=True))
            mask = np.asarray(batch.loss_mask) > 0
            for i, pair in enumerate(chunk[: min(size, n - start)]):
                out.append((*pair[:3], ref[i][mask[i]], ref[i + size][mask[i + size]]))
        seconds = time.perf_counter() - t0
        log(f"pref.cache_reference: the reference's log-probs of {n} pairs in {seconds:.1f} s")
        return out

    def begin(self) -> None:
        pairs = self._preference_pairs()
        if self.cfg.pref.cache_reference and self.cfg.rl.algo in preference.REFERENCE_KINDS:
            pairs = self._cache_reference(pairs)
        # PromptIterator indexes any items; fast-forward the order on resume.
        self.iterator = iterators.PromptIterator(
            pairs, self.cfg.pref.batch_size, seed=self.cfg.run.seed + 2
        )
        for _ in range(self.position):
            self.iterator.next_batch()
        self.ctx.sampler.update_weights(self.state.params, version=self.position)

    def step(self) -> dict[str, float]:
        """One offline preference step: next pairs -> prepare (reference log-probs) -> update ->
        sync (the sampler serves held-out evaluation)."""
        t0 = time.perf_counter()
        batch, prepare_m = self.prepare(self._preference_batch(self.iterator.next_batch()))
        self.state, update_m = self.compiled.update(self.state, batch)
        out = {k: float(v) for k, v in jax.device_get({**prepare_m, **update_m}).items()}
        out["time/step_s"] = time.perf_counter() - t0
        self.position += 1
        self.ctx.sampler.update_weights(self.state.params, version=self.position)
        return out
