"""On-policy distillation end to end (issue 41): ``jaxrlvr train`` with ``rl.algo: distill``
(configs/distill_demo.yaml) on a tiny model whose teachers are Hugging Face folders written here.

- Two tasks in one run (``data.mixture``: the demo's arithmetic and the code demo's functions,
  each problem graded by its task's verifier), each domain scored by its own teacher: the
  arithmetic's is the student's copy, so its per-token reverse KL is 0 at step 1 (the JAX
  sampler's log-probs and the teacher's pass are the same computation), the code's is not.
- A peaked student (embedding scaled up: low entropy) distilled from a near-uniform random
  teacher: the reverse KL falls over six steps; one local teacher, so it scores on device
  (``Learner.prepare``).
- A problem domain without a teacher (a mixture's, from the config alone), and a teacher folder
  that does not exist: one line each, before any step.
"""

import json
import math

import jax
import pytest
from flax import nnx

from tests import runs

# The run's data and batch; the students' and teachers' architecture is the folders'.
RUN = [
    "data.synthetic_train_size=200",
    "data.synthetic_eval_size=16",
    "rl.prompts_per_step=8",
    "rl.group_size=4",
    "eval.max_problems=16",
    "eval.every=0",
    "reward.num_workers=1",
    "run.progress=false",
    "run.tensorboard=false",
    "sft.steps=0",
]
# Two tasks in one run (``data.mixture``): the demo's arithmetic and the code demo's functions.
MIXTURE = (
    "data.mixture=["
    "{domain: arith, data: {train: synthetic, synthetic: {num_steps: 1, max_operand: 19,"
    " max_value: 40}, synthetic_train_size: 40, synthetic_eval_size: 8}, reward: {fn: synthetic}},"
    " {domain: code, data: {train: synthetic_code, synthetic_train_size: 40,"
    " synthetic_eval_size: 8, gold_format: ' <answer>{solution}</answer>'},"
    " reward: {fn: code, code: {mode: all_pass}}}]"
)
# 80 positions: the code demo's prompts (the mixture test) are longer than the arithmetic's.
TINY_MODEL = [a for a in runs.TINY if a.startswith("model.")] + ["model.max_position_embeddings=80"]


