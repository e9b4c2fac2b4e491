"""Tokenizers: one small interface, a character tokenizer for synthetic tasks, and HF tokenizers.

`Tokenizer` is what the rest of the code sees: encode / decode / apply_chat_template /
encode_chat plus the special ids the sampler needs (`pad_id`, `bos_id`, `eos_ids`). Two
implementations:

- `CharTokenizer`: one id per character of a fixed alphabet, for synthetic tasks (arithmetic) with
  tiny models, so tests and the CPU demo need no downloaded files. Like tokenizer.json for an HF
  model, it belongs to the checkpoint: its `to_dict()` is saved as `char_tokenizer.json` in the
  checkpoint directory, where `load_tokenizer(directory)` finds it.
- `HFTokenizer`: a Hugging Face checkpoint directory read with the `tokenizers` library and jinja2,
  not `transformers` (which pulls in torch). Chat templates render as in transformers (same jinja
  environment and variables), so prompts match what the model was trained on.

Choices a reader may question:
- `encode` never adds special tokens by itself; BOS comes only from `add_bos=True` or from the chat
  template text. A post-processor that also adds BOS (Llama 3 has one) would double it on templated
  prompts. `add_bos_token` records the checkpoint's preference for callers encoding raw text.
- `eos_ids` is a tuple: instruct models stop on several tokens (Llama 3: <|eot_id|>,
  <|end_of_text|>). `generation_config.json` overrides it: HF keeps the full stop list there.
- Templates get no `strftime_now` (transformers has one), so they fall back to their fixed default
  date and the same config renders the same prompts on every day of a run.

Untrusted text cannot forge special tokens: `encode` encodes text as data unless
`special=True`, and `encode_chat` gives a chat template's markup its special ids and
the messages inserted into it none. Added tokens are matched by their exact text in markup too
(an added token with normalized=True is matched unnormalised), so that escaping sees each match.

Special-token strings in untrusted text: kept text, also inside a chat template's markup.
A program's output, a file the model reads or a data set's prompt that holds
"<|im_end|>\n<|im_start|>assistant\n" must stay text: encoded with its special-token ids it would
become turn structure in the episode. So `Tokenizer.encode` treats text as data by default
(`special=False`): every special- or added-token string in it (<|im_end|>, <|eot_id|>, Qwen's
<tool_call>, also where that token is not marked special) gets the ids of its characters.
`special=True` is for markup the caller wrote itself (a tool-call close, to find its stop id).

A chat prompt mixes both: the template's markup must give the special ids, the messages inserted
into it must not. `Tokenizer.render_chat` renders the template with every message string, dict
keys included, escaped (`SpecialStrings.escape`: each special-token string becomes a short run
of Unicode noncharacters, which templates pass through unchanged, `tojson` and `trim` included,
and no tokenizer matches), except `Trusted` strings. `encode_rendered` then gives the special-token
strings left in the text, the markup's, their ids, and encodes each stretch of text between two
of them that holds an escape as data, unescaped. Every other stretch is encoded as before, so a
conversation whose messages hold no special-token string gets exactly the ids of
`encode(rendering, special=True)`, the ids transformers gives it.

Choices in the escaping a reader may question:
- Escaping rather than rendering each content as a sentinel and splitting there: templates
  transform contents (Llama 3 writes a tool result through `tojson`, quoted and escaped, and
  trims others), so a sentinel's place does not say what text stands there. Escapes ride along
  inside the content through whatever the template does to it.
- Message strings are data for the template's logic too: Qwen3's `'</think>' in content` is
  false for an escaped `</think>`, so a think block in a data set's prompt renders verbatim, as
  text, and no message can steer the template.
- A stretch of data is cut at the special tokens around it, where the tokenizer cuts anyway
  (added tokens are split off before pre-tokenising). Whitespace that an lstrip / rstrip added
  token would swallow stays in the data next to it (neither Qwen nor Llama 3 has such tokens).
- ESCAPE inside `Trusted` or template text would be read as an escape: Unicode reserves
  noncharacters for a program's internal use, so no real text needs them.
"""

from __future__ import annotations

import abc
import functools
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2.ext
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# An escape: ESCAPE, the index of the special-token string in hex digits U+FDE0..U+FDEF, ESCAPE.
# A literal ESCAPE is ESCAPE ESCAPE. All of them are noncharacters.
ESCAPE = "\ufdd0"
_HEX = "".join(chr(0xFDE0 + i) for i in range(16))
_UNESCAPE = re.compile(f"{ESCAPE}([{_HEX[0]}-{_HEX[-1]}]*){ESCAPE}")
_NONCHARACTERS = range(0xFDD0, 0xFDF0)


