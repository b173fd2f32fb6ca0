"""The SFT phase: supervised fine-tuning on prompt/response pairs (the RL run's warm start).

Pairs are the training problems' gold responses (``sft.data: gold``, rendered in
``data.gold_format``) or rows of a jsonl file read with ``datasets``. A step is the next
``sft.batch_size`` pairs (prompt + response + EOS, packed or padded, cut to the model's context) ->
the compiled prepare -> update. (With ``env.tools`` a response is a written tool-use trace whose
tool outputs are kept out of the loss: ``tool.ToolSFTPhase``.) The data order is derived from
``run.seed`` and fast-forwarded on resume, so the position is the step count alone. After the
last step the sampler receives the weights (the held-out evaluation after the warm start samples
from them).
"""

from __future__ import annotations

import time

import jax

from jaxrlvr import prompts as prompt_lib
from jaxrlvr import rollout
from jaxrlvr.algos import registry
from jaxrlvr.algos import step as step_lib
from jaxrlvr.data import iterators, loading, shards, templates
from jaxrlvr.phases import base


class SFTPhase(base.Phase):
    name = "sft"
    sections = ("sft", "rl", "data", "run")

    @classmethod
    def wanted(cls, cfg: base.Sections) -> bool:
        """A warm start when ``sft.steps`` > 0, and the whole of an SFT-only run (``rl.algo:
        none``)."""
        return cfg.sft.steps > 0 or cfg.rl.algo == "none"

    @classmethod
    def geometry(cls, cfg):
        sft = cfg.sft
        if sft.steps <= 0 and cfg.rl.algo != "none":
            return None
        return base.BatchGeometry(
            rows=sft.batch_size,
            rows_key="sft.batch_size",
            microbatches=sft.microbatches,
            section="sft",
            packed=sft.packing,
            per_shard=(sft.batch_size, "sft.batch_size") if sft.steps > 0 else None,
        )

    @classmethod
    def data_files(cls, cfg):
        sft = cfg.sft
        if sft.data == "gold":  # the training problems' gold responses
            return [base.DataFile("data.train", cfg.data.train, sft.batch_size, "sft.batch_size")]
        return [base.DataFile("sft.data", sft.data, sft.batch_size, "sft.batch_size")]

    @classmethod
    def method(cls, cfg):
        return registry.SFT

    @property
    def total_steps(self) -> int:
        return self.cfg.sft.steps

    def postfix(self, metrics):
        return {"phase": "sft", "loss": f"{metrics.get('sft/loss', float('nan')):.3f}"}

    def report(self, summary):
        after = base.accuracy_text(summary["eval_accuracy_after_sft"])
        return [f"held-out accuracy after SFT warm start: {after}"]

    @classmethod
    def summary_defaults(cls, evals):
        # Without a warm start, the accuracy "after SFT" is the starting one.
        start = evals.get("start") or {}
        return {"sft_steps": 0, "eval_accuracy_after_sft": start.get("eval/accuracy")}

    def summary(self, evals):
        out = {"sft_steps": self.position}
        if "sft" in evals:
            out["eval_accuracy_after_sft"] = evals["sft"].get("eval/accuracy")
        return out

    def examples(self) -> list[loading.Problem]:
        """SFT pairs as Problems (question = prompt text, answer = response text)."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.sft.data == "gold":
            # A task mixture: each source's problems take its own gold_format.
            formats = {m.domain: m.data.gold_format for m in cfg.data.mixture}
            return [
                loading.Problem(
                    question=ctx.render(p),
                    answer=templates.render_gold(
                        formats.get(p.domain, cfg.data.gold_format), p.answer, p.solution
                    ),
                    id=p.id,
                )
                for p in ctx.train_problems
            ]
        rows = loading.read_rows(cfg.sft.data, on_bad_row=cfg.data.on_bad_row, key="sft.data")
        examples, skipped = [], 0
        for i, row in enumerate(rows):
            prompt, response = row.get(cfg.sft.prompt_field), row.get(cfg.sft.response_field)
            if not isinstance(prompt, str) or not isinstance(response, str) or not response:
                skipped += 1
                continue
            examples.append(loading.Problem(question=prompt, answer=response, id=f"sft-{i}"))
        if skipped:
            prompt_lib.log(f"{cfg.sft.data}: skipped {skipped} rows without a prompt and response")
        if not examples:
            raise ValueError(f"sft.data={cfg.sft.data!r}: no usable prompt/response rows")
        return examples

    def make_iterator(self):
        """The SFT order: one iterator, or one per owned data shard (gold pairs follow their
        problems' shards; pairs from a file are split like the problems)."""
        cfg, ctx = self.cfg, self.ctx
        examples = self.examples()
        if ctx.num_shards == 1:
            return iterators.PromptIterator(examples, cfg.sft.batch_size, seed=cfg.run.seed + 1)
        if cfg.sft.data == "gold":  # in ctx.train_problems' order: the owned shards'
            per_shard, start = {}, 0
            for i, problems in ctx.train_shards.items():
                per_shard[i] = examples[start : start + len(problems)]
                start += len(problems)
        else:
            split = shards.split(examples, ctx.num_shards, cfg.run.seed + 1)
            per_shard = {i: split[i] for i in ctx.train_shards}
        size = cfg.sft.batch_size // ctx.num_shards
        return shards.ShardedIterator(
            per_shard,
            lambda items, seed: iterators.PromptIterator(items, size, seed=seed),
            seed=cfg.run.seed + 1,
        )

    def responses(self, texts: list[str]) -> list[tuple[list[int], list[float] | None]]:
        """Each response's token ids + EOS, and its loss weights (None: every token counts;
        the tool-use warm start weighs a trace's tool outputs 0, ``tool.ToolSFTPhase``)."""
        tok = self.ctx.tokenizer
        return [(ids + [tok.eos_token_id], None) for ids in prompt_lib.encode_many(tok, texts)]

    def batch(self, examples: list[loading.Problem]):
        """The host batch of ``examples``: prompt + response + EOS, cut to the context."""
        ctx = self.ctx
        limit = ctx.model_cfg.max_position_embeddings
        prompts, responses, weights = [], [], []
        questions = prompt_lib.encode_many(ctx.tokenizer, [ex.question for ex in examples])
        answers = self.responses([ex.answer for ex in examples])
        for p, (r, w) in zip(questions, answers, strict=True):
            prompts.append(p[: limit - 1])
            keep = max(limit - len(prompts[-1]), 0)
            responses.append(r[:keep])
            weights.append(w[:keep] if w is not None else [1.0] * len(responses[-1]))
        sft = self.cfg.sft
        packed = rollout.pack(
            prompts,
            responses,
            pad_id=ctx.pad_id,
            max_length=limit,
            segments=sft.packing,
            row_tokens=sft.max_tokens_per_row,
            row_multiple=sft.microbatches * step_lib.batch_shard_count(ctx.mesh),
            loss_weights=weights if any(w is not None for _, w in answers) else None,
        )
        return rollout.to_batch(packed)

    def begin(self) -> None:
        self.iterator = self.make_iterator()
        # Fast-forward the data order on resume (cheap: host-side index arithmetic).
        for _ in range(self.position):
            self.iterator.next_batch()

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch, _ = self.compiled.prepare(self.state, self.batch(self.iterator.next_batch()))
        self.state, m = self.compiled.update(self.state, batch)
        m = {f"sft/{k}": float(v) for k, v in jax.device_get(m).items()}
        m["time/step_s"] = time.perf_counter() - t0
        self.position += 1
        return m

    def finish(self) -> None:
        self.ctx.sampler.update_weights(self.state.params)
