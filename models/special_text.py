"""Special-token strings in untrusted text: kept text, also inside a chat template's markup.

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

Choices a reader may question:
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

import re
from collections.abc import Callable, Mapping
from typing import Any

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
