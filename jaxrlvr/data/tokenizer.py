"""A character-level tokenizer built locally, for tiny models trained from scratch (demo, tests).

One token per printable ASCII character (plus newline and tab), the reasoning/answer tags as whole
tokens that survive ``decode(..., skip_special_tokens=True)``, ``<|endoftext|>`` (eos),
``<|pad|>`` (pad) and ``<|unk|>`` for anything else. Built with the ``tokenizers`` library, so it
needs no download; the vocabulary order is fixed, so two builds give identical ids.
Left out: any merges (a BPE with an empty merge list is exactly character-level).

Importing this module filters out one log line: transformers' "PyTorch was not found..."
advisory, which a torch-free environment (the demo's) would otherwise print as if it were an
error. Everything else transformers logs is untouched.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Sequence

# The advisory transformers logs when it is imported without torch. jaxrlvr needs transformers
# only for tokenizers (the demo's environment has no torch), so there it is expected, not an error.
TORCH_MISSING_ADVISORY = "PyTorch was not found."


class _DropTorchMissingAdvisory(logging.Filter):
    """Drops exactly transformers' torch-missing advisory; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TORCH_MISSING_ADVISORY)


def silence_torch_missing_advisory() -> None:
    """Installs (once) a filter on the ``transformers`` logger, which logs the advisory from its
    ``__init__``; call it before transformers is first imported. Idempotent."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _DropTorchMissingAdvisory) for f in logger.filters):
        logger.addFilter(_DropTorchMissingAdvisory())


silence_torch_missing_advisory()

import tokenizers  # noqa: E402  (after the filter: transformers logs the advisory at import)
import transformers  # noqa: E402
from tokenizers import decoders, models  # noqa: E402

PAD = "<|pad|>"
EOS = "<|endoftext|>"
UNK = "<|unk|>"
DEFAULT_EXTRA_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# Printable ASCII in code-point order, then newline and tab.
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n", "\t")
assert set(CHARACTERS) <= set(string.printable)


def build_char_tokenizer(
    extra_tokens: Sequence[str] = DEFAULT_EXTRA_TOKENS,
) -> transformers.PreTrainedTokenizerFast:
    """The character-level tokenizer.

    Ids: 0 ``<|pad|>``, 1 ``<|endoftext|>``, 2 ``<|unk|>``, then the characters, then
    ``extra_tokens`` in order. The extra tokens are added as non-special tokens, so decoding with
    ``skip_special_tokens=True`` keeps them and drops pad/eos.
    """
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in (PAD, EOS, UNK)]
    )
    backend.add_tokens(
        [tokenizers.AddedToken(t, special=False, normalized=False) for t in extra_tokens]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
