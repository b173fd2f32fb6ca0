"""JaxSampler against transformers and the model's own full forward, on a tiny random Qwen2.

One module-scoped checkpoint (transformers `Qwen2Config` -> `save_pretrained`, with the locally
trained tokenizer of tests/sampling/conftest.py) serves every test; prompts of different lengths
exercise left padding in every call.
"""

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr.sampling import base, jax_sampler

PROMPTS = [[5, 17, 42, 7, 99, 3], [11, 250, 8], [201, 2, 64, 64, 1, 9, 45, 23, 77]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, helpers):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tok = helpers.make_tokenizer(path)
    # The vocabulary of the tokenizer: every id decodes to text.
    tiny = M.ModelConfig.tiny(vocab_size=len(tok), tie_word_embeddings=False)
    config = transformers.Qwen2Config(
        **tiny.to_hf_config(), eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id
    )
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in hf_model.parameters():
            # Wider than the default init so that distributions are far from uniform and
            # greedy paths are not decided by float noise.
            p.normal_(0.0, 0.3 if p.ndim == 2 else 0.05)
    hf_model.save_pretrained(path, safe_serialization=True)
    return path, hf_model.eval(), tok


@pytest.fixture(scope="module")
def lm(ckpt):
    return M.load_hf(ckpt[0])


@pytest.fixture(scope="module")
def sampler(ckpt, lm):
    return jax_sampler.JaxSampler(lm, ckpt[2])


def full_forward_logprobs(lm, prompt, completion):
    """log_softmax of the model's full-forward logits at each completion token (no cache)."""
    ids = np.asarray([prompt + completion], np.int32)
    logits = np.asarray(lm(ids))[0].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    steps = np.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[steps, completion]


def test_is_a_sampler(sampler):
    assert isinstance(sampler, base.Sampler)


def test_greedy_equals_transformers_generate(ckpt, sampler):
    _, hf_model, tok = ckpt
    params = base.SamplingParams(temperature=0.0, max_tokens=16)
    out = sampler.generate(PROMPTS, 1, params)
    for prompt, c in zip(PROMPTS, out, strict=True):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=16,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )[0, len(prompt) :].tolist()
        assert c.token_ids == ref
        stopped = ref[-1] == tok.eos_token_id
        assert c.finish_reason == ("stop" if stopped else "length")


def test_logprobs_equal_full_forward(lm, sampler):
    params = base.SamplingParams(temperature=1.0, max_tokens=20, seed=3, ignore_eos=True)
    out = sampler.generate(PROMPTS, 2, params)
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
    for c in out:
        assert len(c.token_ids) == 20 and c.finish_reason == "length"
        ref = full_forward_logprobs(lm, PROMPTS[c.prompt_index], c.token_ids)
        # KV-cache decode vs full forward in float32: the model brief measured 2e-7 on logits.
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-5)
    # Two samples of one prompt differ (each row has its own random stream).
    assert out[0].token_ids != out[1].token_ids


