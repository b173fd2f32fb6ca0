"""Asynchronous rollouts (``rl.max_staleness``) with the embedded JAX sampler, end to end on a
tiny model: k = 0 is the synchronous loop bit for bit; with k = 1 every batch's version lag,
read from the versions the sampler stamped on its completions, is exactly what the schedule
allows; the off-policy correction divides by the log-probs of the weights that generated the
tokens, and its diagnostics split the engine gap from the staleness gap (the behaviour version's
log-probs recomputed from the kept parameters); resume after SIGKILL ends at the uninterrupted
run's parameters.

The vLLM path is tested in tests/sampling/test_async_vllm.py (it needs the session's server).
"""

import dataclasses
import json
import pathlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import runs
from flax import nnx

from jaxrlvr import config as config_lib
from jaxrlvr import train
from jaxrlvr.phases import producer

# A tiny GRPO run without SFT or held-out evaluation (neither touches what is tested here).
TINY = [
    *runs.TINY_MODEL,
    "data.synthetic_train_size=200",
    "data.synthetic_eval_size=16",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "reward.num_workers=1",
    "run.progress=false",
    "run.tensorboard=false",
    "sft.steps=0",
    "eval.max_problems=0",
    "eval.at_start=false",
    "eval.every=1000",
    # No warm-up and a large step: consecutive weight versions differ measurably.
    "optim.learning_rate=3e-2",
    "optim.warmup_steps=0",
]


def _cfg(run_dir, *overrides):
    """In-process runs see the 8 fake devices of tests/conftest.py: the trainer keeps one (the
    demo's 1 x 1 x 1 mesh), the JAX sampler gets a sub-mesh of the other 7."""
    return config_lib.load_config(
        str(runs.REPO / "configs/demo.yaml"),
        [*TINY, f"run.out_dir={run_dir}", "sampler.jax_devices=7", *overrides],
    )


def _host_params(params):
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _metrics(run_dir):
    return [
        json.loads(x) for x in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]


def test_k0_is_the_synchronous_loop_bit_for_bit(tmp_path):
    """k = 0 through ``Trainer.run`` ends at exactly the parameters of the synchronous loop
    written out here from the named steps (sample -> grade -> shape -> prepare -> update ->
    sync), the loop as it was before asynchronous rollouts existed."""
    steps = ["rl.steps=3", "checkpoint.every=1000"]
    trainer = train.Trainer(_cfg(tmp_path / "run", *steps, "rl.max_staleness=0"))
    try:
        trainer.run()
        got = _host_params(trainer.state.params)
        assert trainer.phase.source.producer is None
    finally:
        trainer.close()

    ref = train.Trainer(_cfg(tmp_path / "ref", *steps))
    try:
        # The phase's roles driven by hand: the rollout source, then the learner.
        rl = ref.phase
        source, learner = rl.source, rl.learner
        ref.ctx.sampler.update_weights(ref.state.params, version=0)
        for t in range(3):
            problems, prompts, completions, _ = source.sample(ref.cfg.run.seed * 1_000_003 + t)
            scores, _ = source.grade(problems, completions)
            rollouts, _ = learner.shape(prompts, completions, scores, t)
            batch, _ = learner.prepare(rl.state, rollouts)
            rl.state, _ = learner.update(rl.state, batch)
            source.sync(rl.state.params, version=t + 1)
            rl.position += 1
        want = _host_params(ref.state.params)
    finally:
        ref.close()
    _assert_same(got, want)
    lines = _metrics(tmp_path / "run")
    assert all("async/staleness" not in x and "time/wait_rollouts_s" not in x for x in lines)


