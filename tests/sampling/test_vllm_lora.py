"""VLLMSampler with LoRA against a real CPU vLLM server (marker ``vllm``; one LoRA server for
the module): the server keeps its base model, each update ships only the adapters (PEFT layout)
as a new adapter, rollouts name it, the old one is unloaded.

Tolerance for log-prob agreement: 1e-4 absolute, float32 on both sides, as in test_vllm.py
(vLLM's punica LoRA path computes x W + s (x A) B like our forward; the merged-weight reference
W + s A B differs from it only in summation order).
"""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as jmodel
from jaxrlvr.model import lora
from jaxrlvr.sampling import base, vllm_sampler, vllm_server

pytestmark = pytest.mark.vllm

ATOL = 1e-4
PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [300, 301, 302, 303, 304, 305]]
LORA = lora.LoRAConfig(rank=8, alpha=16.0)  # every projection


def _max_gap(served, expected):
    return max(float(np.max(np.abs(np.asarray(c.logprobs) - e))) for c, e in zip(served, expected))


@pytest.fixture(scope="module")
def lora_server(vllm_python, tiny_export, tmp_path_factory):
    """A LoRA-enabled server on the session's tiny export (the base model)."""
    log = tmp_path_factory.mktemp("vllm-lora-log") / "server.log"
    server = vllm_server.VLLMServer(
        tiny_export["dir"], python=vllm_python, log_path=log, lora_rank=LORA.rank
    )
    yield server
    server.stop()


def _with_random_adapters(cfg, base_params, seed):
    """The LoRA model's params: the base's values plus random A and B (a real change)."""
    abstract = nnx.eval_shape(lambda: jmodel.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, shapes = nnx.split(abstract, nnx.Param)
    rng = np.random.default_rng(seed)
    ad = jax.tree.map(
        lambda s: jax.numpy.asarray(0.08 * rng.standard_normal(s.shape).astype(np.float32)),
        lora.adapters(shapes),
    )
    return graphdef, nnx.merge_state(base_params, ad)


def test_adapters_are_synced_as_new_versions_and_served_exactly(
    lora_server, tiny_export, tmp_path, helpers
):
    base_cfg, base_graph = tiny_export["cfg"], tiny_export["graphdef"]
    cfg = base_cfg.replace(lora=LORA)
    ref = helpers.reference_logprobs
    params = base.SamplingParams(max_tokens=10, seed=0, ignore_eos=True)
    assert "--enable-lora" in lora_server.command()
    with vllm_sampler.VLLMSampler(
        cfg, lora_server, tiny_export["tokenizer"], export_dir=tmp_path
    ) as s:
        # Before the first sync the rollouts name the base model (fresh adapters: B = 0).
        out = s.generate(PROMPTS, 2, params)
        assert s.adapter_name is None
        assert _max_gap(out, ref(base_graph, tiny_export["params"], PROMPTS, out)) < ATOL

        names = []
        for version in (1, 2, 3):
            graphdef, full = _with_random_adapters(cfg, tiny_export["params"], seed=version)
            timings = s.update_weights(full, version=version)
            names.append(s.adapter_name)
            # Only the adapters travel: 7 projections x 2 layers x r (in + out) floats.
            assert timings["bytes_written"] == 4 * lora.num_adapter_params(full)
            assert timings["bytes_written"] < 0.2 * 4 * jmodel.param_count(tiny_export["params"])
            assert s.version == version and s.live_versions() == [str(version)]
            # The current adapter is loaded, the previous one unloaded and its files removed.
            assert s.loaded_adapters() == [[s.adapter_name]]
            assert sorted(os.listdir(tmp_path)) == [s.adapter_name]

            out = s.generate(PROMPTS, 2, params)
            merged = lora.merged(cfg.lora, full)
            assert _max_gap(out, ref(base_graph, merged, PROMPTS, out)) < ATOL
            assert _max_gap(out, ref(graphdef, full, PROMPTS, out)) < ATOL  # adapters applied
            # ...and the served log-probs are not the base model's.
            assert _max_gap(out, ref(base_graph, tiny_export["params"], PROMPTS, out)) > 1e-2
        assert len(set(names)) == 3