class Trusted(str):
    """A message string the caller wrote itself (a config's system prompt, an environment's
    own tool description): `render_chat` leaves its special-token strings special. Every other
    string in a message is data."""


class SpecialStrings:
    """A tokenizer's special-token strings: escaping them in data, and encoding rendered text."""

    def __init__(self, strings, owner: str):
        self.strings = tuple(sorted(set(strings), key=lambda t: (-len(t), t)))  # longest first
        if any(ord(c) in _NONCHARACTERS for t in self.strings for c in t):
            raise ValueError(f"{owner}: a special token holds a Unicode noncharacter U+FDD0-FDEF")
        self._index = {t: i for i, t in enumerate(self.strings)}
        self.pattern = re.compile("|".join(map(re.escape, self.strings)) or "(?!)")
        self._escapable = re.compile("|".join([ESCAPE, *map(re.escape, self.strings)]))

    def escape(self, text: str) -> str:
        """`text` as data inside markup: each special-token string (and ESCAPE) as an escape."""

        def one(m):
            if m.group() == ESCAPE:
                return ESCAPE * 2
            return (
                ESCAPE + "".join(_HEX[int(d, 16)] for d in f"{self._index[m.group()]:x}") + ESCAPE
            )

        return self._escapable.sub(one, text)

    def unescape(self, text: str) -> str:
        """The inverse of `escape`."""

        def one(m):
            if not m.group(1):
                return ESCAPE
            i = int("".join(f"{ord(c) - 0xFDE0:x}" for c in m.group(1)), 16)
            return self.strings[i] if i < len(self.strings) else m.group()

        return _UNESCAPE.sub(one, text)

    def encode_rendered(self, text: str, encode: Callable[..., list[int]]) -> list[int]:
        """Ids of text with escaped data in it, `encode(text, special=...)` being the
        tokenizer's: special-token strings get their ids, a stretch between two of them that
        holds an escape is unescaped and encoded as data."""
        if ESCAPE not in text:
            return encode(text, special=True)
        ids: list[int] = []
        run = gap = 0  # start of the markup not yet encoded; end of the last special token
        for m in [*self.pattern.finditer(text), None]:
            end = len(text) if m is None else m.start()
            if ESCAPE in text[gap:end]:
                ids += encode(text[run:gap], special=True)
                ids += encode(self.unescape(text[gap:end]), special=False)
                run = end
            gap = end if m is None else m.end()
        return ids + encode(text[run:], special=True)