def _logprobs(graphdef, params, prompt, tokens):
    """log pi(tokens | prompt) under ``params``, float64, by a plain full forward."""
    model = nnx.merge(graphdef, params)
    ids = jnp.asarray([list(prompt) + list(tokens)], jnp.int32)
    logp = np.asarray(jax.nn.log_softmax(model(ids)[0].astype(jnp.float32), -1), np.float64)
    pos = np.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[pos, np.asarray(tokens)]


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory):
    """Four k = 1 steps driven one ``rl_step`` at a time; before step 2 the batch it will train
    on and the trainer's weights (version 2) and the previous ones (version 1) are kept."""
    run_dir = tmp_path_factory.mktemp("k1") / "run"
    cfg = _cfg(
        run_dir,
        "rl.steps=4",
        "checkpoint.every=1000",
        "rl.max_staleness=1",
        # No truncation: the logged mean weight is the plain ratio the test recomputes.
        "rl.loss.correction.high=1e6",
    )
    trainer = train.Trainer(cfg)
    out = {"metrics": [], "run_dir": run_dir}
    try:
        trainer.ctx.sampler.update_weights(trainer.state.params, version=0)
        params = {0: jax.device_get(trainer.state.params)}
        for t in range(4):
            if t == 2:
                out["batch"] = trainer.phase.source.producer.peek(2)
            out["metrics"].append(trainer.phase.step())
            params[t + 1] = jax.device_get(trainer.state.params)
        out["params"] = params
        out["graphdef"] = trainer.ctx.graphdef
        out["sampler_version"] = trainer.ctx.sampler.version
    finally:
        trainer.close()
    return out


def test_k1_version_lag_is_exactly_what_the_config_allows(k1_run):
    m = k1_run["metrics"]
    # Steps 0 and 1 train on batches version 0 generated before step 0; from step 1 on every
    # batch is exactly one version old. The figures come from the completions' stamps.
    assert [x["async/rollout_version"] for x in m] == [0, 0, 1, 2]
    assert [x["async/staleness"] for x in m] == [0, 1, 1, 1]
    assert k1_run["sampler_version"] == 4
    batch = k1_run["batch"]
    assert {c.weight_version for c in batch.completions} == {1}
    for x in m:
        for key in ("time/wait_rollouts_s", "time/generate_s", "offpolicy/weight", "clip_frac"):
            assert key in x, key


def test_k1_correction_divides_by_the_generating_versions_logprobs(k1_run):
    """Step 2 trains version 2 on tokens version 1 generated. The completions' log-probs are
    version 1's (not version 2's), and the logged mean correction weight is exp(old - sampler) with
    old = version 2's log-probs and sampler = those stamped ones. Had the correction used the
    trainer's own log-probs as the denominator, the weight would be exactly 1 (tolerance:
    float32 forward passes of different shapes, 1e-4 on log-probs, 1e-4 on the mean weight)."""
    batch, graphdef, params = k1_run["batch"], k1_run["graphdef"], k1_run["params"]
    weights, gap_old, gap_new = [], 0.0, 0.0
    for c in batch.completions:
        prompt = batch.prompts[c.prompt_index]
        v1 = _logprobs(graphdef, params[1], prompt, c.token_ids)
        v2 = _logprobs(graphdef, params[2], prompt, c.token_ids)
        sampler = np.asarray(c.logprobs, np.float64)
        gap_old = max(gap_old, float(np.max(np.abs(sampler - v1))))
        gap_new = max(gap_new, float(np.max(np.abs(sampler - v2))))
        weights.extend(np.exp(v2 - sampler))
    assert gap_old < 1e-4, gap_old  # the sampler's log-probs are those of version 1 ...
    assert gap_new > 1e-2, gap_new  # ... and measurably not version 2's
    expected = float(np.mean(weights))
    logged = k1_run["metrics"][2]["offpolicy/weight"]
    assert abs(expected - 1.0) > 1e-3, expected  # a trainer-log-prob denominator would give 1
    np.testing.assert_allclose(logged, expected, rtol=0, atol=1e-4)


