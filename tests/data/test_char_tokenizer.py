"""Character tokenizer: round trips, whole-token tags, special tokens, save and reload."""

import logging
import os
import subprocess
import sys

import transformers

from jaxrlvr.data import tokenizer


def test_round_trip_and_tags_are_single_tokens():
    tok = tokenizer.build_char_tokenizer()
    text = "7 + 5 - 3 =\n<think> 12 - 3 </think> <answer>9</answer>"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    tokens = tok.convert_ids_to_tokens(ids)
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert tag in tokens
    # Everything else is one token per character.
    stripped = text
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        stripped = stripped.replace(tag, "")
    assert len(ids) == len(stripped) + 4


def test_special_tokens_and_decoding():
    tok = tokenizer.build_char_tokenizer()
    assert (tok.pad_token, tok.pad_token_id) == ("<|pad|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 1)
    ids = tok("<answer>4</answer>")["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "<answer>4</answer>"
    assert tok.convert_ids_to_tokens(tok("é")["input_ids"]) == ["<|unk|>"]
    assert len(tok) == 3 + 97 + 4  # specials, printable ASCII + \n + \t, tags


def test_deterministic_and_saves(tmp_path):
    a, b = tokenizer.build_char_tokenizer(), tokenizer.build_char_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    a.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Ana has 7 apples. <answer>7</answer>"
    assert loaded(text)["input_ids"] == a(text)["input_ids"]
    assert loaded.eos_token_id == 1 and loaded.pad_token_id == 0


def test_custom_extra_tokens():
    tok = tokenizer.build_char_tokenizer(extra_tokens=("<sep>",))
    assert tok.convert_ids_to_tokens(tok("a<sep>b")["input_ids"]) == ["a", "<sep>", "b"]
    assert "<answer>" not in tok.get_vocab()


# ------------------------------------------------------------------------------------------------
# transformers' torch-missing advisory (the demo's environment has no torch)

# transformers decides "no torch" with importlib.util.find_spec, which says None for a module
# that sys.modules maps to None: a torch-free environment without building one.
_WITHOUT_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run_without_torch(code: str) -> str:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY")
    }
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH + code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_transformers_alone_prints_the_advisory_without_torch():
    # The control: the simulation reproduces what the demo printed.
    assert tokenizer.TORCH_MISSING_ADVISORY in _run_without_torch("import transformers")


def test_tokenizer_path_prints_no_advisory_without_torch():
    out = _run_without_torch(
        "from jaxrlvr.data import tokenizer\n"
        "import transformers\n"
        "tok = tokenizer.build_char_tokenizer()\n"
        "assert tok.decode(tok('1 + 2')['input_ids']) == '1 + 2'\n"
        "print('ok')\n"
    )
    assert tokenizer.TORCH_MISSING_ADVISORY not in out
    assert out.strip() == "ok"


def test_only_the_advisory_is_dropped():
    logger = logging.getLogger("transformers")

    def record(msg):
        return logger.makeRecord("transformers", logging.WARNING, __file__, 1, msg, (), None)

    tokenizer.silence_torch_missing_advisory()  # idempotent: one filter however often called
    filters = [f for f in logger.filters if isinstance(f, tokenizer._DropTorchMissingAdvisory)]
    assert len(filters) == 1
    assert not logger.filter(record("PyTorch was not found. Models won't be available ..."))
    assert logger.filter(record("Some weights of the model checkpoint were not used"))
    assert logger.filter(record("PyTorch version 2.5 is too old"))
