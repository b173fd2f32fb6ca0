"""The TRL peer of ``jaxrlvr bench loop``: TRL's ``GRPOTrainer`` on a jaxrlvr train config's task.

Run as a worker (``python -m jaxrlvr.bench.trl_peer CONFIG --model DIR --steps N --out DIR``,
one process per system, started by ``bench.loop``). It reads the same config (and ``--set``
overrides) as ``jaxrlvr train`` and maps it onto TRL 1.16 (a test/bench extra, never a runtime
dependency of jaxrlvr):

- the model is the Hugging Face folder ``--model`` (the loop passes the jaxrlvr SFT warm start,
  exported with ``jaxrlvr export``), float32, eager PyTorch, ``generate`` for rollouts;
- data: the config's training split, rendered with its template and the same tokenizer
  (``builders.load_splits`` / ``builders.render`` / ``builders.build_tokenizer``); one step is
  ``rl.prompts_per_step`` prompts x ``rl.group_size`` completions, all in one optimizer step
  (``steps_per_generation=1``, one iteration: TRL then skips its old-log-prob pass too);
- rewards: the config's verifier (``builders.build_reward_fn``), called in-process;
- sampling: ``sampler.temperature``/``top_p``/``top_k``/``max_tokens``, and the config's stop
  strings that are single tokens (``</answer>`` in the demo) end a completion, as in jaxrlvr;
- loss: GRPO, sequence-mean of token-means (TRL ``loss_type="grpo"``, the demo's
  ``seq_mean_token_mean``), clip ``rl.loss.clip_eps_low``/``_high``, ``rl.loss.kl_coef`` as
  ``beta``, advantages scaled by the group std (``scale_rewards="group"``; TRL's std is the
  unbiased one, jaxrlvr's the population one: a factor sqrt(8/7) on the demo's groups that Adam
  mostly absorbs);
- optimiser: torch AdamW with the config's ``optim`` (betas, eps, weight decay, clip norm) and
  the warmup-cosine schedule over ``optim.total_steps`` (so a short run takes the first steps of
  the full run's schedule, as jaxrlvr does).

Timed per step (TRL's own methods wrapped): ``sample`` (``_generate``), ``reward``
(``_calculate_rewards``), ``logprobs`` (old/reference log-prob passes outside the loss), ``prep``
(the rest of TRL's batch preparation), ``update`` (forward, backward, optimizer step). TRL
generates with the training model, so there is no weight sync and no waiting. After the timed
phase the final model is saved and evaluated with jaxrlvr's own held-out evaluation
(``evaluation.evaluate_only``: same problems, sampler, seed and grader as the jaxrlvr run).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time


def _args(argv=None):
    p = argparse.ArgumentParser(prog="python -m jaxrlvr.bench.trl_peer")
    p.add_argument("config")
    p.add_argument("--model", required=True, help="Hugging Face folder of the warm start")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True, help="directory for the final model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument(
        "--whole-run",
        action="store_true",
        help="the whole demo: TRL SFT (sft.steps) from --model, then GRPO, with held-out "
        "evaluations after SFT and every eval.every GRPO steps (HF generate)",
    )
    p.add_argument("--_out", required=True)
    return p.parse_args(argv)


class _Timers:
    """Seconds per phase of the current step, and the finished steps' records."""

    def __init__(self):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.depth = 0  # > 0 inside compute_loss: log-prob passes there are the update's

    def add(self, name: str, seconds: float) -> None:
        self.current[name] = self.current.get(name, 0.0) + seconds


def _timed(timers: _Timers, name: str, fn, *, only_outside_loss: bool = False):
    def wrapper(*a, **kw):
        if only_outside_loss and timers.depth:
            return fn(*a, **kw)
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            timers.add(name, time.perf_counter() - start)

    return wrapper


def hf_evaluate(cfg, model, tokenizer, eval_problems, grade, stop_ids) -> float:
    """Held-out accuracy the way a TRL user measures it: HF ``generate`` on the first
    ``eval.max_problems`` held-out prompts (left-padded, one batch), ``eval.samples_per_problem``
    samples each at ``sampler.eval_temperature``, at most the eval token budget, graded by the
    config's verifier; the mean answer reward (avg@k), as ``evaluation.evaluate`` reports."""
    import torch

    from jaxrlvr import prompts as prompt_lib

    problems = eval_problems[: cfg.eval.max_problems]
    n, s = cfg.eval.samples_per_problem, cfg.sampler
    prompts = [
        prompt_lib.encode(tokenizer, prompt_lib.render(cfg.data.template, p, tokenizer))
        for p in problems
    ]
    width = max(len(x) for x in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in prompts])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=s.eval_temperature,
            top_p=1.0,
            top_k=0,
            max_new_tokens=s.eval_max_tokens or s.max_tokens,
            num_return_sequences=n,
            eos_token_id=stop_ids,
            pad_token_id=pad,
        )
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    truths = [p.answer for p in problems for _ in range(n)]
    return statistics.fmean(float(grade(t, a)["answer_reward"]) for t, a in zip(texts, truths))


