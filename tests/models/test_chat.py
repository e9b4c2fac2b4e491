"""Tests for models/chat.py: an episode built from message deltas equals the template's rendering.

The tokenizers are those of the HF fixtures (tests/fixtures/hf/{qwen2,qwen3,llama}) where the
fixture directory has a tokenizer.json; otherwise a stand-in made here: a byte-level BPE trained on
a small corpus, with the family's pre-tokenizer regex, special and added tokens, stop ids and its
published chat template (Qwen2.5-Instruct, Qwen3, Llama 3.2-Instruct, copied verbatim at the end
of this file). transformers, where installed, renders and tokenises whole conversations as the
reference.
"""

import json
import os
import shutil

import pytest
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RawTokenizer

from models.chat import UnstableDeltaError, end_of_turn_id, message_delta_ids
from models.tokenizer import CharTokenizer, load_tokenizer
from tests.conftest import FIXTURES
from tests.models import chat_templates

FAMILIES = ["qwen2", "qwen3", "llama"]
CALL = {  # an assistant turn that ends in a tool call, as the model writes it
    "qwen": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
}
# Tool results; the second starts and ends in blanks.
RESULTS = ["3", '  {"sum": 10}\n two lines\n\n']
THINK = "<think>\nThe tool adds.\n</think>\n\n"


def _kwargs(name):
    # transformers gives templates strftime_now and our renderer does not: fix Llama 3's date.
    return {"date_string": "26 Jul 2024"} if name == "llama" else {}


def _call(name):
    return CALL["llama" if name == "llama" else "qwen"]


# ---------------------------------------------------------------- stand-in tokenizers