def test_k1_diagnostics_split_engine_and_staleness(k1_run):
    """Step 2's batch: the behaviour log-probs are version 1's, recomputed by the trainer from
    the parameters it kept, so the engine gap (behaviour vs the JAX sampler's own float32
    log-probs) is ~0 and the whole gap is staleness: k1 = mean(v1 - v2), the mean ratio is
    mean(exp(v2 - v1)), the largest ratio max(exp(v2 - v1)). Tolerance: float32 forward passes
    of different shapes (packed rows vs one sequence), 1e-4 on means of log-probs ~ -3."""
    batch, graphdef, params = k1_run["batch"], k1_run["graphdef"], k1_run["params"]
    d = []
    for c in batch.completions:
        prompt = batch.prompts[c.prompt_index]
        v1 = _logprobs(graphdef, params[1], prompt, c.token_ids)
        v2 = _logprobs(graphdef, params[2], prompt, c.token_ids)
        d.extend(v2 - v1)
    d = np.asarray(d)
    m = k1_run["metrics"][2]
    assert m["offpolicy/behaviour_exact"] == 1.0
    assert abs(m["offpolicy/engine/k1"]) < 1e-4 and m["offpolicy/engine/k3"] < 1e-6
    assert abs(np.mean(-d)) > 1e-3  # the staleness gap is real ...
    np.testing.assert_allclose(m["offpolicy/staleness/k1"], np.mean(-d), atol=1e-4)
    np.testing.assert_allclose(m["offpolicy/staleness/k3"], np.mean(np.expm1(d) - d), atol=1e-4)
    np.testing.assert_allclose(m["offpolicy/staleness/is_w"], np.mean(np.exp(d)), atol=1e-4)
    np.testing.assert_allclose(m["offpolicy/staleness/ratio_max"], np.exp(d).max(), rtol=1e-3)
    # ... and the composed source is staleness x engine: the same figures within the engine gap
    np.testing.assert_allclose(m["offpolicy/both/k1"], m["offpolicy/staleness/k1"], atol=1e-4)
    assert 0 < m["offpolicy/staleness/ess"] <= 1.0
    # Step 0 trained on version 0's batch with version 0: no staleness at all.
    assert k1_run["metrics"][0]["offpolicy/staleness/k1"] == 0.0


def test_producer_refuses_a_batch_older_than_k():
    from jaxrlvr.sampling import base

    c = base.Completion(
        prompt_index=0,
        token_ids=[1],
        logprobs=[-0.1],
        text="",
        finish_reason="stop",
        weight_version=3,
    )
    ro = producer.Rollouts(step=6, problems=[], prompts=[[1]], completions=[c], metrics={})
    assert producer.check_lag(ro, 5, 2) == 2
    with pytest.raises(RuntimeError, match="3 versions behind.*max_staleness=2"):
        producer.check_lag(ro, 6, 2)
    mixed = producer.Rollouts(
        step=6,
        problems=[],
        prompts=[[1]],
        completions=[
            c,
            dataclasses.replace(c, weight_version=4),
        ],
        metrics={},
    )
    with pytest.raises(RuntimeError, match="weight versions"):
        _ = mixed.version
    # Saved and restored through JSON exactly (float32 log-probs round-trip).
    back = producer.Rollouts.from_json(json.loads(json.dumps(ro.to_json())))
    assert back == ro


# ---------------------------------------------------------------------------------------------
# SIGKILL and --resume with k = 1 (subprocesses, like tests/test_train.py)

RESUME_ARGS = [
    "configs/demo.yaml",
    "rl.steps=5",
    "checkpoint.every=2",
    "rl.max_staleness=1",
    *TINY,
]


def _train_cli(run_dir, *extra):
    runs.jaxrlvr("train", *RESUME_ARGS, f"run.out_dir={run_dir}", *extra)


@pytest.mark.slow
def test_k1_sigkill_and_resume_gives_identical_params(tmp_path):
    """Killed after step 3 (past the step-2 checkpoint, which holds step 3's batch generated by
    version 2), resumed: the same parameters and metrics as the run never killed. The pending
    batch comes back from the checkpoint; regenerating it would need version 2's weights."""
    ref_dir = tmp_path / "uninterrupted"
    _train_cli(ref_dir)
    run_dir = tmp_path / "killed"
    proc = runs.start_until_lines(["train", *RESUME_ARGS, f"run.out_dir={run_dir}"], run_dir, 3)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    _train_cli(run_dir, "--resume")

    want, got = runs.final_params(ref_dir), runs.final_params(run_dir)
    assert want[0] == got[0] == 5
    runs.assert_same_params(want, got)
    ref, got = _metrics(ref_dir), _metrics(run_dir)
    assert [x["step"] for x in got] == [1, 2, 3, 4, 5]
    for x, y in zip(ref, got):
        for key in ("async/staleness", "async/rollout_version", "reward_mean", "offpolicy/weight"):
            assert x[key] == y[key], (key, x["step"])
