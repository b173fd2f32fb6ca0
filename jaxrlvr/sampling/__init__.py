"""Rollout engines behind one interface: the embedded JAX sampler and a vLLM server client.

`SamplingParams`, `Completion` and the `Sampler` protocol live in `base`. `JaxSampler` (module
`jax_sampler`) and `VLLMSampler` (module `vllm_sampler`) are imported on first use, so importing
this package stays cheap and does not pull in JAX compilation or HTTP clients.
"""

import importlib

from jaxrlvr.sampling import base
from jaxrlvr.sampling.base import Completion, Sampler, SamplingParams

_LAZY = {
    "JaxSampler": "jaxrlvr.sampling.jax_sampler",
    "VLLMSampler": "jaxrlvr.sampling.vllm_sampler",
    "VLLMServer": "jaxrlvr.sampling.vllm_server",
}

__all__ = [
    "Completion",
    "JaxSampler",
    "Sampler",
    "SamplingParams",
    "VLLMSampler",
    "VLLMServer",
    "base",
]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