def sft(cfg, model, tokenizer, problems, out: str):
    """The config's SFT warm start with TRL's ``SFTTrainer``: the gold completions
    (``data.gold_format``) of the training problems as prompt-completion pairs (loss on the
    completion and its EOS, TRL's default for such data), ``sft.steps`` steps of
    ``sft.batch_size``, AdamW with ``sft.optim`` (warmup then constant or cosine), clip norm."""
    import datasets
    import trl

    from jaxrlvr import prompts as prompt_lib
    from jaxrlvr.data import templates

    o = cfg.sft.optim
    rows = [
        {
            "prompt": prompt_lib.render(cfg.data.template, p, tokenizer),
            "completion": templates.render_gold(cfg.data.gold_format, p.answer, p.solution),
        }
        for p in problems
    ]
    scfg = trl.SFTConfig(
        output_dir=os.path.join(out, "sft"),
        per_device_train_batch_size=cfg.sft.batch_size,
        gradient_accumulation_steps=1,
        max_steps=cfg.sft.steps,
        learning_rate=o.learning_rate,
        lr_scheduler_type="cosine_with_min_lr"
        if o.schedule == "cosine"
        else "constant_with_warmup",
        warmup_steps=o.warmup_steps,
        adam_beta1=o.b1,
        adam_beta2=o.b2,
        adam_epsilon=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm or 0.0,
        max_length=model.config.max_position_embeddings,
        packing=False,
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        seed=cfg.run.seed,
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        router_aux_loss_coef=0.0,  # MoE: TRL otherwise trains the model config's aux loss
    )
    if o.schedule == "cosine":
        scfg.lr_scheduler_kwargs = {"min_lr_rate": o.final_lr_ratio}
    trainer = trl.SFTTrainer(
        model=model,
        args=scfg,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    assert_no_aux_loss(trainer)
    trainer.train()
    return model


def experts_implementation(config) -> str | None:
    """transformers' MoE experts kernel of a model config (Qwen3-MoE: "grouped_mm" by default);
    None for a dense model, whose config carries the attribute too (Qwen2's reads "eager")."""
    if not getattr(config, "num_experts", 0):
        return None
    return getattr(config, "_experts_implementation", None)


def assert_no_aux_loss(trainer) -> None:
    """TRL 1.16 adds a MoE model's router load-balancing loss whenever its coefficient is
    non-zero (the config's ``router_aux_loss_coef``, 0.001 for Qwen3-MoE, unless the trainer's
    config overrides it); jaxrlvr's demo trains without it, so both peers set it to 0 and this
    checks that the trainer took it (``aux_loss_enabled``, and the model returns no router
    logits)."""
    config = trainer.model.config
    if trainer.aux_loss_enabled or getattr(config, "output_router_logits", False):
        raise RuntimeError(
            f"TRL trains the router aux loss (coef {trainer.router_aux_loss_coef}); "
            "the peer must run without it"
        )


def main(argv=None) -> int:
    args = _args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl

    from jaxrlvr import builders, evaluation
    from jaxrlvr import config as config_lib
    from jaxrlvr import prompts as prompt_lib
    from jaxrlvr.bench import common

    cfg = config_lib.load_config(args.config, list(args.set))
    rl, s, o = cfg.rl, cfg.sampler, cfg.optim
    tokenizer = builders.build_tokenizer(cfg.model)
    problems, _ = builders.load_splits(cfg)
    data = datasets.Dataset.from_list(
        [
            {"prompt": prompt_lib.render(cfg.data.template, p, tokenizer), "answer": p.answer}
            for p in problems
        ]
    )
    grade = builders.build_reward_fn(cfg)

    def reward(prompts, completions, answer, **_):
        return [float(grade(c, a)["reward"]) for c, a in zip(completions, answer)]

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    stop_ids = [tokenizer.eos_token_id]
    for text in s.stop:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            stop_ids.append(ids[0])
    evals: list[dict] = []
    phase_s: dict[str, float] = {}
    if args.whole_run:
        eval_problems = builders.load_splits(cfg, train=False)[1]
        torch.manual_seed(cfg.run.seed)

        def run_eval(phase: str, step: int) -> None:
            t = time.perf_counter()
            acc = hf_evaluate(cfg, model, tokenizer, eval_problems, grade, stop_ids)
            evals.append({"phase": phase, "step": step, "accuracy": acc})
            phase_s["eval"] = phase_s.get("eval", 0.0) + time.perf_counter() - t

        if cfg.sft.steps > 0:
            t = time.perf_counter()
            sft(cfg, model, tokenizer, problems, args.out)
            phase_s["sft"] = time.perf_counter() - t
            run_eval("sft", cfg.sft.steps)
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    rollouts = rl.prompts_per_step * rl.group_size
    tcfg = trl.GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=rollouts,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=rl.group_size,
        num_iterations=rl.epochs_per_step,
        max_completion_length=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        beta=rl.loss.kl_coef,
        epsilon=rl.loss.clip_eps_low,
        epsilon_high=rl.loss.clip_eps_high,
        loss_type="grpo",
        scale_rewards="group" if rl.advantage.scale == "group_std" else "none",
        max_grad_norm=o.max_grad_norm or 0.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=cfg.run.seed,
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        disable_dropout=True,
        log_completions=False,
        disable_tqdm=True,
        router_aux_loss_coef=0.0,  # MoE: off, as in jaxrlvr's demo (``assert_no_aux_loss``)
    )
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.learning_rate,
        betas=(o.b1, o.b2),
        eps=o.eps,
        weight_decay=o.weight_decay,
    )
    total = o.total_steps or args.steps
    if o.schedule == "cosine":
        sched = transformers.get_cosine_schedule_with_warmup(opt, o.warmup_steps, total)
    else:
        sched = transformers.get_constant_schedule_with_warmup(opt, o.warmup_steps)

    timers = _Timers()

    class Timed(trl.GRPOTrainer):
        pass

    trainer = Timed(
        model=model,
        reward_funcs=[reward],
        args=tcfg,
        train_dataset=data,
        processing_class=tokenizer,
        optimizers=(opt, sched),
    )
    assert_no_aux_loss(trainer)
    # Wrap the instance's methods (TRL's own code runs unchanged inside them).
    trainer._generate = _timed(timers, "sample", trainer._generate)
    trainer._calculate_rewards = _timed(timers, "reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = _timed(
        timers, "logprobs", trainer._get_per_token_logps_and_entropies, only_outside_loss=True
    )
    trainer._prepare_inputs = _timed(timers, "prepare_inputs", trainer._prepare_inputs)
    inner_loss = trainer.compute_loss

    def compute_loss(*a, **kw):
        timers.depth += 1
        try:
            return inner_loss(*a, **kw)
        finally:
            timers.depth -= 1

    trainer.compute_loss = compute_loss

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            timers.current = {}
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            step = time.perf_counter() - self.start
            c = timers.current
            inner = c.get("sample", 0.0) + c.get("reward", 0.0) + c.get("logprobs", 0.0)
            timers.steps.append(
                {
                    "sample": c.get("sample", 0.0),
                    "reward": c.get("reward", 0.0),
                    "logprobs": c.get("logprobs", 0.0),
                    "shape": max(c.get("prepare_inputs", 0.0) - inner, 0.0),
                    "update": max(step - c.get("prepare_inputs", 0.0), 0.0),
                    "sync": 0.0,
                    "wait_rollouts": 0.0,
                    "step": step,
                }
            )

    trainer.add_callback(StepClock())
    history: list[dict] = []

    class Metrics(transformers.TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs:
                history.append(dict(logs))

    trainer.add_callback(Metrics())
    if args.whole_run and cfg.eval.every:

        class Evaluate(transformers.TrainerCallback):
            """The held-out evaluation every ``eval.every`` GRPO steps and after the last, as
            jaxrlvr train runs it (outside the step times, inside the run's wall time)."""

            def on_step_end(self, _args, state, *_, **__):
                if state.global_step % cfg.eval.every == 0 or state.global_step == args.steps:
                    run_eval("rl", state.global_step)

        trainer.add_callback(Evaluate())
    start = time.perf_counter()
    trainer.train()
    phase_s["grpo"] = time.perf_counter() - start
    work_end = time.time()  # the run's own work ends here (bench.loop's whole-run wall time)

    final_dir = os.path.join(args.out, "final_hf")
    model.save_pretrained(final_dir)
    tokenizer.save_pretrained(final_dir)
    eval_cfg = config_lib.load_config(
        args.config, list(args.set) + [f"model.path={final_dir}", "sft.steps=0"]
    )
    eval_cfg = dataclasses.replace(
        eval_cfg, run=dataclasses.replace(eval_cfg.run, out_dir=os.path.join(args.out, "eval"))
    )
    ev = evaluation.evaluate_only(eval_cfg)

    lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
    record = {
        "system": "trl",
        "version": trl.__version__,
        "torch": torch.__version__,
        "model_type": model.config.model_type,
        "experts_implementation": experts_implementation(model.config),
        "router_aux_loss": trainer.aux_loss_enabled,
        "threads": torch.get_num_threads(),
        "steps": timers.steps,
        "phase_s": phase_s["grpo"],
        "phases_s": phase_s,
        "own_evals": evals,
        "work_end": work_end,
        "median_step_s": statistics.median(x["step"] for x in timers.steps),
        "response_tokens": [ln * rollouts for ln in lengths],
        "reward_mean": [h.get("reward") for h in history if "reward" in h],
        "eval_final": ev.get("eval/accuracy", math.nan),
        "peak_rss_mib": common.peak_rss_mib(),
    }
    common.save_json(args._out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
