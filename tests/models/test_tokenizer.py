"""Tests for models/tokenizer.py.

The HF path uses a byte-level BPE trained here on a tiny corpus, so no network and no transformers.
Expected chat strings are written out by hand from the template, as transformers renders them.
"""

import json
import random
import shutil

import jinja2
import numpy as np
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RawTokenizer

from models.tokenizer import (
    CHAR_TOKENIZER_FILE,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

# ---------------------------------------------------------------- CharTokenizer

ALPHABET = "0123456789+-*= ?"


def test_char_special_ids_and_vocab():
    tok = CharTokenizer(ALPHABET)
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, (2,))
    assert tok.vocab_size == 3 + len(ALPHABET)
    assert tok.encode("0") == [3]
    assert tok.encode("?") == [3 + len(ALPHABET) - 1]
    assert tok.encode("12", add_bos=True) == [1, 4, 5]


def test_char_round_trip_random_strings():
    tok = CharTokenizer(ALPHABET)
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 30)))
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert all(3 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(np.asarray(ids, np.int32)) == text


def test_char_decode_skips_specials():
    tok = CharTokenizer(ALPHABET)
    ids = [1, *tok.encode("1+1=2"), 2, 0, 0]
    assert tok.decode(ids) == "1+1=2"
    assert tok.decode(ids, skip_special=False) == "<bos>1+1=2<eos><pad><pad>"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(np.zeros((2, 2), np.int32))


def test_char_errors():
    tok = CharTokenizer(ALPHABET)
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("12x4")
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer("abca")
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer("")


def test_char_chat_template_and_serialisation():
    tok = CharTokenizer(ALPHABET)
    msgs = [{"role": "system", "content": "1+"}, {"role": "user", "content": "2="}]
    assert tok.apply_chat_template(msgs) == "1+2="
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "1+2="
    d = json.loads(json.dumps(tok.to_dict()))
    assert d == {"type": "char", "alphabet": ALPHABET}
    tok2 = load_tokenizer(d)
    assert isinstance(tok2, CharTokenizer)
    assert tok2.encode("9*9=81") == tok.encode("9*9=81")
    assert load_tokenizer(tok) is tok
    with pytest.raises(ValueError, match="'bpe'"):
        load_tokenizer({"type": "bpe"})


def test_char_tokenizer_file_in_a_checkpoint_directory(tmp_path):
    """A checkpoint directory with char_tokenizer.json loads as that CharTokenizer; without it,
    load_tokenizer wants the HF files."""
    (tmp_path / CHAR_TOKENIZER_FILE).write_text(json.dumps(CharTokenizer(ALPHABET).to_dict()))
    for spec in (tmp_path, str(tmp_path)):
        tok = load_tokenizer(spec)
        assert isinstance(tok, CharTokenizer) and tok.alphabet == ALPHABET
    (tmp_path / CHAR_TOKENIZER_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


# ---------------------------------------------------------------- HFTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 after training
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "def add(a, b):\n    return a + b\n",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "数学 is mathematics; 🙂 is a smile.",
] * 20

# Qwen-like template. Block tags sit on indented lines of their own and the newline after each
# message is literal text, so the output is right only with trim_blocks and lstrip_blocks on.
QWEN_TEMPLATE = """{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message.role) }}
    {% endif %}
{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\n' }}{% endif %}"""

# Llama-like: uses the bos_token variable and a custom keyword argument.
BOS_TEMPLATE = """{{ bos_token }}{% for m in messages %}
[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% if think %} <think>{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text round-trips
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    raw.save(str(path))
    return path


def make_dir(tmp_path, tokenizer_json, config=None, generation=None, jinja=None):
    shutil.copy(tokenizer_json, tmp_path / "tokenizer.json")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


QWEN_CONFIG = {"chat_template": QWEN_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": None}


def test_hf_round_trip(tmp_path, tokenizer_json):
    tok = HFTokenizer.from_dir(make_dir(tmp_path, tokenizer_json, QWEN_CONFIG))
    assert tok.vocab_size == RawTokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    texts = [
        "The answer is 42.",
        "",
        "  leading and trailing spaces  ",
        "tabs\tand\nnew lines\n\n\r\n",
        "naïve café — 数学 🙂 Ωμέγα",
        "unseen words: xylophone zzz",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(np.asarray(ids, np.int32)) == text


def test_hf_special_ids(tmp_path, tokenizer_json):
    tok = HFTokenizer.from_dir(make_dir(tmp_path, tokenizer_json, QWEN_CONFIG))
    assert tok.eos_ids == (2,)
    assert tok.pad_id == 2  # no pad_token: falls back to eos[0]
    assert tok.bos_id is None
    assert tok.add_bos_token is False
    # With special=True (markup), special-token strings become their single ids; decode can
    # drop or keep them. By default (data) they are text.
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", special=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
    plain = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert not {0, 1, 2} & set(plain) and tok.decode(plain) == "<|im_start|>user\nhi<|im_end|>"
    with pytest.raises(ValueError, match="bos_token"):
        tok.encode("hi", add_bos=True)


def test_hf_chat_template(tmp_path, tokenizer_json):
    tok = load_tokenizer(str(make_dir(tmp_path, tokenizer_json, QWEN_CONFIG)))
    assert isinstance(tok, HFTokenizer)
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    expected = (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == expected
    # The template relies on trim_blocks / lstrip_blocks: default jinja renders it otherwise.
    assert (
        jinja2.Template(QWEN_TEMPLATE).render(messages=msgs, add_generation_prompt=True) != expected
    )
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert no_gen == expected.removesuffix("<|im_start|>assistant\n")
    ids = tok.encode(expected, special=True)
    assert ids.count(1) == 3 and ids.count(2) == 2  # specials map to single ids
    assert tok.encode_chat(msgs) == ids  # the same ids: no message holds a special-token string
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_jinja_file_dict_tokens_and_generation_config(tmp_path, tokenizer_json):
    config = {
        "bos_token": {"content": "<|endoftext|>", "special": True},  # AddedToken dict form
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_start|>",
        "add_bos_token": True,
        "chat_template": "ignored: chat_template.jinja wins",
    }
    generation = {"eos_token_id": [2, 0], "pad_token_id": 0}
    d = make_dir(tmp_path, tokenizer_json, config, generation, jinja=BOS_TEMPLATE)
    tok = HFTokenizer.from_dir(d)
    assert tok.bos_id == 0 and tok.add_bos_token
    assert tok.eos_ids == (2, 0)
    assert tok.pad_id == 0
    assert tok.encode("hi", add_bos=True)[0] == 0
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert tok.apply_chat_template(msgs) == (
        "<|endoftext|>[user] hi<|im_end|>\n[assistant] ok<|im_end|>\n[assistant]"
    )
    assert tok.apply_chat_template(msgs[:1], think=True) == (
        "<|endoftext|>[user] hi<|im_end|>\n[assistant] <think>"
    )
    assert tok.to_dict() == {"type": "hf", "path": str(d)}
    assert load_tokenizer(tok.to_dict()).eos_ids == (2, 0)


def test_hf_generation_config_single_eos_and_pad_token(tmp_path, tokenizer_json):
    config = dict(QWEN_CONFIG, pad_token="<|endoftext|>")
    tok = HFTokenizer.from_dir(make_dir(tmp_path, tokenizer_json, config, {"eos_token_id": 0}))
    assert tok.eos_ids == (0,)
    assert tok.pad_id == 0


def test_hf_errors(tmp_path, tokenizer_json):
    missing = tmp_path / "empty"
    missing.mkdir()
    with pytest.raises(FileNotFoundError, match=str(missing / "tokenizer.json")):
        HFTokenizer.from_dir(missing)

    d = make_dir(tmp_path, tokenizer_json, {"eos_token": "<|im_end|>"})
    tok = HFTokenizer.from_dir(d)
    with pytest.raises(ValueError, match="tokenizer_config.json has no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])

    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer.from_dir(d)

    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="no EOS token"):
        HFTokenizer.from_dir(d)


def test_hf_normalized_added_token_matches_its_exact_text_only(tmp_path, tokenizer_json):
    """A normalized=True added token under a lowercasing normalizer: `tokenizers` would match
    "<|IM_END|>" as <|im_end|>, which escaping (exact text) cannot see. Matched by its exact
    text, markup keeps its id and data cannot forge it."""
    raw = RawTokenizer.from_file(str(tokenizer_json))
    raw.normalizer = normalizers.Lowercase()
    raw.add_special_tokens([AddedToken("<|tool|>", normalized=True, special=True)])
    assert raw.token_to_id("<|tool|>") in raw.encode("a<|TOOL|>").ids  # the risk
    (tmp_path / "tokenizer.json").write_text(raw.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(QWEN_CONFIG))
    tok = HFTokenizer.from_dir(tmp_path)
    tool = raw.token_to_id("<|tool|>")
    assert tool in tok.encode("a<|tool|>", special=True)
    assert tool not in tok.encode("a<|TOOL|>", special=True) + tok.encode("a<|tool|>")
    msgs = [{"role": "user", "content": "a<|TOOL|> <|tool|>"}]
    assert tool not in tok.encode_chat(msgs) and 1 in tok.encode_chat(msgs)  # <|im_start|>
