"""Reward-grading throughput: responses graded per second, in process and with ``GradingPool``.

Workloads (built from the shipped samples and the synthetic task, seeded):
- ``r1_zero_math``: R1-Zero responses to the MATH-style samples, each with ~1,500 characters of
  "reasoning" and an answer that is right (in the gold's form or an equivalent one), wrong (a
  random number, so sympy's caches rarely hit), or ill-formed, in proportions 4:4:2.
- ``gsm8k``: GSM8K-style responses ending in a right or wrong number.
- ``synthetic``: short answers to the synthetic arithmetic task.

For each workload it reports the in-process serial rate (``grade_in_process``, no deadline) and
the pool rate (``GradingPool(num_workers, timeout_s)``; worker start-up excluded and reported on
its own). Not a test: numbers are for the closing note and for spotting regressions by eye.

- ``code``: programs per second for ``reward.fn: code`` (answers to the synthetic code task, half
  right, half wrong, plus the MBPP-layout sample's reference solutions): the pool (each worker
  with its warm bubblewrap sandbox), one warm sandbox in process, and the plain baseline, a fresh
  unsandboxed ``python -I -S`` subprocess per program (serial, as a simple grader would run it).
  ``agreement`` is the fraction of programs where the pool and the plain subprocess agree on
  all-pass. ``clean_check_ms``: the harness's clean-up and clean-state checks after each
  program (mean ms, from ``RunResult.check_seconds`` of one more in-process pass), included in
  every rate above; ``restarts``: sandboxes replaced because a program left them unclean.

Usage: ``jaxrlvr bench rewards [--n 600] [--workers 2] [--timeout 5] [--json PATH]`` (or
``python benchmarks/bench_rewards.py``).
"""

from __future__ import annotations

import os
import platform
import random
import time

from jaxrlvr import data, rewards, sandbox
from jaxrlvr.bench import common
from jaxrlvr.data import code_loading, synthetic, synthetic_code
from jaxrlvr.rewards import code, grading, math_equiv

_FILLER = "Let me think about this step by step. We rewrite the expression and simplify. " * 20


def _math_workload(n: int, rng: random.Random):
    problems, _ = data.load_problems(data.DataConfig.math(data.sample_path("math_sample.jsonl")))
    responses, truths = [], []
    for i in range(n):
        p = problems[i % len(problems)]
        kind = rng.random()
        if kind < 0.4:
            answer = p.answer if rng.random() < 0.5 else f"\\boxed{{{p.answer}}}"
        elif kind < 0.8:
            answer = f"\\frac{{{rng.randint(1, 10_000)}}}{{{rng.randint(2, 97)}}}"
        else:
            responses.append(_FILLER + f" </think><answer>{p.answer}</answer>")
            truths.append(p.answer)
            continue
        responses.append(_FILLER + f" </think> <answer>{answer}</answer>")
        truths.append(p.answer)
    return rewards.r1_zero_reward_fn, responses, truths


def _gsm8k_workload(n: int, rng: random.Random):
    problems, _ = data.load_problems(data.DataConfig.gsm8k(data.sample_path("gsm8k_sample.jsonl")))
    responses, truths = [], []
    for i in range(n):
        p = problems[i % len(problems)]
        value = p.answer if rng.random() < 0.5 else str(rng.randint(0, 10_000))
        responses.append(_FILLER[:600] + f" So the answer is {value}.")
        truths.append(f"#### {p.answer}")
    return rewards.gsm8k_reward_fn, responses, truths


def _synthetic_workload(n: int, rng: random.Random):
    train, _ = synthetic.make_splits(0, min(n, 2000), 0, 2)
    responses, truths = [], []
    for i in range(n):
        p = train[i % len(train)]
        value = p.answer if rng.random() < 0.5 else str(rng.randint(0, 99))
        responses.append(f" {value}")
        truths.append(p.answer)
    return rewards.synthetic_reward_fn, responses, truths


def _code_workload(n: int, rng: random.Random):
    train, _ = synthetic_code.make_splits(0, min(n, 2000), 0)
    mbpp, _ = code_loading.load_code_problems(data.sample_path("mbpp_sample.jsonl"), "mbpp")
    responses, truths = [], []
    for i in range(n):
        if i % 10 == 9:
            p = mbpp[i % len(mbpp)]
            responses.append(f"```python\n{p.solution}```")
        else:
            p = train[i % len(train)]
            body = p.solution if rng.random() < 0.5 else f"x+{rng.randint(0, 9)}"
            responses.append(f" <answer>{body}</answer>")
        truths.append(p.answer)
    fn = code.make_code_reward_fn(code.CodeRewardConfig(mode="all_pass"))
    return fn, responses, truths


def _plain_subprocess(responses, truths) -> tuple[list[bool], float]:
    """All-pass per program, each run as a fresh unsandboxed ``python -I -S`` process."""
    import subprocess
    import tempfile

    python = sandbox.base_python()
    passed = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (response, truth) in enumerate(zip(responses, truths, strict=True)):
            task = code.CodeTask.from_json(truth)
            source = code.extract_code(response) or ""
            script = "\n".join([task.prefix + source, task.setup, *task.tests]) + "\n"
            path = os.path.join(tmp, f"p{i}.py")
            with open(path, "w") as f:
                f.write(script)
            try:
                proc = subprocess.run(
                    [python, "-I", "-S", path], capture_output=True, timeout=5.0, cwd=tmp
                )
                passed.append(proc.returncode == 0)
            except subprocess.TimeoutExpired:
                passed.append(False)
    return passed, time.perf_counter() - start


