"""jaxrlvr: reinforcement learning from verifiable rewards for language models, in JAX."""