SPLIT = {
    "qwen": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
LLAMA += ["<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
QWEN_CONFIG = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
# name -> template, pre-tokenizer regex, special tokens, added non-special tokens, config, stops
STAND_INS = {
    "qwen2": ("QWEN2_TEMPLATE", "qwen", QWEN, ["<tool_call>", "</tool_call>"], QWEN_CONFIG,
              ["<|im_end|>", "<|endoftext|>"]),
    "qwen3": ("QWEN3_TEMPLATE", "qwen", QWEN, ["<tool_call>", "</tool_call>", "<tool_response>",
              "</tool_response>", "<think>", "</think>"], QWEN_CONFIG,
              ["<|im_end|>", "<|endoftext|>"]),
    "llama": ("LLAMA3_TEMPLATE", "llama", LLAMA, [], LLAMA_CONFIG,
              ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
}  # fmt: skip
CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    "user\nWhat is 1 + 2? Use the tool.\nassistant\n" + THINK + "ipython\n\n",
    CALL["qwen"] + "\n" + CALL["llama"] + "\n<tool_response>\n3\n</tool_response>\n",
    RESULTS[1] + '"3"\n\nThe answer is 3.\n\n',
]


def _write_stand_in(name, directory):
    template, split, special, added, config, stops = STAND_INS[name]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS * 10, trainer)
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    raw.save(os.path.join(directory, "tokenizer.json"))
    config = dict(config, chat_template=getattr(chat_templates, template))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [raw.token_to_id(t) for t in stops]}, f)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    made = {}

    def get(name):
        fixture = os.path.join(FIXTURES, name)
        if os.path.isfile(os.path.join(fixture, "tokenizer.json")):
            return fixture
        if name not in made:
            made[name] = str(tmp_path_factory.mktemp(f"{name}-tokenizer"))
            _write_stand_in(name, made[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    loaded = {}

    def ids(directory, messages, add_generation_prompt, **kwargs):
        if directory not in loaded:
            loaded[directory] = transformers.AutoTokenizer.from_pretrained(directory)
        out = loaded[directory].apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
            **kwargs,
        )
        return list(out["input_ids"])

    return ids


# ---------------------------------------------------------------- episodes


def _episode(tok, messages, closed=lambda turn: True, **kwargs):
    """The ids of `messages` as an episode makes them: the template's prompt for the messages
    before the first assistant turn; for each assistant turn, the ids of its content (what the
    sampler produced) and the end-of-turn id if `closed(turn)` (it stopped on it); for each run of
    other messages, their delta."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = tok.encode_chat(messages[:first], **kwargs)
    eot, turn, pending = end_of_turn_id(tok, **kwargs), 0, []
    for m in messages[first:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            ids += message_delta_ids(tok, pending, turn_closed=closed(turn - 1), **kwargs)
            pending = []
        # The model writes <tool_call> as its token: the sampled ids parse special-token strings.
        ids += tok.encode(m["content"], special=True) + ([eot] if closed(turn) else [])
        turn += 1
    if pending:
        ids += message_delta_ids(tok, pending, turn_closed=closed(turn - 1), **kwargs)
    return ids


def _conversation(name, assistant, results=RESULTS, final=None):
    """[system (Llama)], user, then assistant -> tool per assistant content, [final assistant]."""
    msgs = [{"role": "user", "content": "What is 1 + 2? Use the tool."}]
    if name == "llama":
        msgs.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    for content, result in zip(assistant, results):
        msgs += [{"role": "assistant", "content": content}, {"role": "tool", "content": result}]
    if final is not None:
        msgs.append({"role": "assistant", "content": final})
    return msgs


STOPS = {"eot": lambda t: True, "open": lambda t: False, "mixed": lambda t: t % 2 == 1}


@pytest.mark.hf  # transformers / torch / peft: CI's second pass (.ci/run)
@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("name", FAMILIES)
def test_episode_equals_full_rendering(name, stop, tokenizer_dir, reference):
    """Two tool rounds up to the third turn's generation prompt: the episode's ids equal
    transformers' tokenisation of the whole conversation, whether each turn stopped on the
    end-of-turn token or after its tool call (then the delta closes the turn)."""
    d, kwargs = tokenizer_dir(name), _kwargs(name)
    tok = load_tokenizer(d)
    msgs = _conversation(name, [_call(name), "Let me check.\n" + _call(name)])
    assert _episode(tok, msgs, STOPS[stop], **kwargs) == reference(d, msgs, True, **kwargs)


@pytest.mark.hf  # transformers / torch / peft: CI's second pass (.ci/run)
@pytest.mark.parametrize("name", FAMILIES)
def test_final_turn(name, tokenizer_dir, reference):
    """A closed final turn: the full rendering adds only the template's text after the end-of-turn
    token, except that Qwen3 re-renders the last assistant turn with an empty think block."""
    d, kwargs = tokenizer_dir(name), _kwargs(name)
    tok = load_tokenizer(d)
    msgs = _conversation(name, [_call(name)], final="It is 3.")
    ours, full = _episode(tok, msgs, **kwargs), reference(d, msgs, False, **kwargs)
    if name == "qwen3":
        assert full[: len(ours)] != ours
        msgs[-1]["content"] = "<think>\n\n</think>\n\nIt is 3."  # what the re-render says
        ours = _episode(tok, msgs, **kwargs)
    assert full[: len(ours)] == ours
    assert tok.decode(full[len(ours) :], skip_special=False) == ("" if name == "llama" else "\n")


@pytest.mark.hf  # transformers / torch / peft: CI's second pass (.ci/run)
@pytest.mark.parametrize("name", FAMILIES)
def test_consecutive_tool_messages(name, tokenizer_dir, reference):
    """Two tool results after one turn (parallel calls) go in one delta: Qwen's template puts
    them in one user block, Llama 3's in two ipython blocks."""
    d, kwargs = tokenizer_dir(name), _kwargs(name)
    tok = load_tokenizer(d)
    msgs = _conversation(name, [_call(name)])
    msgs.append({"role": "tool", "content": "5"})
    assert _episode(tok, msgs, **kwargs) == reference(d, msgs, True, **kwargs)


def _text(tok, ids):
    return tok.decode(ids, skip_special=False)


@pytest.mark.hf  # transformers / torch / peft: CI's second pass (.ci/run)
def test_qwen3_think_blocks_kept_where_rerendering_drops_them(tokenizer_dir, reference):
    d = tokenizer_dir("qwen3")
    tok = load_tokenizer(d)
    # Within one query the template keeps the think blocks of the tool-calling turns: equal.
    msgs = _conversation("qwen3", [THINK + CALL["qwen"], THINK + "Check again.\n" + CALL["qwen"]])
    assert _episode(tok, msgs) == reference(d, msgs, True)
    # Re-rendering normalises the whitespace around a think block the model wrote without it.
    tight = "<think>The tool adds.</think>"
    msgs_tight = _conversation("qwen3", [tight + CALL["qwen"]])
    full = reference(d, msgs_tight, True)
    assert _text(tok, full) == _text(tok, _episode(tok, msgs_tight)).replace(tight, THINK)
    # After a new user query, re-rendering drops the think blocks of all earlier turns; the
    # episode keeps the ids the sampler produced.
    msgs.append({"role": "user", "content": "And 2 + 2?"})
    ours, full = _episode(tok, msgs), reference(d, msgs, True)
    assert _text(tok, ours).count(THINK) == 2
    assert "<think>" not in _text(tok, full)
    assert _text(tok, full) == _text(tok, ours).replace(THINK, "")
    # enable_thinking=False: every generation prompt, so every delta, ends with an empty think
    # block; re-rendering keeps only the last one.
    msgs = _conversation("qwen3", [CALL["qwen"], CALL["qwen"]])
    ours = _episode(tok, msgs, enable_thinking=False)
    full = reference(d, msgs, True, enable_thinking=False)
    empty = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert _text(tok, ours).count(empty) == 3 and _text(tok, full).count(empty) == 1
    assert _text(tok, full) == _text(tok, ours).replace(empty, "<|im_start|>assistant\n", 2)


# ---------------------------------------------------------------- the delta itself

QWEN_TOOL = "\n<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n"
DELTA_TEXT = {  # what each template renders for a tool message "R" after a closed assistant turn
    "qwen2": QWEN_TOOL + "<|im_start|>assistant\n",
    "qwen3": QWEN_TOOL + "<|im_start|>assistant\n",
    # Llama 3's template writes a string tool result through tojson: it arrives quoted.
    "llama": '<|start_header_id|>ipython<|end_header_id|>\n\n"R"<|eot_id|>'
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


@pytest.mark.parametrize("role", ["tool", "user"])
@pytest.mark.parametrize("name", FAMILIES)
def test_open_turn_delta_starts_with_end_of_turn(name, role, tokenizer_dir):
    tok, kwargs = load_tokenizer(tokenizer_dir(name)), _kwargs(name)
    eot = end_of_turn_id(tok, **kwargs)
    assert eot in tok.eos_ids
    assert _text(tok, [eot]) == ("<|eot_id|>" if name == "llama" else "<|im_end|>")
    m = {"role": role, "content": "R"}
    closed = message_delta_ids(tok, m, turn_closed=True, **kwargs)
    opened = message_delta_ids(tok, m, turn_closed=False, **kwargs)
    assert opened == [eot] + closed
    if role == "tool":
        assert _text(tok, closed) == DELTA_TEXT[name]
    no_prompt = message_delta_ids(tok, m, turn_closed=True, add_generation_prompt=False, **kwargs)
    assert closed[: len(no_prompt)] == no_prompt and len(no_prompt) < len(closed)


ENDINGS = ["x", "x.", "x ", "x\n", "x\n\n", "{}", "42"]
CONTENTS = ["R", " R", "\nR", "\n\n  {R}", ". R", '"R"']


@pytest.mark.parametrize("name", FAMILIES)
def test_delta_ids_are_the_ids_inside_the_full_tokenisation(name, tokenizer_dir):
    """No BPE merge across the split, whatever the sampled turn ends with and the tool result
    starts with: prefix ids + delta ids == ids of the whole rendered text."""
    tok, kwargs = load_tokenizer(tokenizer_dir(name)), _kwargs(name)
    eot = _text(tok, [end_of_turn_id(tok, **kwargs)])
    for ending in ENDINGS:
        for content in CONTENTS:
            msgs = _conversation(name, [ending], [content])
            whole = tok.apply_chat_template(msgs, **kwargs)
            before = tok.apply_chat_template(msgs[:-2], **kwargs) + msgs[-2]["content"]
            if not whole.startswith(before + eot):  # Llama 3 trims the content it re-renders
                assert name == "llama" and ending != ending.rstrip()
                continue
            for closed, cut in [(True, before + eot), (False, before)]:
                delta = message_delta_ids(tok, msgs[-1], turn_closed=closed, **kwargs)
                want = tok.encode(whole, special=True)
                assert tok.encode(cut, special=True) + delta == want, (ending, content, closed)


def _plain_template_dir(tokenizer_dir, d, template):
    d.mkdir()
    shutil.copy(os.path.join(tokenizer_dir("qwen2"), "tokenizer.json"), d / "tokenizer.json")
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(d))


def test_unstable_or_unmarked_templates_raise(tokenizer_dir, tmp_path):
    # Turns separated by a plain "\n": ".\n" is one pre-token (and one token), so the delta's
    # first "\n" would merge with a sampled "."; and no special token closes a turn.
    tok = _plain_template_dir(
        tokenizer_dir, tmp_path / "plain", "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    assert end_of_turn_id(tok) is None
    m = {"role": "tool", "content": "R"}
    assert tok.decode(tok.encode(".\n")) == ".\n" and len(tok.encode(".\n")) == 1
    with pytest.raises(UnstableDeltaError, match="merge"):
        message_delta_ids(tok, m, turn_closed=False)
    with pytest.raises(ValueError, match="pass turn_closed=False"):
        message_delta_ids(tok, m, turn_closed=True)
    with pytest.raises(ValueError, match="'role' and 'content'"):
        message_delta_ids(tok, {"content": "R"}, turn_closed=False)
    upper = _plain_template_dir(
        tokenizer_dir, tmp_path / "upper", "{{ messages|map(attribute='content')|join|upper }}"
    )
    with pytest.raises(ValueError, match="verbatim"):
        message_delta_ids(upper, m, turn_closed=False)


def test_char_tokenizer_delta_is_the_content():
    tok = CharTokenizer("0123456789+-*= ?")
    assert end_of_turn_id(tok) is None
    for closed in (True, False):
        assert message_delta_ids(tok, {"role": "tool", "content": "12"}, turn_closed=closed) == (
            tok.encode("12")
        )
    two = [{"role": "tool", "content": "1"}, {"role": "user", "content": "2?"}]
    assert message_delta_ids(tok, two, turn_closed=True) == tok.encode("12?")