def _clean_checks(fn, responses, truths) -> tuple[list[float], int]:
    """Each program's clean-up and clean-state check time in this process's warm sandbox (the
    same programs and sandbox as ``fn``), and how many times the sandbox was replaced."""
    cfg = fn.keywords["sandbox"]
    box = sandbox.shared_sandbox(cfg)
    restarts = box.restarts
    seconds = []
    for response, truth in zip(responses, truths, strict=True):
        source = code.extract_code(response, fn.keywords["extract"])
        if source is not None:
            seconds.append(
                code.run_tests(source, code.CodeTask.from_json(truth), cfg).check_seconds
            )
    return seconds, box.restarts - restarts


def _code_case(pool: grading.GradingPool, n: int, workers: int) -> dict:
    fn, responses, truths = _code_workload(n, random.Random(0))
    pool.grade(fn, responses[: 2 * workers], truths[: 2 * workers])  # start the sandboxes
    pooled, pool_stats = pool.grade(fn, responses, truths)
    fn(responses[0], truths[0])  # this process's warm sandbox
    serial, serial_stats = grading.grade_in_process(fn, responses, truths)
    plain, plain_s = _plain_subprocess(responses, truths)
    checks, restarts = _clean_checks(fn, responses, truths)
    agree = sum((s["reward"] == 1.0) == p for s, p in zip(pooled, plain)) / len(plain)
    sandbox.close_shared()
    return {
        "n": len(responses),
        "in_process_per_s": len(responses) / serial_stats.seconds,
        "pool_per_s": len(responses) / pool_stats.seconds,
        "plain_subprocess_per_s": len(responses) / plain_s,
        "pool_vs_plain_subprocess": plain_s / pool_stats.seconds,
        "pool_timeouts": pool_stats.timeouts,
        "pool_errors": pool_stats.errors,
        "mean_reward": sum(s["reward"] for s in pooled) / len(pooled),
        "pool_agrees_with_plain_subprocess": agree,
        "in_process_agrees_with_pool": sum(a == b for a, b in zip(serial, pooled)) / len(serial),
        "clean_check_ms": 1000 * sum(checks) / max(1, len(checks)),
        "clean_check_share_of_in_process": sum(checks) / serial_stats.seconds,
        "restarts": restarts,
    }


WORKLOADS = {
    "r1_zero_math": _math_workload,
    "gsm8k": _gsm8k_workload,
    "synthetic": _synthetic_workload,
}


def main(argv=None) -> int:
    parser = common.parser("rewards", __doc__)
    parser.add_argument("--n", type=int, default=600, help="responses per workload")
    parser.add_argument("--workers", type=int, default=2, help="grading pool processes")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per response")
    args = parser.parse_args(argv)

    math_equiv.is_equivalent("\\frac12", "0.5")  # import/warm math-verify in this process too
    start = time.perf_counter()
    pool = grading.GradingPool(num_workers=args.workers, timeout_s=args.timeout)
    pool.grade(
        rewards.r1_zero_reward_fn,
        ["x </think> <answer>1</answer>"] * args.workers,
        [1] * args.workers,
    )
    startup_s = time.perf_counter() - start

    results = {}
    with pool:
        for name, build in WORKLOADS.items():
            fn, responses, truths = build(args.n, random.Random(0))
            pooled, pool_stats = pool.grade(fn, responses, truths)
            math_equiv.clear_parse_cache()  # in-process starts as cold as the workers did
            serial, serial_stats = grading.grade_in_process(fn, responses, truths)
            agree = sum(a == b for a, b in zip(serial, pooled)) / len(serial)
            results[name] = {
                "n": len(responses),
                "in_process_per_s": len(responses) / serial_stats.seconds,
                "pool_per_s": len(responses) / pool_stats.seconds,
                "pool_timeouts": pool_stats.timeouts,
                "pool_errors": pool_stats.errors,
                "mean_reward": sum(s["reward"] for s in pooled) / len(pooled),
                "pool_agrees_with_in_process": agree,
            }
            r = results[name]
            print(
                f"{name:13s} n={r['n']:5d}  in-process {r['in_process_per_s']:8.1f}/s  "
                f"pool({args.workers}) {r['pool_per_s']:8.1f}/s  timeouts={r['pool_timeouts']} "
                f"errors={r['pool_errors']}  mean reward {r['mean_reward']:.3f}  "
                f"agreement {agree:.3f}"
            )
        r = results["code"] = _code_case(pool, args.n, args.workers)
        print(
            f"{'code':13s} n={r['n']:5d}  in-process {r['in_process_per_s']:8.1f}/s  "
            f"pool({args.workers}) {r['pool_per_s']:8.1f}/s  plain subprocess "
            f"{r['plain_subprocess_per_s']:6.1f}/s  ({r['pool_vs_plain_subprocess']:.2f}x)  "
            f"timeouts={r['pool_timeouts']} errors={r['pool_errors']}  mean reward "
            f"{r['mean_reward']:.3f}  agreement {r['pool_agrees_with_plain_subprocess']:.3f}  "
            f"clean-state check {r['clean_check_ms']:.2f} ms/program "
            f"({100 * r['clean_check_share_of_in_process']:.1f}% of in-process)  "
            f"restarts {r['restarts']}"
        )
    print(f"pool start-up (workers ready + first call): {startup_s:.2f} s")

    if args.json:
        report = {
            "benchmark": "rewards",
            "workers": args.workers,
            "timeout_s": args.timeout,
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "pool_startup_s": startup_s,
            "workloads": results,
        }
        common.save_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
