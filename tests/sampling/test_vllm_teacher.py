"""The vLLM teacher (jaxrlvr.teachers.vllm) against the local JAX teacher on the same
weights and tokens, with the session's real CPU vLLM server (float32)."""

import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as jmodel
from jaxrlvr import rollout, teachers
from jaxrlvr.teachers import vllm as vllm_teacher

pytestmark = pytest.mark.vllm


def test_vllm_teacher_logprobs_equal_the_local_teachers(vllm_server, tiny_export, tmp_path):
    server, state = vllm_server
    # The local teacher loads the weights the server holds now (earlier tests may have
    # reloaded them) from a folder, as a user's teacher checkpoint would be.
    folder = tmp_path / "teacher"
    lm = nnx.merge(tiny_export["graphdef"], state["params"])
    jmodel.save_hf(lm, folder, tokenizer_src=tiny_export["tokenizer"])
    local = teachers.LocalTeacher.load(folder)
    rng = np.random.default_rng(0)
    n_tok = len(tiny_export["tokenizer"])  # ids the server's tokenizer accepts
    prompts = [rng.integers(1, n_tok, size=rng.integers(1, 12)).tolist() for _ in range(6)]
    completions = [rng.integers(1, n_tok, size=rng.integers(1, 20)).tolist() for _ in range(6)]
    prompts[0] = [int(rng.integers(1, n_tok))]  # a one-token prompt: the first offset

    with vllm_teacher.VLLMTeacher(server) as remote:
        registry = teachers.TeacherRegistry({"math": remote, "code": local})
        registry.check(
            ["math", "code"],
            student_vocab_size=tiny_export["cfg"].vocab_size,
            student_tokenizer=tiny_export["dir"],
            full_vocab=True,
        )
        got = remote.completion_logprobs(prompts, completions)
        want = local.completion_logprobs(prompts, completions)
        for g, w, c in zip(got, want, completions):
            assert g.shape == (len(c),)
            np.testing.assert_allclose(g, w, atol=1e-4)  # the bound, float32

        k = 4
        top = remote.completion_topk(prompts, completions, k)
        ids, vals = local.topk(rollout.to_batch(rollout.pack(prompts, completions, pad_id=0)), k)
        ids, vals = np.asarray(ids), np.asarray(vals)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            pos = np.arange(len(p) - 1, len(p) - 1 + len(c))
            np.testing.assert_allclose(top[i][1], vals[i, pos], atol=1e-4)
            # The same tokens, wherever the k-th and (k+1)-th are not a near tie.
            np.testing.assert_array_equal(top[i][0][:, 0], ids[i, pos, 0])

        # Routed by domain through the registry: each completion gets its own teacher's values.
        routed = registry.completion_logprobs(prompts, completions, ["math", "code"] * 3)
        for g, w in zip(routed, want):
            np.testing.assert_allclose(g, w, atol=1e-4)
