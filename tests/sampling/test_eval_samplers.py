"""`evaluation.evaluate_detailed` on the JAX sampler and on the session's real vLLM server: the
same greedy samples give the same pass@k / maj@k / avg@n, problem by problem."""

import types

import pytest
from flax import nnx

from jaxrlvr import config as config_lib
from jaxrlvr import evaluation, prompts
from jaxrlvr.data import synthetic
from jaxrlvr.phases import base as phases_base
from jaxrlvr.rewards import grading, verifiers
from jaxrlvr.sampling import jax_sampler, vllm_sampler


def _ctx(sampler, tok, problems, grader):
    """The parts of a ``RunContext`` the evaluation reads, around real samplers and grader, with
    ``RunContext``'s own ``sample`` / ``sample_and_grade`` (the one seeding rule)."""
    ctx = types.SimpleNamespace(
        row_block=(0, 1),
        eval_problems=problems,
        tokenizer=tok,
        sampler=sampler,
        grader=grader,
        encode_prompts=lambda ps: prompts.encode_many(tok, [p.question for p in ps]),
    )
    ctx.sample = types.MethodType(phases_base.RunContext.sample, ctx)
    ctx.sample_and_grade = types.MethodType(phases_base.RunContext.sample_and_grade, ctx)
    return ctx


@pytest.mark.vllm
def test_jax_and_vllm_greedy_samples_give_the_same_report(vllm_server, tiny_export):
    server, state = vllm_server
    tok = tiny_export["tokenizer"]
    _, problems = synthetic.make_splits(0, 0, 6)
    eval_cfg = config_lib.EvalSection(
        max_problems=6, samples_per_problem=4, pass_k=(1, 4), maj_k=(4,)
    )
    reward = verifiers.make_reward_fn(verifiers.RewardConfig(name="synthetic"))
    grader = grading.Grader(reward, grading.GradingPool(num_workers=1, timeout_s=10.0))
    out = {}
    try:
        model = nnx.merge(tiny_export["graphdef"], state["params"])
        for kind in ("jax", "vllm"):
            sampler_cfg = config_lib.SamplerSection(
                kind=kind, eval_temperature=0.0, max_tokens=8, stop=()
            )
            if kind == "jax":
                sampler = jax_sampler.JaxSampler(model, tok, eos_token_ids=(0,))
            else:
                sampler = vllm_sampler.VLLMSampler(tiny_export["cfg"], server, tok)
            try:
                out[kind] = evaluation.evaluate_detailed(
                    _ctx(sampler, tok, problems, grader),
                    eval_cfg,
                    sampler_cfg,
                    seed=0,
                    reward_names={None: "synthetic"},
                    chunk=4,  # two calls: the chunked path both samplers take in jaxrlvr eval
                )
            finally:
                sampler.close()
    finally:
        grader.close()
    (jax_metrics, jax_rows), (vllm_metrics, vllm_rows) = out["jax"], out["vllm"]
    assert [r["votes"] for r in jax_rows] == [r["votes"] for r in vllm_rows]
    assert [r["answer_rewards"] for r in jax_rows] == [r["answer_rewards"] for r in vllm_rows]
    assert len(jax_rows) == 6 and any(v is not None for r in jax_rows for v in r["votes"])
    for key in ("eval/pass@1", "eval/pass@4", "eval/maj@4", "eval/avg@4"):
        assert jax_metrics[key] == vllm_metrics[key], key
