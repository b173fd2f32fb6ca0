"""Fixtures for sampler tests: tiny random Qwen2 checkpoints and one real vLLM server per session.

vLLM tests (marker ``vllm``) need a Python environment with vLLM installed
(``scripts/setup_vllm.sh``), named by env ``JAXRLVR_VLLM_PYTHON``. Without it they are skipped
locally; in CI (env ``CI`` set) they fail instead, so a broken vLLM setup cannot pass silently.
"""

import os
import pathlib
import types

import numpy as np
import pytest

TINY_VOCAB = 512
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "<think> let me think about the answer </think> <answer> 42 </answer>",
    "A conversation between User and Assistant. The User asks a question.",
    "def f(x): return x * x + 1",
]
SPECIAL = ["<|endoftext|>", "<think>", "</think>", "<answer>", "</answer>"]


def make_tokenizer(directory: pathlib.Path):
    """A byte-level BPE tokenizer trained locally (no hub access), saved in HF format."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(directory)
    return fast


def tiny_hf_config(**overrides):
    """The transformers config of the tiny preset at head_dim 32, untied (``ModelConfig.tiny``)."""
    import transformers

    from jaxrlvr import model as jmodel

    cfg = jmodel.ModelConfig.tiny(
        vocab_size=TINY_VOCAB,
        hidden_size=128,  # head_dim 32: the smallest vLLM-CPU attention supports
        tie_word_embeddings=False,
    )
    kw = cfg.to_hf_config()
    kw.update(torch_dtype="float32", eos_token_id=0, bos_token_id=0)
    kw.update(overrides)
    return transformers.Qwen2Config(**kw)


def make_hf_checkpoint(directory: pathlib.Path, seed: int = 0):
    """A tiny random transformers Qwen2 checkpoint plus tokenizer in `directory`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(tiny_hf_config()).to(torch.float32)
    # Random init is small; scale weights up so sampled distributions are far from uniform.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    tok = make_tokenizer(directory)
    return model, tok


# ------------------------------------------------------------------------------------------------
# jaxrlvr tiny model and reference log-probs


def tiny_model_config():
    from jaxrlvr import model as jmodel

    return jmodel.ModelConfig.tiny(
        vocab_size=TINY_VOCAB,
        hidden_size=128,  # head_dim 32: the smallest head size vLLM's CPU attention supports
        intermediate_size=256,
        tie_word_embeddings=False,
    )


def random_params(cfg, seed: int):
    """(graphdef, params) of a jaxrlvr Qwen2 whose every tensor (biases and norms included) is
    randomised, with weights large enough that next-token distributions are far from uniform."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrlvr import model as jmodel

    # Shapes only (no init compute), then NumPy draws: much cheaper than an eager random init.
    abstract = nnx.eval_shape(lambda: jmodel.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(x.shape).astype(np.float32)
        if "norm" in name:  # RMSNorm scales around 1
            return jnp.asarray(1.0 + 0.1 * noise)
        return jnp.asarray((0.1 if "bias" in name else 0.2) * noise)

    return graphdef, jax.tree.unflatten(treedef, [draw(path, x) for path, x in leaves])


def reference_logprobs(graphdef, params, prompts, completions, temperature=1.0, top_k=0):
    """jaxrlvr's own log-probs of each completion's tokens under (temperature, top-k).

    Returns a list of float64 arrays, one per completion.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(graphdef, params)
    seqs = [list(prompts[c.prompt_index]) + list(c.token_ids) for c in completions]
    width = max(len(s) for s in seqs)
    # Right padding never influences earlier positions of a causal model.
    ids = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    logits = np.asarray(model(jnp.asarray(ids)), np.float64) / temperature
    if top_k:
        kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
        logits = np.where(logits >= kth, logits, -np.inf)
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1), np.float64)
    out = []
    for i, c in enumerate(completions):
        p = len(prompts[c.prompt_index])
        pos = np.arange(p - 1, p - 1 + len(c.token_ids))
        out.append(logp[i, pos, np.asarray(c.token_ids)])
    return out


# ------------------------------------------------------------------------------------------------
# One vLLM server per session


@pytest.fixture(scope="session")
def vllm_python():
    python = os.environ.get("JAXRLVR_VLLM_PYTHON")
    if not python:
        if os.environ.get("CI"):
            pytest.fail(
                "CI is set but JAXRLVR_VLLM_PYTHON is not: vLLM tests must run in CI "
                "(export JAXRLVR_VLLM_PYTHON=$(scripts/setup_vllm.sh | tail -n1))"
            )
        pytest.skip("JAXRLVR_VLLM_PYTHON is not set (see scripts/setup_vllm.sh)")
    return python


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """A tiny random model written by jaxrlvr's own save_hf, with a locally trained tokenizer."""
    from flax import nnx

    from jaxrlvr import model as jmodel

    directory = tmp_path_factory.mktemp("tiny-jaxrlvr-export")
    cfg = tiny_model_config()
    graphdef, params = random_params(cfg, seed=0)
    tok = make_tokenizer(directory)
    jmodel.save_hf(nnx.merge(graphdef, params), directory, tokenizer_src=tok)
    return {"dir": directory, "cfg": cfg, "graphdef": graphdef, "params": params, "tokenizer": tok}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "kills_vllm_server: leaves the session's vLLM server dead (run after its other users)",
    )


def pytest_collection_modifyitems(config, items):
    """Tests that kill the session's server run after every other test of this folder: a
    restart costs a server start (~25 s), and this way only the killing tests pay for one."""
    here = pathlib.Path(__file__).parent
    ours = [i for i, item in enumerate(items) if here in pathlib.Path(item.path).parents]
    if not ours:
        return
    block = items[ours[0] : ours[-1] + 1]
    killing = [item for item in block if item.get_closest_marker("kills_vllm_server")]
    rest = [item for item in block if not item.get_closest_marker("kills_vllm_server")]
    items[ours[0] : ours[-1] + 1] = rest + killing


@pytest.fixture(scope="session")
def _vllm_server_session(vllm_python, tiny_export, tmp_path_factory):
    from jaxrlvr.sampling import vllm_server

    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    server = vllm_server.VLLMServer(tiny_export["dir"], python=vllm_python, log_path=log)
    # Which params the server holds now: tests that reload weights record them here.
    state = {"params": tiny_export["params"]}
    yield server, state
    server.stop()


@pytest.fixture
def vllm_server(_vllm_server_session):
    """The session's server, (re)started if an earlier test killed it; yields (server, state)."""
    server, state = _vllm_server_session
    if not server.alive():
        server.start()
    return server, state


@pytest.fixture(scope="session")
def helpers():
    """The module-level helpers above, for test modules (a second `conftest` cannot be imported
    by name next to tests/conftest.py)."""
    return types.SimpleNamespace(
        random_params=random_params,
        reference_logprobs=reference_logprobs,
        make_tokenizer=make_tokenizer,
        tiny_model_config=tiny_model_config,
    )