# Child process for the bfloat16 check: the same comparison with XLA's excess precision off.
# It gets the prompts (argv[2], JSON) and ``full_forward_logprobs`` (its source, put between the
# two halves in the test) from here rather than importing this test module.
_BF16_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from jaxrlvr import model as M
    from jaxrlvr.sampling import base, jax_sampler
    PROMPTS = json.loads(sys.argv[2])
    """
)
_BF16_CHILD_MAIN = textwrap.dedent(
    """
    lm = M.load_hf(sys.argv[1], dtype="bfloat16")
    params = base.SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)
    out = jax_sampler.JaxSampler(lm).generate(PROMPTS, 2, params)
    gap = max(
        float(np.abs(np.asarray(c.logprobs) - full_forward_logprobs(
            lm, PROMPTS[c.prompt_index], c.token_ids)).max())
        for c in out
    )
    print(json.dumps({"gap": gap}))
    """
)


def test_bfloat16_logprobs_equal_full_forward(ckpt):
    """In bfloat16 the sampler (prefill + cached decode) runs the model's own layer math.

    By default XLA may skip intermediate bf16 roundings inside a fusion (excess precision), and
    which ones it skips depends on the program's shapes, so a cached decode and a full forward
    differ by a few bf16 roundings of the logits (measured max 2.1e-3, before and after the
    decoder was unified; bf16's relative precision is 2^-8 ~ 4e-3). With
    ``--xla_allow_excess_precision=false`` both round at the same points and the only difference
    left is float32 summation order, as in the float32 test: measured 6.7e-7 here, and 2.4e-3
    with the former separate decode layer (which kept attention probabilities in float32).
    So: 1e-5 with excess precision off (a child process; XLA flags are fixed at JAX import).
    """
    env = dict(os.environ, XLA_FLAGS="--xla_allow_excess_precision=false", JAX_PLATFORMS="cpu")
    child = _BF16_CHILD + "\n" + inspect.getsource(full_forward_logprobs) + _BF16_CHILD_MAIN
    proc = subprocess.run(
        [sys.executable, "-c", child, str(ckpt[0]), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    gap = json.loads(proc.stdout.strip().splitlines()[-1])["gap"]
    assert gap < 1e-5, gap


def test_bfloat16_logprobs_close_to_full_forward_default_flags(ckpt):
    # Default flags: a few bf16 roundings of O(1) logits (see the test above); 1e-2 ~ 2.5 ulps.
    lm16 = M.load_hf(ckpt[0], dtype="bfloat16")
    params = base.SamplingParams(temperature=1.0, max_tokens=16, seed=4, ignore_eos=True)
    for c in jax_sampler.JaxSampler(lm16).generate(PROMPTS, 2, params):
        ref = full_forward_logprobs(lm16, PROMPTS[c.prompt_index], c.token_ids)
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-2)


def test_stop_ids_and_max_tokens(sampler):
    greedy = base.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = sampler.generate(PROMPTS[:1], 1, greedy)[0].token_ids
    assert len(ref) == 12
    stop_id = ref[4]
    first = ref.index(stop_id)  # it may occur earlier than position 4
    out = sampler.generate(PROMPTS[:1], 1, dataclasses.replace(greedy, stop_token_ids=(stop_id,)))
    assert out[0].token_ids == ref[: first + 1]  # the stop id is kept
    assert out[0].finish_reason == "stop"
    out = sampler.generate(PROMPTS[:1], 1, dataclasses.replace(greedy, max_tokens=5))
    assert out[0].token_ids == ref[:5] and out[0].finish_reason == "length"


def test_eos_ends_a_completion_unless_ignored(ckpt, lm):
    eos = 7  # pretend token 7 is EOS: pick the one greedy emits third
    s = jax_sampler.JaxSampler(lm, ckpt[2], eos_token_ids=())
    ref = s.generate(PROMPTS[1:2], 1, base.SamplingParams(temperature=0.0, max_tokens=8))[0]
    eos = ref.token_ids[2]
    first = ref.token_ids.index(eos)
    s = jax_sampler.JaxSampler(lm, ckpt[2], eos_token_ids=(eos,))
    params = base.SamplingParams(temperature=0.0, max_tokens=8)
    out = s.generate(PROMPTS[1:2], 1, params)[0]
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop"
    out = s.generate(PROMPTS[1:2], 1, dataclasses.replace(params, ignore_eos=True))[0]
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"


def test_stop_strings_cut_text_and_tokens(sampler):
    greedy = base.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = sampler.generate(PROMPTS[:1], 1, greedy)[0]
    stop = ref.text[6:9]
    assert len(stop) == 3
    cut = ref.text.index(stop)
    out = sampler.generate(PROMPTS[:1], 1, dataclasses.replace(greedy, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == ref.text[:cut]
    # Tokens end with the first token whose text completes the stop string.
    k = len(out.token_ids)
    assert out.token_ids == ref.token_ids[:k]
    assert stop in sampler.tokenizer.decode(ref.token_ids[:k], skip_special_tokens=True)
    assert stop not in sampler.tokenizer.decode(ref.token_ids[: k - 1], skip_special_tokens=True)
    assert len(out.logprobs) == k


def test_same_bucket_does_not_retrace(sampler):
    params = base.SamplingParams(temperature=1.0, max_tokens=10, seed=0)
    sampler.generate(PROMPTS, 1, params)  # may compile (first use of this program)
    traces = jax_sampler.num_traces()
    # Other prompt lengths, max_tokens, temperature and seed, all inside the same buckets
    # (3 rows -> batch 4, longest prompt 9-16 tokens, max_tokens <= 16).
    sampler.generate(PROMPTS, 1, dataclasses.replace(params, seed=5))
    longest = list(range(3, 15))
    sampler.generate([[1, 2], longest, [8]], 1, dataclasses.replace(params, max_tokens=13))
    sampler.generate(PROMPTS[2:], 3, dataclasses.replace(params, temperature=0.7, seed=1))
    assert jax_sampler.num_traces() == traces
    # A longer prompt bucket is a new program: the counter does count traces.
    sampler.generate([list(range(1, 40))], 1, params)
    assert jax_sampler.num_traces() == traces + 1


def test_precompiled_program_is_the_one_generate_runs(sampler):
    """``precompile_in_background`` compiles the program of a later ``generate`` call (here a
    prompt bucket no other test uses: 17-32 tokens, 5 rows -> batch 8); the call, made at once,
    waits for that compile where it is still running and runs its program: the program is
    built once (XLA's compile, or a load from the persistent cache), the sampler counts it as
    used, and a second call traces nothing."""
    from jaxrlvr import compile_cache

    params = base.SamplingParams(temperature=1.0, max_tokens=9, seed=3)
    prompts = [list(range(2, 22)), [7, 8, 9]]
    sampler.generate(PROMPTS, 1, params)  # JAX's helper programs (seeding, transfers) compiled
    counter = compile_cache.CompileCounter().start()
    try:
        thread = sampler.precompile_in_background([(prompts, 5, params)])
        out = sampler.generate(prompts, 5, params)  # waits for the background compile
        thread.join()
        traces = jax_sampler.num_traces()
        again = sampler.generate(prompts, 5, dataclasses.replace(params, seed=3))
    finally:
        counter.stop()
    # Built once: compiled, or loaded from the persistent compile cache an earlier run filled.
    assert counter.compiles + counter.cache_hits == 1, counter.as_dict()
    assert jax_sampler.num_traces() == traces
    assert sampler.compiled_ahead() == {"programs": 1, "used": 1}
    assert [c.token_ids for c in out] == [c.token_ids for c in again]
    # Nothing to compile ahead for a thinking budget or an empty call.
    budget = dataclasses.replace(params, thinking_budget=4)
    assert not sampler.precompile(prompts, 5, budget)
    assert not sampler.precompile([], 5, params)


def test_deterministic_for_a_seed(sampler):
    params = base.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=11)
    a = sampler.generate(PROMPTS, 2, params)
    b = sampler.generate(PROMPTS, 2, params)
    c = sampler.generate(PROMPTS, 2, dataclasses.replace(params, seed=12))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_grouped_prefill_equals_one_prefill_per_row(sampler):
    """n samples of a prompt prefill it once (``_Static.group``); the same rows given as n
    copies of the prompt (n=1, prefilled per row) sample the same tokens with the same seed.
    Log-probs: 1e-6 (float32; the prefill's batch size differs, so XLA may order sums
    differently)."""
    params = base.SamplingParams(temperature=1.0, max_tokens=12, seed=4, ignore_eos=True)
    grouped = sampler.generate(PROMPTS, 4, params)  # 12 rows -> batch 16, group 4
    copies = sampler.generate([p for p in PROMPTS for _ in range(4)], 1, params)
    assert [c.token_ids for c in grouped] == [c.token_ids for c in copies]
    for a, b in zip(grouped, copies):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_thinking_budget_forces_exit_text(ckpt, sampler):
    tok = ckpt[2]
    budget = 3
    forced = tok.encode(base.DEFAULT_THINKING_END_TEXT, add_special_tokens=False)
    close = tok.encode(base.THINK_CLOSE, add_special_tokens=False)
    greedy = base.SamplingParams(temperature=0.0, max_tokens=budget + len(forced) + 4)
    plain = sampler.generate(PROMPTS[:1], 1, dataclasses.replace(greedy, ignore_eos=True))[0]
    assert close[0] not in plain.token_ids[:budget]  # the budget really runs out unclosed
    params = dataclasses.replace(greedy, ignore_eos=True, thinking_budget=budget)
    out = sampler.generate(PROMPTS[:1], 1, params)[0]
    f = len(forced)
    assert out.token_ids[:budget] == plain.token_ids[:budget]
    assert out.token_ids[budget : budget + f] == forced
    assert out.forced == [budget <= i < budget + f for i in range(len(out.token_ids))]
    assert out.logprobs[budget : budget + f] == [0.0] * f
    # The forced tokens went through the model: the rest equals greedy decoding after them.
    prefix = PROMPTS[0] + out.token_ids[: budget + f]
    rest = sampler.generate([prefix], 1, dataclasses.replace(greedy, max_tokens=4, ignore_eos=True))
    assert out.token_ids[budget + f :] == rest[0].token_ids
    np.testing.assert_allclose(out.logprobs[budget + f :], rest[0].logprobs, atol=1e-5)


def test_sharded_generation_matches(ckpt, lm):
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    sharded_lm = M.load_hf(ckpt[0], mesh=mesh)
    s = jax_sampler.JaxSampler(sharded_lm, ckpt[2], mesh=mesh)
    params = base.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = s.generate(PROMPTS, 1, params)
    ref = jax_sampler.JaxSampler(lm, ckpt[2]).generate(PROMPTS, 1, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    # Logprobs agree up to the reduction order of the sharded matmuls.
    for a, b in zip(out, ref, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_update_weights_changes_outputs(ckpt, lm):
    s = jax_sampler.JaxSampler(lm, ckpt[2])
    params = base.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = s.generate(PROMPTS, 1, params)
    _, state = nnx.split(lm, nnx.Param)
    doubled = jax.tree.map(lambda x: x * 1.5, state)
    timings = s.update_weights(doubled, version=1)
    assert set(timings) == {"update_s"} and s.version == 1
    traces = jax_sampler.num_traces()
    after = s.generate(PROMPTS, 1, params)
    assert jax_sampler.num_traces() == traces  # new weights, same program
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    # New logprobs are those of the new weights.
    new_lm = nnx.merge(nnx.graphdef(lm), doubled)
    for c in after:
        ref = full_forward_logprobs(new_lm, PROMPTS[c.prompt_index], c.token_ids)
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4)
    with pytest.raises(ValueError, match="weights tree"):
        s.update_weights({"not": "params"})


def test_rows_decode_through_the_rust_decoder_exactly_as_through_the_tokenizer(sampler):
    """The sampler decodes rows and stop-string prefixes with the ``tokenizers`` decoder itself
    (``backend_decoder``) where that is what ``tokenizer.decode`` does: the same texts for random
    ids (special tokens, byte-level pieces that split UTF-8 characters); a tokenizer that
    cleans spaces up, or one without a Rust backend, keeps its own ``decode``."""
    import copy

    tok = sampler.tokenizer
    assert jax_sampler.backend_decoder(tok) is not None
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, len(tok), n).tolist() for n in rng.integers(1, 24, 200)]
    # Private on purpose: the decoders are internal to stop-string matching, whose public
    # behaviour could not show which decoder ran or that each of 200 random rows matches.
    assert sampler._decode_all(rows) == tok.batch_decode(rows, skip_special_tokens=True)
    assert [sampler._decode(r) for r in rows] == [
        tok.decode(r, skip_special_tokens=True) for r in rows
    ]
    cleaning = copy.copy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert jax_sampler.backend_decoder(cleaning) is None
    assert jax_sampler.backend_decoder(object()) is None
