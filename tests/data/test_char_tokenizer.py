"""Character tokenizer: round trips, whole-token tags, special tokens, save and reload."""

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
