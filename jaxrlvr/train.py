"""The driver: SFT warm start, then the RL loop (GRPO / PPO / expert iteration), eval, checkpoints.

One RL step: prompts -> sampler (n = group size) -> rewards (grading pool) -> shaping and
advantages -> padded batch in a length bucket -> old / reference log-probs -> update epochs ->
weight sync to the sampler -> metrics; eval every ``eval.every`` steps on the held-out split,
an orbax checkpoint every ``checkpoint.every`` steps.

Everything random is derived from ``run.seed`` and the step number (sampler seeds, data order), and
every checkpoint holds the train state, the data position and the loop counters, so a run killed
at any point and resumed with ``--resume`` ends with the same parameters as one never killed.

Left out on purpose: asynchronous (off-policy) rollouts; sampling and training alternate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from jaxrlvr import checkpoint as checkpoint_lib
from jaxrlvr import config as config_lib
from jaxrlvr import configlib, rollout
from jaxrlvr import metrics as metrics_lib
from jaxrlvr import model as model_lib
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import loss_config, optim, updates, value
from jaxrlvr.algos import state as state_lib
from jaxrlvr.algos import step as step_lib
from jaxrlvr.data import iterators, loading, synthetic, templates
from jaxrlvr.data import tokenizer as tokenizer_lib
from jaxrlvr.rewards import grading, verifiers
from jaxrlvr.sampling import base as sampling_base


def log(msg: str) -> None:
    print(f"[jaxrlvr] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Set-up


def build_tokenizer(cfg: config_lib.TrainConfig):
    source = cfg.model.tokenizer or cfg.model.path
    if source == "char":
        return tokenizer_lib.build_char_tokenizer()
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(source)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_model(cfg: config_lib.TrainConfig, tokenizer, mesh) -> model_lib.Qwen2ForCausalLM:
    m = cfg.model
    if m.path is not None:
        return model_lib.load_hf(
            m.path,
            dtype=m.dtype,
            param_dtype=m.param_dtype,
            mesh=mesh,
            remat=m.remat,
            scan_layers=m.scan_layers,
        )
    model_cfg = model_lib.ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        remat=m.remat,
        scan_layers=m.scan_layers,
        hf_config={
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
    )
    return model_lib.init_model(model_cfg, seed=cfg.run.seed, mesh=mesh)


def load_splits(cfg: config_lib.TrainConfig) -> tuple[list[loading.Problem], list[loading.Problem]]:
    d = cfg.data
    if d.train == "synthetic":
        train, held_out = synthetic.make_splits(
            cfg.run.seed, d.synthetic_train_size, d.synthetic_eval_size, d.synthetic
        )
        return train, held_out

    def load(path, split):
        local = os.sep in path or path.endswith((".jsonl", ".json", ".parquet"))
        if local and not os.path.exists(path):
            raise FileNotFoundError(f"data file {path!r} not found")
        data_cfg = loading.DataConfig(
            path=path,
            split=split,
            question_field=d.question_field,
            answer_field=d.answer_field,
            solution_field=d.solution_field,
            on_bad_row=d.on_bad_row,
        )
        problems, stats = loading.load_problems(data_cfg)
        if stats.dropped:
            log(f"{path}: kept {stats.kept} problems, dropped {stats.dropped} ({stats.reasons})")
        if not problems:
            raise ValueError(f"{path}: no usable problems (dropped {stats.dropped})")
        return problems

    train = load(d.train, d.split)
    held_out = load(d.eval, d.eval_split) if d.eval else []
    return train, held_out


def render(cfg: config_lib.TrainConfig, problem: loading.Problem, tokenizer) -> str:
    return templates.render_prompt(cfg.data.template, problem.question, tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def sampling_params(cfg: config_lib.TrainConfig, tokenizer, *, eval_mode=False, seed=None):
    s = cfg.sampler
    stop_ids, stop_strings = [], []
    for text in s.stop:
        ids = encode(tokenizer, text)
        (stop_ids.append(ids[0]) if len(ids) == 1 else stop_strings.append(text))
    return sampling_base.SamplingParams(
        temperature=s.eval_temperature if eval_mode else s.temperature,
        top_p=1.0 if eval_mode else s.top_p,
        top_k=0 if eval_mode else s.top_k,
        max_tokens=(s.eval_max_tokens or s.max_tokens) if eval_mode else s.max_tokens,
        stop_token_ids=tuple(stop_ids),
        stop=tuple(stop_strings),
        seed=seed,
        thinking_budget=s.thinking_budget,
    )


def build_sampler(cfg: config_lib.TrainConfig, model, tokenizer, mesh, run_dir: str):
    eos = tuple(i for i in {tokenizer.eos_token_id} if i is not None)
    if cfg.sampler.kind == "jax":
        from jaxrlvr.sampling import jax_sampler

        return jax_sampler.JaxSampler(
            model.config, nnx.state(model, nnx.Param), tokenizer, mesh=mesh, eos_token_ids=eos
        )
    from jaxrlvr.sampling import vllm_sampler, vllm_server

    s = cfg.sampler
    if s.vllm_urls:
        return vllm_sampler.VLLMSampler(model.config, list(s.vllm_urls), tokenizer)
    # Start our own server on the current weights; it is restarted on the latest ones if it dies.
    from jaxrlvr.sampling import weight_export

    model_dir = os.path.join(run_dir, "vllm_model")
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    weight_export.export_weights(model.config, nnx.state(model, nnx.Param), model_dir)
    tokenizer.save_pretrained(model_dir)
    log(f"starting a vLLM server on {model_dir} (log: {run_dir}/vllm_server.log)")
    server = vllm_server.VLLMServer(
        model_dir,
        python=s.vllm_python or os.environ.get("JAXRLVR_VLLM_PYTHON") or sys.executable,
        max_model_len=min(s.vllm_max_model_len, model.config.max_position_embeddings),
        log_path=os.path.join(run_dir, "vllm_server.log"),
    )
    return vllm_sampler.VLLMSampler(
        model.config, [server], tokenizer, restart_dead_servers=s.vllm_restart
    )


# ----------------------------------------------------------------------------------------------
# Evaluation


def evaluate(cfg, sampler, tokenizer, problems, pool, reward_fn) -> dict[str, float]:
    problems = problems[: cfg.eval.max_problems]
    if not problems:
        return {}
    n = cfg.eval.samples_per_problem
    prompts = [encode(tokenizer, render(cfg, p, tokenizer)) for p in problems]
    params = sampling_params(cfg, tokenizer, eval_mode=True, seed=cfg.run.seed + 7919)
    completions = sampler.generate(prompts, n, params)
    truths = [p.answer for p in problems for _ in range(n)]
    scores, _ = pool.grade(reward_fn, [c.text for c in completions], truths)
    lengths = [len(c.token_ids) for c in completions]
    return {
        "eval/accuracy": float(np.mean([s["answer_reward"] for s in scores])),
        "eval/format_rate": float(np.mean([s["format_reward"] for s in scores])),
        "eval/reward_mean": float(np.mean([s["reward"] for s in scores])),
        "eval/response_length_mean": float(np.mean(lengths)),
        "eval/n": len(problems),
        "eval/samples_per_problem": n,
    }


# ----------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class LoopState:
    """Host-side counters saved with every checkpoint (JSON)."""

    phase: str = "sft"  # "sft" | "rl" | "done"
    sft_step: int = 0
    rl_step: int = 0
    data: dict | None = None
    eval_history: list = dataclasses.field(default_factory=list)
    eval_after_sft: dict | None = None


class Trainer:
    """Holds the run's components; ``run()`` drives the phases."""

    def __init__(
        self,
        cfg: config_lib.TrainConfig,
        *,
        resume: bool = False,
        step: int | None = None,
        train: bool = True,
    ):
        """``train=False`` (eval, export): no metrics log, the run's files are left as they are."""
        self.cfg = cfg
        self.run_dir = cfg.run.out_dir
        os.makedirs(self.run_dir, exist_ok=True)
        from jaxrlvr import distributed

        distributed.initialize(cfg.distributed)
        self.mesh = model_lib.make_mesh(cfg.mesh)
        self.tokenizer = build_tokenizer(cfg)
        self.pad_id = self.tokenizer.pad_token_id
        model = build_model(cfg, self.tokenizer, self.mesh)
        self.model_cfg = model.config
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.train_problems, self.eval_problems = load_splits(cfg)
        self.reward_fn = verifiers.make_reward_fn(
            verifiers.RewardConfig(name=cfg.reward.fn, format_weight=cfg.reward.format_weight)
        )
        self.pool = grading.GradingPool(
            num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s
        )
        self.loop = LoopState()
        self.ckpt = checkpoint_lib.Checkpointer(
            os.path.join(self.run_dir, "checkpoints"), keep=cfg.checkpoint.keep
        )
        self.logprob_fn = jax.jit(updates.make_logprob_fn(self.graphdef))
        self.ref_params = None
        self._init_phase_state(params)
        if resume:
            self._restore(step)
        elif train and jax.process_index() == 0:
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(config_lib.config_to_dict(cfg), f, sort_keys=False)
        self.iterator = self._make_iterator()
        if self.loop.data is not None:
            self.iterator.load_state_dict(self.loop.data)
        self._sampler = None
        self.metrics = None
        # Multi-host: every process runs the same loop; only process 0 writes the run's files.
        if not train or jax.process_index() != 0:
            return
        self.metrics = metrics_lib.MetricsLogger(self.run_dir, tensorboard=cfg.run.tensorboard)
        if resume:
            # Lines after the restored checkpoint were logged by the killed run; drop them.
            self.metrics.truncate_after(self.global_step + 1)

    def _log(self, step: int, metrics: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(step, metrics)

    @property
    def sampler(self):
        """The rollout sampler, started on first use (export never starts one)."""
        if self._sampler is None:
            self._sampler = build_sampler(
                self.cfg,
                nnx.merge(self.graphdef, self.state.params),
                self.tokenizer,
                self.mesh,
                self.run_dir,
            )
        return self._sampler

    # -- state and phases ---------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        return self.loop.sft_step + self.loop.rl_step

    def _phase_tx(self, phase: str):
        return optim.make_optimizer(self.cfg.sft.optim if phase == "sft" else self.cfg.optim)

    def _init_phase_state(self, params) -> None:
        phase = "sft" if self.cfg.sft.steps > 0 else "rl"
        self.loop.phase = phase
        self._set_state(phase, params, rng=jax.random.PRNGKey(self.cfg.run.seed))

    def _set_state(self, phase: str, params, rng) -> None:
        """(Re)builds the update, the state and their shardings for ``phase``."""
        cfg = self.cfg
        tx = self._phase_tx(phase)
        value_params = value_tx = self.value_graphdef = None
        if phase == "rl" and cfg.rl.algo == "ppo":
            if cfg.rl.ppo.trunk == "separate":
                # The critic starts as a copy of the policy at the start of RL (verl's default).
                self.value_graphdef, value_params = value.init_value_model(
                    self.graphdef, params, rng=cfg.run.seed + 1
                )
            else:
                value_params = value.init_value_head(self.model_cfg.hidden_size, cfg.run.seed + 1)
            value_tx = tx
        state = state_lib.TrainState.create(
            self.graphdef, params, tx, rng, value_params=value_params, value_tx=value_tx
        )
        self.state_shardings = step_lib.state_shardings(state, self.mesh)
        self.state = jax.device_put(state, self.state_shardings)
        self.update = self._make_update(phase, tx, value_tx)
        self._jitted = None
        if phase == "rl" and cfg.rl.loss.kl_coef > 0 and self.ref_params is None:
            self.ref_params = jax.tree.map(jnp.copy, self.state.params)

    def _make_update(self, phase, tx, value_tx):
        cfg = self.cfg
        schedule = optim.make_schedule(cfg.sft.optim if phase == "sft" else cfg.optim)
        if phase == "sft" or cfg.rl.algo == "expert_iteration":
            micro = cfg.sft.microbatches if phase == "sft" else cfg.rl.microbatches
            sft_cfg = updates.SFTUpdateConfig(num_microbatches=micro)
            factory = (
                updates.make_sft_update if phase == "sft" else updates.make_expert_iteration_update
            )
            return factory(self.graphdef, tx, sft_cfg, lr_schedule=schedule)
        if cfg.rl.algo == "ppo":
            ppo_cfg = updates.PPOUpdateConfig(
                loss=cfg.rl.loss,
                num_microbatches=cfg.rl.microbatches,
                **dataclasses.asdict(cfg.rl.ppo),
            )
            return updates.make_ppo_update(
                self.graphdef,
                tx,
                value_tx,
                ppo_cfg,
                lr_schedule=schedule,
                value_graphdef=self.value_graphdef,
            )
        grpo_cfg = updates.GRPOUpdateConfig(loss=cfg.rl.loss, num_microbatches=cfg.rl.microbatches)
        return updates.make_grpo_update(self.graphdef, tx, grpo_cfg, lr_schedule=schedule)

    def jitted_update(self, state, batch):
        """The compiled update (built on the first batch: its field set fixes the shardings)."""
        if self._jitted is None:
            self._jitted = step_lib.jit_update(
                self.update, self.state_shardings, step_lib.batch_shardings(batch, self.mesh)
            )
        return self._jitted(state, batch)

    def _make_iterator(self):
        cfg = self.cfg
        if cfg.rl.curriculum:
            return iterators.CurriculumPromptIterator(
                self.train_problems, cfg.rl.prompts_per_step, seed=cfg.run.seed
            )
        return iterators.PromptIterator(
            self.train_problems, cfg.rl.prompts_per_step, seed=cfg.run.seed
        )

    # -- checkpoints ----------------------------------------------------------------------------
    def _save(self) -> None:
        self.loop.data = self.iterator.state_dict()
        extra = {
            "loop": dataclasses.asdict(self.loop),
            "config": config_lib.config_to_dict(self.cfg),
        }
        tree = {"state": self.state, "ref_params": self.ref_params}
        self.ckpt.save(self.global_step, tree, extra)

    def _restore(self, step: int | None = None) -> None:
        """Restores checkpoint ``step`` (default: the newest complete one)."""
        step = self.ckpt.latest_step() if step is None else step
        if step is None:
            log(f"--resume: no complete checkpoint in {self.ckpt.directory}; starting fresh")
            return
        _, extra = self.ckpt.restore_extra(step)
        loop = LoopState(**extra["loop"])
        if loop.phase != self.loop.phase:
            self._set_state(loop.phase, self.state.params, self.state.rng)
        if loop.phase == "rl" and self.cfg.rl.loss.kl_coef > 0:
            self.ref_params = self.state.params
        target = {"state": self.state, "ref_params": self.ref_params}
        shardings = {"state": self.state_shardings, "ref_params": None}
        if self.ref_params is not None:
            shardings["ref_params"] = self.state_shardings.params
        abstract = checkpoint_lib.abstract_like(target, shardings)
        tree, _ = self.ckpt.restore(step, abstract)
        self.state, self.ref_params = tree["state"], tree["ref_params"]
        self.loop = loop
        log(f"resumed from checkpoint step {step} (phase {loop.phase})")

    # -- SFT ------------------------------------------------------------------------------------
    def _sft_examples(self) -> list[loading.Problem]:
        """SFT pairs as Problems (question = prompt text, answer = response text)."""
        cfg = self.cfg
        if cfg.sft.data == "gold":
            return [
                loading.Problem(
                    question=render(cfg, p, self.tokenizer),
                    answer=cfg.data.gold_format.replace("{answer}", p.answer),
                    id=p.id,
                )
                for p in self.train_problems
            ]
        import datasets

        try:
            rows = datasets.load_dataset("json", data_files=cfg.sft.data, split="train")
        except FileNotFoundError:
            raise FileNotFoundError(f"sft.data={cfg.sft.data!r}: file not found") from None
        examples, skipped = [], 0
        for i, row in enumerate(rows):
            prompt, response = row.get(cfg.sft.prompt_field), row.get(cfg.sft.response_field)
            if not isinstance(prompt, str) or not isinstance(response, str) or not response:
                skipped += 1
                continue
            examples.append(loading.Problem(question=prompt, answer=response, id=f"sft-{i}"))
        if skipped:
            log(f"{cfg.sft.data}: skipped {skipped} rows without a prompt and response")
        if not examples:
            raise ValueError(f"sft.data={cfg.sft.data!r}: no usable prompt/response rows")
        return examples

    def _sft_batch(self, examples: list[loading.Problem]) -> batch_lib.Batch:
        limit = self.model_cfg.max_position_embeddings
        prompts, responses = [], []
        for ex in examples:
            p = encode(self.tokenizer, ex.question)
            r = encode(self.tokenizer, ex.answer) + [self.tokenizer.eos_token_id]
            prompts.append(p[: limit - 1])
            responses.append(r[: max(limit - len(prompts[-1]), 0)])
        packed = rollout.pack(prompts, responses, pad_id=self.pad_id, max_length=limit)
        return self._to_batch(packed)

    def _to_batch(self, packed: rollout.PackedBatch, validate=True, **fields) -> batch_lib.Batch:
        arrays = dict(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            labels=packed.labels,
            loss_mask=packed.loss_mask,
        )
        arrays.update({k: v for k, v in fields.items() if v is not None})
        batch = batch_lib.Batch(**{k: np.asarray(v) for k, v in arrays.items()})
        if validate:
            batch_lib.validate_batch(batch, self.update.batch_spec)
        return step_lib.shard_batch(batch, self.mesh)

    def run_sft(self, progress) -> None:
        cfg = self.cfg
        sft_iter = iterators.PromptIterator(
            self._sft_examples(), cfg.sft.batch_size, seed=cfg.run.seed + 1
        )
        # Fast-forward the SFT data order on resume (cheap: host-side index arithmetic).
        for _ in range(self.loop.sft_step):
            sft_iter.next_batch()
        last: dict[str, float] = {}
        while self.loop.sft_step < cfg.sft.steps:
            t0 = time.perf_counter()
            batch = self._sft_batch(sft_iter.next_batch())
            self.state, m = self.jitted_update(self.state, batch)
            m = {f"sft/{k}": float(v) for k, v in jax.device_get(m).items()}
            m["time/step_s"] = time.perf_counter() - t0
            self.loop.sft_step += 1
            if self.loop.sft_step < cfg.sft.steps:
                self._log(self.global_step, m)
            else:
                last = m  # logged with the post-SFT evaluation below
            progress.update(1)
            progress.set_postfix(phase="sft", loss=f"{m.get('sft/loss', float('nan')):.3f}")
            # The last SFT step is saved after the switch to RL (below), under the same step.
            if (
                self.loop.sft_step % cfg.checkpoint.every == 0
                and self.loop.sft_step < cfg.sft.steps
            ):
                self._save()
        self.sampler.update_weights(self.state.params)
        ev = self._evaluate()
        self.loop.eval_after_sft = ev
        self._log(self.global_step, {**last, **ev})
        log(f"after SFT warm start: held-out accuracy {ev.get('eval/accuracy', float('nan')):.3f}")
        # Switch to the RL phase with a fresh optimiser state.
        self.loop.phase = "rl"
        self._set_state("rl", self.state.params, self.state.rng)
        self._save()

    # -- RL -------------------------------------------------------------------------------------
    def _sample(self, problems, n, seed):
        prompts = [encode(self.tokenizer, render(self.cfg, p, self.tokenizer)) for p in problems]
        params = sampling_params(self.cfg, self.tokenizer, seed=seed)
        completions = self.sampler.generate(prompts, n, params)
        if len(completions) != len(prompts) * n:
            raise RuntimeError(
                f"sampler returned {len(completions)} completions for {len(prompts)} x {n}"
            )
        return prompts, completions

    def _select_problems(self, step_seed: int):
        """Next prompts; with the difficulty filter, keep those the policy solves sometimes."""
        cfg = self.cfg.rl
        problems = self.iterator.next_batch()
        if not cfg.difficulty_filter:
            return problems, {}
        candidates = problems + self.iterator.next_batch()
        _, comps = self._sample(candidates, cfg.difficulty_filter_k, step_seed + 104729)
        scores, _ = self.pool.grade(
            self.reward_fn,
            [c.text for c in comps],
            [p.answer for p in candidates for _ in range(cfg.difficulty_filter_k)],
        )
        rates = (
            np.asarray([s["answer_reward"] for s in scores]).reshape(len(candidates), -1).mean(1)
        )
        informative = [p for p, r in zip(candidates, rates) if 0 < r < 1]
        rest = [p for p, r in zip(candidates, rates) if not 0 < r < 1]
        kept = (informative + rest)[: cfg.prompts_per_step]
        return kept, {"filter/informative_fraction": len(informative) / len(candidates)}

    def rl_step(self) -> dict[str, float]:
        cfg = self.cfg
        rl = cfg.rl
        timer = metrics_lib.PhaseTimer()
        step_seed = cfg.run.seed * 1_000_003 + self.loop.rl_step
        with timer.phase("sample"):
            problems, m = self._select_problems(step_seed)
            prompts, completions = self._sample(problems, rl.group_size, step_seed)
        g = rl.group_size
        texts = [c.text for c in completions]
        truths = [p.answer for p in problems for _ in range(g)]
        with timer.phase("reward"):
            scores, gstats = self.pool.grade(self.reward_fn, texts, truths)
        raw = np.asarray([s["reward"] for s in scores], np.float32)
        correct = np.asarray([s["answer_reward"] for s in scores], np.float32)
        lengths = np.asarray([len(c.token_ids) for c in completions], np.float32)
        length_weight = (
            rl.length_reward_weight if self.loop.rl_step >= rl.length_reward_from_step else 0.0
        )
        overlong = None
        if rl.overlong_cache_len:
            overlong = loss_config.OverlongConfig(
                max_len=cfg.sampler.max_tokens, cache_len=rl.overlong_cache_len
            )
        rewards, shaping_m = rollout.shaped_rewards(
            raw, correct, lengths, g, length_reward_weight=length_weight, overlong=overlong
        )
        adv, zero_var = rollout.group_advantages(rewards, g, rl.advantage)
        if isinstance(self.iterator, iterators.CurriculumPromptIterator):
            self.iterator.update([p.id for p in problems for _ in range(g)], list(correct))

        row_prompts = [prompts[i // g] for i in range(len(completions))]
        weights = [
            rollout.completion_weights(
                c, mask_forced=rl.mask_forced_tokens, mask_truncated=rl.loss.mask_truncated
            )
            for c in completions
        ]
        if rl.drop_zero_variance_groups:
            keep_rows = np.repeat(~zero_var, g)
            weights = [w if k else [0.0] * len(w) for w, k in zip(weights, keep_rows)]
        if rl.algo == "expert_iteration":
            weights = [w if c > 0 else [0.0] * len(w) for w, c in zip(weights, correct)]
        max_len = self.model_cfg.max_position_embeddings
        packed = rollout.pack(
            row_prompts,
            [c.token_ids for c in completions],
            pad_id=self.pad_id,
            sampler_logps=[c.logprobs for c in completions],
            loss_weights=weights,
            max_length=max_len,
        )

        with timer.phase("logprobs"):
            if rl.algo == "expert_iteration":
                batch = self._to_batch(packed)
            else:
                base = self._to_batch(packed, validate=False)
                old_logp, _ = self.logprob_fn(self.state.params, base)
                ref_logp = None
                if self.ref_params is not None:
                    ref_logp, _ = self.logprob_fn(self.ref_params, base)
                fields = dict(
                    advantages=adv,
                    old_logp=np.asarray(old_logp),
                    sampler_logp=packed.sampler_logp,
                    ref_logp=None if ref_logp is None else np.asarray(ref_logp),
                )
                if rl.algo == "ppo":
                    fields.pop("advantages")
                    fields["rewards"] = rewards
                    fields["old_values"] = np.asarray(
                        self.value_fn(self.state.params, self.state.value_params, base)
                    )
                spec = self.update.batch_spec
                fields = {
                    k: v for k, v in fields.items() if k in spec.required or k in spec.optional
                }
                batch = self._to_batch(packed, **fields)
        with timer.phase("update"):
            for _ in range(rl.epochs_per_step):
                self.state, um = self.jitted_update(self.state, batch)
            um = jax.device_get(um)
        with timer.phase("sync"):
            sync = self.sampler.update_weights(self.state.params, version=self.loop.rl_step + 1)
        self.loop.rl_step += 1

        mask = packed.loss_mask > 0
        gap = (
            np.abs(np.asarray(batch.old_logp) - packed.sampler_logp)[mask]
            if (rl.algo != "expert_iteration" and mask.any())
            else np.zeros(1)
        )
        out = {
            "reward_mean": float(raw.mean()),
            "reward_std": float(raw.std()),
            "shaped_reward_mean": float(rewards.mean()),
            "accuracy": float(correct.mean()),
            "format_rate": float(np.mean([s["format_reward"] for s in scores])),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            "zero_variance_group_fraction": float(zero_var.mean()),
            "truncated_fraction": float(
                np.mean([c.finish_reason == "length" for c in completions])
            ),
            "sampler_trainer_logprob_gap_mean": float(gap.mean()),
            "sampler_trainer_logprob_gap_max": float(gap.max()),
            "tokens/response": int(lengths.sum()),
            "tokens/batch_shape_T": int(packed.shape[1]),
        }
        out.update({k: float(v) for k, v in um.items()})
        out.update(m)
        out.update(shaping_m)
        out.update(gstats.as_metrics())
        out.update({f"sync/{k}": float(v) for k, v in (sync or {}).items()})
        seconds = timer.seconds
        out.update(timer.collect())
        sample_s = max(seconds.get("sample", 0.0), 1e-9)
        update_s = max(seconds.get("update", 0.0), 1e-9)
        out["throughput/sample_tokens_per_s"] = float(lengths.sum() / sample_s)
        out["throughput/update_tokens_per_s"] = float(
            packed.attention_mask.sum() * rl.epochs_per_step / update_s
        )
        return out

    def _evaluate(self) -> dict[str, float]:
        return evaluate(
            self.cfg, self.sampler, self.tokenizer, self.eval_problems, self.pool, self.reward_fn
        )

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        from tqdm import tqdm

        total = cfg.sft.steps + (cfg.rl.steps if cfg.rl.algo != "none" else 0)
        progress = tqdm(
            total=total,
            initial=self.global_step,
            disable=not cfg.run.progress,
            desc="train",
            dynamic_ncols=True,
        )
        t_start = time.perf_counter()
        if self.loop.phase == "sft":
            self.run_sft(progress)
        if cfg.sft.steps == 0 and self.loop.rl_step == 0 and cfg.eval.at_start:
            self.loop.eval_after_sft = self._evaluate()
            self._log(0, self.loop.eval_after_sft)
        if cfg.rl.algo != "none":
            if cfg.rl.algo == "ppo":
                self.value_fn = jax.jit(
                    value.make_value_fn(self.graphdef, value_graphdef=self.value_graphdef)
                )
            self.sampler.update_weights(self.state.params)
            while self.loop.rl_step < cfg.rl.steps:
                m = self.rl_step()
                if self.loop.rl_step % cfg.eval.every == 0 or self.loop.rl_step == cfg.rl.steps:
                    ev = self._evaluate()
                    m.update(ev)
                    self.loop.eval_history.append({"step": self.loop.rl_step, **ev})
                self._log(self.global_step, m)
                progress.update(1)
                progress.set_postfix(
                    phase=cfg.rl.algo,
                    reward=f"{m['reward_mean']:.2f}",
                    acc=f"{m.get('eval/accuracy', float('nan')):.2f}",
                )
                if (
                    self.loop.rl_step % cfg.checkpoint.every == 0
                    or self.loop.rl_step == cfg.rl.steps
                ):
                    self._save()
        progress.close()
        final = self.loop.eval_history[-1] if self.loop.eval_history else self._evaluate()
        self.loop.phase = "done"
        summary = {
            "run_dir": os.path.abspath(self.run_dir),
            "algo": cfg.rl.algo,
            "sft_steps": self.loop.sft_step,
            "rl_steps": self.loop.rl_step,
            "eval_accuracy_after_sft": (self.loop.eval_after_sft or {}).get("eval/accuracy"),
            "eval_accuracy_final": final.get("eval/accuracy"),
            "eval_format_rate_final": final.get("eval/format_rate"),
            "eval_history": self.loop.eval_history,
            "wall_s": time.perf_counter() - t_start,
            "checkpoints": os.path.abspath(self.ckpt.directory),
        }
        if self.metrics is not None:
            self.metrics.write_summary(summary)
        return summary

    def close(self) -> None:
        if self._sampler is not None:
            with contextlib.suppress(Exception):
                self._sampler.close()
        with contextlib.suppress(Exception):
            self.pool.close()
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                self.metrics.close()


def run(cfg: config_lib.TrainConfig, *, resume: bool = False) -> dict[str, Any]:
    """Runs a training job end to end and prints where its outputs are."""
    trainer = Trainer(cfg, resume=resume)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    plots_dir = os.path.join(cfg.run.out_dir, "plots")
    with contextlib.suppress(Exception):
        from jaxrlvr import plots

        plots.plot_runs([cfg.run.out_dir], plots_dir)
    before, after = summary["eval_accuracy_after_sft"], summary["eval_accuracy_final"]
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"
    print(f"held-out accuracy after SFT warm start: {fmt(before)}")
    print(f"held-out accuracy after {cfg.rl.algo.upper()}: {fmt(after)}")
    print(f"metrics: {os.path.join(cfg.run.out_dir, 'metrics.jsonl')}")
    print(f"plots: {plots_dir}")
    print(f"checkpoints: {summary['checkpoints']}")
    return summary


def evaluate_only(cfg: config_lib.TrainConfig, run_dir: str | None = None) -> dict[str, float]:
    if run_dir is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=run_dir))
    trainer = Trainer(cfg, resume=run_dir is not None, train=False)
    try:
        trainer.sampler.update_weights(trainer.state.params)
        return trainer._evaluate()
    finally:
        trainer.close()


def export_checkpoint(run_dir: str, out_dir: str, *, step: int | None = None) -> str:
    """Restores a checkpoint's params and writes a Hugging Face folder (config + safetensors)."""
    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = configlib.build(config_lib.TrainConfig, yaml.safe_load(f))
    cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, out_dir=run_dir, progress=False),
        mesh=model_lib.MeshConfig(data=1, fsdp=-1, tensor=1),
    )
    ckpt = checkpoint_lib.Checkpointer(os.path.join(run_dir, "checkpoints"))
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{run_dir}/checkpoints: no complete checkpoint")
    trainer = Trainer(cfg, resume=True, step=step, train=False)
    try:
        model = nnx.merge(trainer.graphdef, trainer.state.params)
        model_lib.save_hf(model, out_dir, tokenizer_src=trainer.tokenizer)
    finally:
        trainer.close()
    with open(os.path.join(out_dir, "jaxrlvr_export.json"), "w") as f:
        json.dump({"run_dir": os.path.abspath(run_dir), "step": step}, f)
    return out_dir