def _save_model(path, seed: int, embed_scale: float) -> str:
    """A random tiny model of the demo's family with the char tokenizer, its (tied) embedding
    scaled by ``embed_scale`` (sharper next-token distributions), as an HF folder."""
    from jaxrlvr import builders
    from jaxrlvr import config as config_lib
    from jaxrlvr import model as model_lib

    cfg = config_lib.load_config(str(runs.REPO / "configs/demo.yaml"), TINY_MODEL)
    tokenizer = builders.build_tokenizer(cfg.model)
    mesh = model_lib.make_mesh(cfg.mesh, jax.devices()[:1])
    graphdef, params = nnx.split(builders.build_model(cfg.model, tokenizer, mesh, seed=seed))

    def scale(path, x):
        return x * embed_scale if "embed_tokens" in jax.tree_util.keystr(path) else x

    params = jax.tree_util.tree_map_with_path(scale, params)
    model_lib.save_hf(nnx.merge(graphdef, params), str(path), tokenizer_src=tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {
        "plain": _save_model(root / "plain", seed=1, embed_scale=1.0),
        "peaked": _save_model(root / "peaked", seed=2, embed_scale=6.0),
    }


def _distill(run_dir, student, teacher, *extra, check=True):
    return runs.jaxrlvr(
        "train",
        "configs/distill_demo.yaml",
        *RUN,
        f"model.path={student}",
        f"rl.distill.teacher={teacher}",
        f"run.out_dir={run_dir}",
        *extra,
        check=check,
    )


def _rl_lines(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "distill/reverse_kl" in x]


@pytest.mark.slow
def test_two_tasks_each_scored_by_its_own_teacher_and_resumed_exactly(tmp_path, folders):
    """The arithmetic and code tasks in one run (``data.mixture``), each domain its own local
    teacher, both scoring on device: the arithmetic's is the student itself (reverse KL 0),
    the code's another model. A run of 1 step resumed to 2 ends at parameters bit-identical to
    a run of 2 (the resumed step's batch is sampled and scored again: teachers are not state).
    """
    two = [
        "checkpoint.every=1",
        MIXTURE,
        f"rl.distill.teachers={{arith: {folders['plain']}, code: {folders['peaked']}}}",
    ]
    ref, run = tmp_path / "two", tmp_path / "resumed"
    _distill(run, folders["plain"], "null", "rl.steps=1", *two)
    (line,) = _rl_lines(run)
    assert abs(line["distill/arith/reverse_kl"]) < 1e-5
    assert line["distill/code/reverse_kl"] > 0.05
    # The update's k1 is the token-weighted mean of the two.
    assert 0.01 < line["distill/reverse_kl"] < line["distill/code/reverse_kl"]
    assert line["distill/teacher_logp"] < -0.1  # a real signal: the tokens are not certain
    _distill(run, folders["plain"], "null", "rl.steps=2", *two, "--resume")
    _distill(ref, folders["plain"], "null", "rl.steps=2", *two)
    runs.assert_same_params(runs.final_params(ref), runs.final_params(run))


@pytest.mark.slow
def test_reverse_kl_to_another_teacher_falls(tmp_path, folders):
    _distill(
        tmp_path / "other",
        folders["peaked"],
        folders["plain"],
        "rl.steps=6",
        "optim.learning_rate=1e-2",
        "optim.warmup_steps=0",
        "optim.total_steps=6",
    )
    lines = _rl_lines(tmp_path / "other")
    kl = [x["distill/reverse_kl"] for x in lines]
    assert len(kl) == 6
    assert not any("time/teacher_s" in x for x in lines)  # scored on device
    # The host's k1 (sampler log-probs) and the update's (trainer log-probs) agree.
    for x in lines:
        assert x["distill/default/reverse_kl"] == pytest.approx(x["distill/reverse_kl"], abs=1e-4)
    assert kl[0] > 0.5
    assert sum(kl[-2:]) < 0.8 * sum(kl[:2]), kl


@pytest.mark.slow
def test_jsd_to_another_teacher_falls_from_the_config(tmp_path, folders):
    """``rl.distill.signal: jsd`` end to end: the local teacher's top-k reaches the update as
    [B, T, K] rows and the generalised JSD (beta 0.5) over them falls; the agreement (sampled
    token == the teacher's argmax) is reported for the domain."""
    _distill(
        tmp_path / "jsd",
        folders["peaked"],
        folders["plain"],
        "rl.steps=5",
        "rl.distill.signal=jsd",
        "rl.distill.beta=0.5",
        "rl.distill.top_k=8",
        "optim.learning_rate=1e-2",
        "optim.warmup_steps=0",
        "optim.total_steps=5",
    )
    rows = (tmp_path / "jsd" / "metrics.jsonl").read_text().splitlines()
    lines = [json.loads(x) for x in rows]
    lines = [x for x in lines if "distill/jsd" in x]
    jsd = [x["distill/jsd"] for x in lines]
    assert len(jsd) == 5 and all(0 <= v <= math.log(2) for v in jsd), jsd  # JSD_0.5 <= ln 2
    assert jsd[0] > 0.05 and sum(jsd[-2:]) < 0.8 * sum(jsd[:2]), jsd
    assert all(0.0 <= x["distill/default/agreement"] <= 1.0 for x in lines)


@pytest.mark.slow
def test_an_async_lora_student_and_tool_trajectories_distil(tmp_path, folders):
    """Where the student goes, the teacher follows. (1) A LoRA student with asynchronous
    rollouts (``rl.max_staleness=1``): its own teacher copy gives reverse KL ~0 on every step,
    rollouts one version stale are scored. (2) Multi-turn tool
    trajectories (the tool demo's python tool): a run completes with a finite reverse KL whose
    tokens exclude the environment's (``rl.mask_forced_tokens``)."""
    lora = tmp_path / "lora"
    _distill(
        lora,
        folders["plain"],
        folders["plain"],
        "rl.steps=3",
        "rl.max_staleness=1",
        "model.lora={rank: 4, alpha: 8}",
        "checkpoint.every=3",
    )
    lines = _rl_lines(lora)
    assert len(lines) == 3
    assert all(abs(x["distill/reverse_kl"]) < 1e-4 for x in lines)
    assert max(x["async/staleness"] for x in lines) == 1
    _, final = runs.final_params(lora)
    assert any("lora" in k.lower() for k in final)  # the student trained is the adapters

    tool = tmp_path / "tool"
    runs.jaxrlvr(
        "train",
        "configs/tool_demo.yaml",
        *RUN,
        "reward.sandbox=none",
        "env.num_workers=1",
        # An SFT warm start long enough for the rollouts to reach the tool (test_tool_train's).
        "sft.steps=150",
        "sft.batch_size=16",
        "sft.optim.learning_rate=5e-3",
        "sampler.max_tokens=64",
        "rl.algo=distill",
        "rl.steps=2",
        f"model.path={folders['plain']}",
        f"rl.distill.teacher={folders['peaked']}",
        f"run.out_dir={tool}",
    )
    lines = _rl_lines(tool)
    assert len(lines) == 2 and all(math.isfinite(x["distill/reverse_kl"]) for x in lines)
    assert all(x["distill/reverse_kl"] > 0.01 for x in lines)  # another teacher: a real signal
    assert sum(x["tool/env_tokens_mean"] for x in lines) > 0  # the environment spoke


def test_missing_teacher_and_domain_refused_in_one_line(tmp_path, folders):
    from jaxrlvr import builders, configlib, preflight, teachers
    from jaxrlvr import config as config_lib
    from jaxrlvr import model as model_lib

    def config(*extra):
        return config_lib.load_config(
            str(runs.REPO / "configs/distill_demo.yaml"), [*RUN, *TINY_MODEL, *extra]
        )

    missing = str(tmp_path / "nowhere")
    with pytest.raises(configlib.PreflightError, match=r"^rl\.distill\.teacher=.*nowhere") as e:
        preflight.check_teachers(config(f"rl.distill.teacher={missing}"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="needs a teacher"):
        config("rl.distill.teacher=null")
    # A mixture's domain without a teacher: refused from the config alone.
    only_code = f"rl.distill.teachers={{code: {folders['plain']}}}"
    with pytest.raises(configlib.PreflightError, match=r"^data\.mixture: domain 'arith' has no"):
        preflight.check_teachers(config("rl.distill.teacher=null", MIXTURE, only_code))
    # Teachers by domain, none for the synthetic problems' (no domain: "default") and no default.
    cfg = config("rl.distill.teacher=null", f"rl.distill.teachers={{math: {folders['plain']}}}")
    tokenizer = builders.build_tokenizer(cfg.model)
    mesh = model_lib.make_mesh(cfg.mesh, jax.devices()[:1])
    problems, _ = builders.load_splits(cfg, train=True)
    with pytest.raises(teachers.TeacherError, match=r"no teacher for domain 'default'") as e:
        teachers.load_registry(
            cfg.rl.distill,
            domains=[p.domain or "default" for p in problems],
            student_vocab_size=tokenizer.vocab_size,
            student_tokenizer=tokenizer,
            mesh=mesh,
        )
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompts"])
def test_teacher_logps_laid_out_like_sampler_logps(layout):
    """``rollout.shape(fields=...)`` (a rollout pass's per-token fields): the same values as
    ``sampler_logp`` when the teacher's log-probs are the sampler's, in every layout (forced
    tokens included)."""
    import numpy as np

    from jaxrlvr import rollout
    from jaxrlvr.sampling import base as sampling_base

    rng = np.random.default_rng(0)
    prompts = [[5, 6, 7], [8, 9]]
    lengths = [3, 1, 0, 4, 2, 5]  # 3 completions per prompt, one empty
    completions = []
    for i, n in enumerate(lengths):
        ids = rng.integers(3, 50, n).tolist()
        lp = (-rng.random(n)).astype(np.float32).tolist()
        completions.append(
            sampling_base.Completion(
                text="x", token_ids=ids, logprobs=lp, finish_reason="stop", prompt_index=i // 3
            )
        )
    scores = [{"reward": 1.0, "answer_reward": 1.0, "format_reward": 1.0}] * len(completions)
    cfg = rollout.ShapingConfig(
        group_size=3, packing=layout != "padded", share_prompts=layout == "shared_prompts"
    )
    batch, _ = rollout.shape(
        prompts,
        completions,
        scores,
        cfg,
        pad_id=0,
        fields={"teacher_logp": [np.asarray(c.logprobs, np.float32) for c in completions]},
    )
    np.testing.assert_array_equal(batch.teacher_logp, batch.sampler_logp)
    assert np.count_nonzero(batch.teacher_logp) == sum(lengths)
    # [L, K] top-k arrays and per-completion domain ids take the same positions.
    topk = [
        (np.stack([c.token_ids, [1] * len(c.token_ids)], 1), np.stack([c.logprobs] * 2, 1))
        for c in completions
    ]
    fields = {
        "teacher_topk_ids": [ids for ids, _ in topk],
        "teacher_topk_logp": [lp for _, lp in topk],
        "domain_ids": [np.full(len(c.token_ids), 1 + i % 2) for i, c in enumerate(completions)],
    }
    batch, _ = rollout.shape(prompts, completions, scores, cfg, pad_id=0, fields=fields)
    want = (*batch.input_ids.shape, 2)
    assert batch.teacher_topk_ids.shape == batch.teacher_topk_logp.shape == want
    assert batch.teacher_topk_ids.dtype == batch.domain_ids.dtype == np.int32
    np.testing.assert_array_equal(batch.teacher_topk_logp[..., 1], batch.sampler_logp)
    at = batch.sampler_logp != 0
    np.testing.assert_array_equal(batch.teacher_topk_ids[..., 0][at], batch.labels[at])
    assert np.count_nonzero(batch.domain_ids == 2) == sum(lengths[1::2])
    assert np.count_nonzero(batch.domain_ids == 1) == sum(lengths[0::2])
    with pytest.raises(ValueError, match="completion 0: 2 values for 3 tokens"):
        rollout.shape(
            prompts, completions, scores, cfg, pad_id=0, fields={"teacher_logp": [[0.0, 0.0]] * 6}
        )


def test_mixture_problems_carry_their_domain_and_are_graded_by_its_reward():
    from jaxrlvr import assembly, builders
    from jaxrlvr import config as config_lib
    from jaxrlvr.data import templates

    cfg = config_lib.load_config(str(runs.REPO / "configs/demo.yaml"), [MIXTURE, *RUN])
    train, held_out = assembly.load_splits(cfg)
    assert [p.domain for p in train] == ["arith"] * 40 + ["code"] * 40
    assert [p.domain for p in held_out] == ["arith"] * 8 + ["code"] * 8
    arith, code = train[0], train[-1]
    gold = {m.domain: m.data.gold_format for m in cfg.data.mixture}
    texts = [templates.render_gold(gold[p.domain], p.answer, p.solution) for p in (arith, code)]
    grader = builders.build_grader(cfg)
    try:
        # Each gold answer passes its own verifier; swapped, neither does (the arithmetic
        # verifier reads no integer from a function body; the code one runs "12" as a body).
        right, _ = grader.grade([arith, code], texts, 1)
        wrong, _ = grader.grade([arith, code], texts[::-1], 1)
    finally:
        grader.close()
    assert [s["reward"] for s in right] == [1.0, 1.0]
    assert [s["reward"] for s in wrong] == [0.0, 0.0]


@pytest.mark.slow
def test_several_local_teachers_score_each_token_by_its_domain(folders):
    """``teachers.device_scores`` (``passes.teacher_scores``' device part): in packed rows
    with shared prompts, each completion's tokens take its own domain's teacher's log-probs,
    equal to that teacher's host scores of the completion (1e-5), and its top-k."""
    import numpy as np

    from jaxrlvr import rollout, teachers
    from jaxrlvr.sampling import base as sampling_base

    a, b = (teachers.LocalTeacher.load(folders[k]) for k in ("plain", "peaked"))
    rng = np.random.default_rng(1)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    completions = [
        sampling_base.Completion(
            text="x",
            token_ids=rng.integers(3, 60, n).tolist(),
            logprobs=[-1.0] * n,
            finish_reason="stop",
            prompt_index=i // 2,
        )
        for i, n in enumerate([3, 5, 4, 2])
    ]
    scores = [{"reward": 0.0, "answer_reward": 0.0, "format_reward": 0.0}] * 4
    domain_ids = [0, 1, 1, 0]  # both domains inside one shared-prompt block
    cfg = rollout.ShapingConfig(group_size=2, packing=True, share_prompts=True)
    ids_f = {"domain_ids": [np.full(len(c.token_ids), d) for c, d in zip(completions, domain_ids)]}
    batch, _ = rollout.shape(prompts, completions, scores, cfg, pad_id=0, fields=ids_f)
    groups = [(a, (0,)), (b, (1,))]
    got = teachers.device_scores(groups, batch)["teacher_logp"]
    host = {
        t: t.completion_logprobs(
            [prompts[i // 2] for i in range(4)], [c.token_ids for c in completions]
        )
        for t in (a, b)
    }
    own = [host[a if d == 0 else b][i] for i, d in enumerate(domain_ids)]
    # The host path's layout of the same scores (``TeacherScores.host``).
    want, _ = rollout.shape(
        prompts, completions, scores, cfg, pad_id=0, fields={"teacher_logp": own}
    )
    want = want.teacher_logp
    mask = batch.loss_mask != 0
    np.testing.assert_allclose(np.asarray(got)[mask], want[mask], atol=1e-5)
    assert np.abs(want[mask]).min() > 0
    ids, logp = teachers.device_scores(groups, batch, top_k=3).values()
    for teacher, d in ((a, 0), (b, 1)):
        t_ids, t_logp = teacher.topk(batch, 3)
        mine = mask & (batch.domain_ids == d)
        np.testing.assert_array_equal(np.asarray(ids)[mine], np.asarray(t_ids)[mine])
        np.testing.assert_array_equal(np.asarray(logp)[mine], np.asarray(t_logp)[mine])
