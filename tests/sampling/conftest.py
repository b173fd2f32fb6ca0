"""Fixtures for sampler tests: tiny random Qwen2 checkpoints and one real vLLM server per session.

vLLM tests (marker ``vllm``) need a Python environment with vLLM installed
(``scripts/setup_vllm.sh``), named by env ``JAXRLVR_VLLM_PYTHON``. Without it they are skipped
locally; in CI (env ``CI`` set) they fail instead, so a broken vLLM setup cannot pass silently.
"""

import json
import os
import pathlib

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
    import transformers

    kw = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,  # head_dim 32: the smallest vLLM-CPU attention supports
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",
        eos_token_id=0,
        bos_token_id=0,
    )
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
