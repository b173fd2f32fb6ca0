"""Distillation teachers (jaxrlvr.teachers): the local JAX teacher's log-probs and top-k against
a full forward, and the registry's routing and one-line refusals.
The vLLM teacher against the local one: tests/sampling/test_vllm_teacher.py."""

import jax
import numpy as np
import pytest

from jaxrlvr import model as jmodel
from jaxrlvr import rollout, teachers

VOCAB = 128


def _tokenizer(directory, corpus):
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.train_from_iterator(corpus * 10, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return fast


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random model saved as an HF folder with a tokenizer; and the model itself."""
    directory = tmp_path_factory.mktemp("teacher")
    lm = jmodel.init_model(jmodel.ModelConfig.tiny(vocab_size=VOCAB), seed=1)
    tok = _tokenizer(directory, ["two plus two is four", "def f(x): return x"])
    jmodel.save_hf(lm, directory, tokenizer_src=tok)
    return directory, lm


def _pairs(seed, n=5):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, VOCAB, size=rng.integers(1, 7)).tolist() for _ in range(n)]
    completions = [rng.integers(1, VOCAB, size=rng.integers(1, 9)).tolist() for _ in range(n)]
    return prompts, completions


def _reference(lm, prompts, completions, k=None):
    """Each completion's log-probs (and top-k) from one unpadded full forward per sequence."""
    out = []
    for p, c in zip(prompts, completions):
        seq = np.asarray([p + c], np.int32)
        logits = np.asarray(lm(seq), np.float64)[0]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        pos = np.arange(len(p) - 1, len(p) - 1 + len(c))
        out.append(logp[pos, c] if k is None else logp[pos])
    return out


def test_local_teacher_logprobs_and_topk_match_a_full_forward(folder):
    directory, lm = folder
    prompts, completions = _pairs(0)
    want = _reference(lm, prompts, completions)
    teacher = teachers.load_teacher(directory)
    assert isinstance(teacher, teachers.LocalTeacher) and teacher.vocab_size == VOCAB
    got = teacher.completion_logprobs(prompts, completions)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)  # float32 forward of a 2-layer model
    # Position chunks and microbatches (rows padded to a multiple of 2) change nothing.
    chunked = teachers.LocalTeacher.load(directory, chunk_size=4, num_microbatches=2)
    for g, w in zip(chunked.completion_logprobs(prompts, completions), got):
        np.testing.assert_allclose(g, w, atol=1e-6)
    # Packed rows with shared prompts (groups of 2 completions per prompt): the same values.
    # Tags passed as the sampler's log-probs mark where each completion token's label lands.
    group_prompts = [prompts[i // 2] for i in range(4)]
    grouped = completions[:4]
    tags = [[1000.0 * i + j + 1 for j in range(len(c))] for i, c in enumerate(grouped)]
    packed = rollout.pack(
        group_prompts, grouped, pad_id=0, sampler_logps=tags, segments=True, share_prompts=2
    )
    assert packed.prompt_group_ids is not None and packed.input_ids.shape[0] < 4
    packed_lp = np.asarray(teacher.batch_logprobs(rollout.to_batch(packed)))
    padded = teacher.completion_logprobs(group_prompts, grouped)
    for i, c in enumerate(grouped):
        for j in range(len(c)):
            (at,) = zip(*np.nonzero(packed.sampler_logp == 1000.0 * i + j + 1))
            np.testing.assert_allclose(packed_lp[at], padded[i][j], atol=1e-5)
    # Top-k at the completion positions: the reference's k largest, most likely first.
    k = 5
    batch = rollout.to_batch(rollout.pack(prompts, completions, pad_id=0))
    ids, vals = jax.device_get(chunked.topk(batch, k))
    full = _reference(lm, prompts, completions, k=k)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        pos = np.arange(len(p) - 1, len(p) - 1 + len(c))
        want_vals = -np.sort(-full[i], axis=-1)[:, :k]
        np.testing.assert_allclose(vals[i, pos], want_vals, atol=1e-5)
        picked = np.take_along_axis(full[i], ids[i, pos], axis=-1)
        np.testing.assert_allclose(picked, want_vals, atol=1e-5)


class _Fake:
    """A stand-in teacher for routing only: its 'log-prob' of token t is -t - offset."""

    def __init__(self, name, offset, vocab_size=VOCAB, tokenizer=None):
        self.name, self.offset, self.vocab_size, self.tokenizer = (
            name,
            offset,
            vocab_size,
            tokenizer,
        )

    def completion_logprobs(self, prompts, completions):
        return [-np.asarray(c, np.float32) - self.offset for c in completions]


def test_registry_routes_each_problem_to_its_domain_teacher_in_order():
    math_t, code_t = _Fake("math", 0.0), _Fake("code", 100.0)
    reg = teachers.TeacherRegistry({"math": math_t, "code": code_t})
    prompts, completions = _pairs(1, n=4)
    domains = ["code", "math", "code", "math"]
    got = reg.completion_logprobs(prompts, completions, domains)
    for lp, c, d in zip(got, completions, domains):
        np.testing.assert_array_equal(
            lp, -np.asarray(c, np.float32) - (100.0 if d == "code" else 0)
        )
    assert [(t.name, idx) for t, idx in reg.route(domains)] == [("code", [0, 2]), ("math", [1, 3])]
    with pytest.raises(teachers.TeacherError, match=r"^no teacher for domain 'chess' \(teachers"):
        reg.check(["math", "chess"], student_vocab_size=VOCAB)
    assert teachers.TeacherRegistry({"math": math_t}, default="math").teacher_for("chess") is math_t


def test_registry_refuses_mismatched_teachers_in_one_line(folder, tmp_path):
    directory, _ = folder
    reg = teachers.TeacherRegistry({"math": _Fake("big", 0.0, vocab_size=VOCAB + 64)})
    reg.check(["math"], student_vocab_size=VOCAB)  # padding rows: fine for sampled tokens
    with pytest.raises(teachers.TeacherError, match="'big': vocabulary size 192 differs"):
        reg.check(["math"], student_vocab_size=VOCAB, full_vocab=True)
    small = teachers.TeacherRegistry({"math": _Fake("small", 0.0, vocab_size=64)})
    with pytest.raises(teachers.TeacherError, match="'small': vocabulary size 64 cannot score"):
        small.check(["math"], student_vocab_size=VOCAB)
    other = _tokenizer(tmp_path / "other", ["completely different words here", "zebra quilt"])
    mismatch = teachers.TeacherRegistry({"math": _Fake("other", 0.0, tokenizer=other)})
    with pytest.raises(teachers.TeacherError, match="'other': its tokenizer differs"):
        mismatch.check(["math"], student_vocab_size=VOCAB, student_tokenizer=directory)
    same = teachers.TeacherRegistry({"math": teachers.load_teacher(directory)})
    same.check(["math"], student_vocab_size=VOCAB, student_tokenizer=directory, full_vocab=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(teachers.TeacherError, match="^teacher 'x' cannot be loaded: .*config.json"):
        teachers.load_teacher(tmp_path / "empty", name="x")
    with pytest.raises(teachers.TeacherError, match="cannot be served: cannot reach vLLM server"):
        teachers.load_teacher("http://127.0.0.1:9", name="down")