def escape_messages(x: Any, escape: Callable[[str], str]) -> Any:
    """A copy of a message list (dicts, lists, strings) with every string that is not `Trusted`
    escaped, dict keys included: a data set's tool call can carry its own keys (`arguments`
    rendered through `tojson`), and a key is text in the rendering like any value. Escaping is
    the identity on a string without special-token strings, so the keys the template looks up
    ("role", "content", "tool_calls", ...) stay the same."""
    if isinstance(x, Trusted):
        return x
    if isinstance(x, str):
        return escape(x)
    if isinstance(x, Mapping):
        return {escape_messages(k, escape): escape_messages(v, escape) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [escape_messages(v, escape) for v in x]
    return x


class Tokenizer(abc.ABC):
    """The interface the sampler, rewards and data pipeline use."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos_token: bool = False  # whether the checkpoint expects BOS in front of raw text

    @abc.abstractmethod
    def encode(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of `text`. `special=False` (the default, for any text that is data: tool
        output, file contents, prompts): special-token strings in it are encoded as the text they
        are, never as their own ids. `special=True`: they map to their ids, for markup the caller
        wrote itself (a stop string such as `</tool_call>`, template output without messages)."""

    @abc.abstractmethod
    def special_strings(self) -> tuple[str, ...]:
        """The strings that `encode(..., special=True)` maps to ids of their own (HF: every added
        token, special or not; CharTokenizer: <pad>, <bos>, <eos>)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
        """Text of a 1-D id sequence. Does not stop at EOS: the caller cuts at its length."""

    @abc.abstractmethod
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Prompt text for a conversation of {"role": ..., "content": ...} messages, to read;
        its ids come from `encode_chat`."""

    @abc.abstractmethod
    def to_dict(self) -> dict:
        """A json-able description that `load_tokenizer` turns back into this tokenizer."""

    # ----- untrusted text inside markup (`SpecialStrings`, above)

    @functools.cached_property
    def _specials(self) -> SpecialStrings:
        return SpecialStrings(self.special_strings(), getattr(self, "path", type(self).__name__))

    def escape(self, text: str) -> str:
        """`text` as data inside trusted markup: its special-token strings as escapes, which
        `encode_rendered` encodes as the text they are."""
        return self._specials.escape(text)

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """`apply_chat_template` with every message string escaped except `Trusted` ones: text
        to cut (`models.chat`) and encode with `encode_rendered`. Template arguments (`tools`,
        `enable_thinking`) are the caller's and stay markup."""
        return self.apply_chat_template(
            escape_messages(messages, self.escape),
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    def encode_rendered(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of `render_chat` output, a piece of it, or trusted markup with `escape`d data in
        it: special-token strings get their ids, the escaped data is encoded as text. Text
        without escapes: `encode(text, special=True)`."""
        return self.encode("", add_bos) + self._specials.encode_rendered(text, self.encode)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Prompt ids of a conversation: the chat template's markup with its special ids, the
        message strings (except `Trusted` ones) as text."""
        return self.encode_rendered(
            self.render_chat(messages, add_generation_prompt, **template_kwargs)
        )


def _as_id_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    # np.asarray accepts lists, numpy and jax arrays alike; a 2-D batch here is a caller bug.
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"decode expects a 1-D id sequence, got shape {arr.shape}")
    return arr.tolist()


CHAR_TOKENIZER_FILE = "char_tokenizer.json"  # a CharTokenizer's to_dict() in a checkpoint directory


class CharTokenizer(Tokenizer):
    """One id per character: 0=<pad>, 1=<bos>, 2=<eos>, then the alphabet in order.

    The chat template concatenates the message contents in order, without roles or separators;
    `add_generation_prompt` and template keyword arguments change nothing. Synthetic tasks put the
    whole prompt in one user message and the model learns the answer format from the reward.
    "<eos>" in text is five characters, as it always was here; `encode(..., special=True)` (and
    `Trusted` message strings) map "<pad>", "<bos>", "<eos>" to their ids, as for HF tokenizers.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str):
        if not alphabet:
            raise ValueError("CharTokenizer alphabet is empty")
        dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if dupes:
            raise ValueError(f"CharTokenizer alphabet repeats characters {dupes!r}")
        self.alphabet = alphabet
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(self.SPECIALS) + len(alphabet)
        self.pad_id, self.bos_id, self.eos_ids = 0, 1, (2,)

    def encode(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        cuts = list(self._specials.pattern.finditer(text)) if special else []
        start = 0
        for m in [*cuts, None]:
            for c in text[start : len(text) if m is None else m.start()]:
                if c not in self._ids:
                    raise ValueError(f"character {c!r} is not in the CharTokenizer alphabet")
                ids.append(self._ids[c])
            if m is not None:
                ids.append(self.SPECIALS.index(m.group()))
                start = m.end()
        return ids

    def special_strings(self) -> tuple[str, ...]:
        return self.SPECIALS

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
        out = []
        for i in _as_id_list(ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"id {i} is outside the CharTokenizer vocab [0, {self.vocab_size})"
                )
            if i < len(self.SPECIALS):
                if not skip_special:
                    out.append(self.SPECIALS[i])
            else:
                out.append(self.alphabet[i - len(self.SPECIALS)])
        return "".join(out)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        return "".join(m["content"] for m in messages)

    def to_dict(self) -> dict:
        return {"type": "char", "alphabet": self.alphabet}

    @classmethod
    def from_dict(cls, d: Mapping) -> CharTokenizer:
        return cls(d["alphabet"])


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens as plain strings or as AddedToken dicts.
    return tok.get("content") if isinstance(tok, dict) else tok


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


class HFTokenizer(Tokenizer):
    """A HF tokenizer directory: tokenizer.json, and when present tokenizer_config.json,
    chat_template.jinja and generation_config.json."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        tok_file = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"no tokenizer.json at {tok_file}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:  # the Rust library raises a bare Exception
            raise ValueError(f"{tok_file}: not a valid tokenizer file ({e})") from None
        self._tok, self._plain = _markup_and_plain(self._tok)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._config_file = os.path.join(self.path, "tokenizer_config.json")
        config = _read_json(self._config_file)
        gen = _read_json(os.path.join(self.path, "generation_config.json"))

        # String forms feed the chat template; ids feed the sampler.
        self._special = {
            k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")
        }
        self.bos_id = self._id_of("bos_token")
        e = gen.get("eos_token_id")
        e = self._id_of("eos_token") if e is None else e
        self.eos_ids = tuple(
            int(i) for i in (e if isinstance(e, list) else [] if e is None else [e])
        )
        if not self.eos_ids:
            raise ValueError(
                f"no EOS token for {self.path}: set eos_token in tokenizer_config.json or "
                "eos_token_id in generation_config.json (generation would never stop)"
            )
        pad = gen.get("pad_token_id", self._id_of("pad_token"))
        self.pad_id = self.eos_ids[0] if pad is None else int(pad)
        self.add_bos_token = bool(config.get("add_bos_token", False))

        self._template_src = self._find_template(config)
        self._template = None  # compiled on first use

    def _id_of(self, key: str) -> int | None:
        token = self._special[key]
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{key} {token!r} from {self._config_file} is not in the vocabulary")
        return i

    def _find_template(self, config: dict) -> str | None:
        # Newer transformers save the template as its own file; it wins over the config entry.
        jinja_file = os.path.join(self.path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return f.read()
        t = config.get("chat_template")
        if isinstance(t, list):  # older multi-template form: [{"name": ..., "template": ...}]
            t = {d["name"]: d["template"] for d in t}.get("default")
        return t

    def encode(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        ids = (self._tok if special else self._plain).encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"add_bos=True but {self._config_file} defines no bos_token")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
        return self._tok.decode(_as_id_list(ids), skip_special_tokens=skip_special)

    def special_strings(self) -> tuple[str, ...]:
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values())

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Renders as transformers' `apply_chat_template(..., tokenize=False)`; `tools` (JSON
        schemas, OpenAI function format) is the template's `tools` variable, as in transformers;
        extra keyword arguments (e.g. Qwen3's `enable_thinking=False`) become template
        variables. The text is for reading: ids come from `encode_chat` (or `render_chat` and
        `encode_rendered`), which keep the messages' special-token strings text."""
        if self._template_src is None:
            raise ValueError(
                f"{self._config_file} has no chat_template (nor is there a chat_template.jinja "
                "next to it); build prompts without apply_chat_template for this tokenizer"
            )
        if self._template is None:
            self._template = _compile_template(self._template_src)
        specials = {k: v for k, v in self._special.items() if v is not None}
        return self._template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **specials,
            **template_kwargs,
        )

    def to_dict(self) -> dict:
        return {"type": "hf", "path": self.path}

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
        return cls(os.fspath(path))


def _markup_and_plain(
    tok: tokenizers.Tokenizer,
) -> tuple[tokenizers.Tokenizer, tokenizers.Tokenizer]:
    """Two copies of `tok`: for markup, with added tokens matched by their exact text (where a
    normalizer could map other text onto a normalized=True one, `escape` would miss it); and for
    data, with every added token marked special and `encode_special_tokens` on, so that none of
    them is matched (that flag alone skips only the special ones). Two objects rather than one
    flag toggled per call: rewards and tools encode on worker threads."""
    spec = json.loads(tok.to_str())
    added = spec.get("added_tokens") or []
    if spec.get("normalizer") is not None and any(t.get("normalized") for t in added):
        for t in added:
            t["normalized"] = False
        tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    for t in added:
        t["special"] = True
    plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return tok, plain


def _compile_template(source: str):
    """The jinja environment transformers uses for chat templates."""

    def raise_exception(message):
        raise ValueError(f"chat template error: {message}")

    def tojson(x, **kwargs):
        # jinja's own tojson escapes HTML characters; transformers overrides it with json.dumps.
        return json.dumps(x, **{"ensure_ascii": False, **kwargs})

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def load_tokenizer(spec: Any) -> Tokenizer:
    """A tokenizer from a checkpoint directory (its `char_tokenizer.json` where present, else the
    HF tokenizer files), a `to_dict()` dict, or a Tokenizer."""
    if isinstance(spec, Tokenizer):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        char_file = os.path.join(os.fspath(spec), CHAR_TOKENIZER_FILE)
        if os.path.isfile(char_file):
            d = _read_json(char_file)
            try:
                return load_tokenizer(d)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{char_file}: not a valid char tokenizer ({e!r})") from None
        if not os.path.isfile(os.path.join(os.fspath(spec), "tokenizer.json")):
            raise FileNotFoundError(
                f"{os.fspath(spec)}: no tokenizer (neither {CHAR_TOKENIZER_FILE} nor tokenizer.json)"
            )
        return HFTokenizer.from_dir(spec)
    if isinstance(spec, Mapping) or hasattr(spec, "keys"):  # dict or ml_collections.ConfigDict
        d = dict(spec)
        kind = d.get("type")
        if kind == "char":
            return CharTokenizer.from_dict(d)
        if kind == "hf":
            return HFTokenizer.from_dir(d["path"])
        raise ValueError(f"tokenizer spec type must be 'char' or 'hf', got {kind!r} in {d}")
    raise TypeError(f"cannot build a tokenizer from {type(spec).__name__}: {spec!r}")
