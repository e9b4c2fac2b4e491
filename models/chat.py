"""Token ids that continue a multi-turn episode with one more message, as its chat template would.

An episode is token ids end to end: the prompt comes from the chat template, each assistant turn is
exactly what the sampler produced, and every tool / environment message is appended as the ids of
the template's rendering of *that message alone*: the delta that follows the assistant's turn and
ends with the next assistant turn's generation prompt. Re-rendering the whole conversation instead
would rewrite earlier turns (Qwen3 drops `<think>` blocks of turns before the last user query and
normalises the whitespace around them; Llama 3 trims contents), so the learner would train on ids
the sampler never saw.

How the delta is found: the template renders a fixed dummy conversation [user, assistant, message]
and we take the text after the assistant's content (located by a marker string), i.e. the template's
own closing of the assistant turn, the message and the generation prompt. Whatever the dummy turns
render as (Qwen3's empty `<think>` insertion, Llama 3's date header) lies before the split point, so
it cannot leak into the delta. The message is rendered with its real content on every call rather
than cached as a prefix/suffix around it: templates transform contents (Llama 3 writes a tool
result through `tojson`, so a string arrives quoted and escaped).

Text is split, ids are not: the delta is the encoding of the delta text, right only when no BPE
merge crosses the split. A split right after or before a special token (<|im_end|>, <|eot_id|>) is
safe by construction: tokenizers cut text at special tokens before pre-tokenising. Where a delta
starts with plain text after the sampled text (a template without end-of-turn token),
`message_delta_ids` tokenises its first characters after the dummy's content and after typical
endings of sampled text, and raises UnstableDeltaError when any of them merges across. The checks
cost less than encoding the delta, so nothing is cached.

Message contents are data (`models/tokenizer.py`): the template renders them escaped
(`Tokenizer.render_chat`) and the delta is encoded with `encode_rendered`, so a tool result that
prints "<|im_end|>" gets the ids of that text while the template's own markup around it gets its
special ids; for contents without special-token strings the ids are those of the rendering.

`turn_closed` says whether the sampled turn already ends with the template's end-of-turn token
(`end_of_turn_id`): True when the model stopped on it, False when it stopped on something else
(e.g. `</tool_call>`, a stop id that is not the end-of-turn token), and then the delta first closes
the assistant turn exactly as the template would. Text the template puts after the end-of-turn
token (Qwen's "\n" after <|im_end|>) always belongs to the delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from models.tokenizer import CharTokenizer, Tokenizer

# Plain ASCII without surrounding whitespace: no template trims, splits or escapes it.
_USER = "chatdeltauser"
_ASSISTANT = "chatdeltaassistant"
# Typical last characters of a sampled turn: letters, digits, punctuation, spaces, newlines,
# markup. A delta whose first characters merge with any of them is unstable.
_PROBE_ENDINGS = ("x", "7", ".", "}", " ", "\n", "\n\n", ">", "</tool_call>", "'")
_HEAD_CHARS = 64  # how much of a delta the stability check tokenises after each ending


class UnstableDeltaError(ValueError):
    """The ids of a delta depend on the text before it (a BPE merge across the split)."""


def _as_messages(message: Mapping | Sequence[Mapping]) -> list[dict]:
    msgs = [message] if isinstance(message, Mapping) else list(message)
    if not msgs:
        raise ValueError("message_delta_ids needs at least one message")
    for m in msgs:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"a message is a dict with 'role' and 'content', got {m!r}")
    return [dict(m) for m in msgs]


def _after_assistant(
    tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict
) -> tuple[str, int]:
    """The rendering of [user, assistant, *messages], message contents escaped
    (`Tokenizer.render_chat`), and the index just after the assistant's content in it."""
    dummy = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    text = tokenizer.render_chat(
        dummy + messages, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    i = text.find(_ASSISTANT)
    if i < 0:
        raise ValueError(
            "the chat template does not render an assistant message's content verbatim "
            f"({_ASSISTANT!r} is missing from {text!r}); its deltas cannot be found"
        )
    return text, i + len(_ASSISTANT)


def _end_of_turn(tokenizer: Tokenizer, template_kwargs: dict) -> tuple[int, str] | None:
    """(id, text) of the special token the template closes an assistant turn with, or None."""
    text, cut = _after_assistant(tokenizer, [], False, template_kwargs)
    closing = text[cut:]
    if not closing:
        return None
    first = tokenizer.encode_rendered(closing)[0]  # the template's markup alone
    token_text = tokenizer.decode([first], skip_special=False)
    if not closing.startswith(token_text) or not _is_special(tokenizer, first):
        return None
    return first, token_text


def end_of_turn_id(tokenizer: Tokenizer, **template_kwargs: Any) -> int | None:
    """The id of the special token the chat template closes an assistant message with
    (<|im_end|> for Qwen, <|eot_id|> for Llama 3), or None when it closes with none (CharTokenizer,
    templates that put nothing or plain text after the content).

    An episode's turn is closed (`turn_closed=True`) when its last sampled id is this one. Other
    stop ids (a tool-call close, a second EOS such as <|endoftext|>) leave it open: the delta then
    closes the turn itself, after the stop token. One exception is the caller's to make: a stop id
    that ends a turn in the model's own format, such as Llama 3.1's <|eom_id|> after a tool call
    (Meta's format continues it directly with the ipython header, which the template cannot
    render), should count as closed, else the delta adds <|eot_id|> after it.
    """
    if isinstance(tokenizer, CharTokenizer):
        return None
    eot = _end_of_turn(tokenizer, template_kwargs)
    return None if eot is None else eot[0]


def _is_special(tokenizer: Tokenizer, token_id: int) -> bool:
    # Special tokens are the ones decode drops. The tokenizer cuts text at them before any
    # pre-tokenisation, so no merge crosses them and the model can stop on them.
    return tokenizer.decode([token_id], skip_special=True) == ""


def _check_stable(tokenizer: Tokenizer, before: Sequence[str], delta_text: str):
    """Raises unless `delta_text` tokenises the same after each text of `before` as alone."""
    ids = tokenizer.encode_rendered(delta_text)
    for text in before:
        if tokenizer.encode_rendered(text + delta_text) != tokenizer.encode_rendered(text) + ids:
            raise UnstableDeltaError(
                f"the chat template's delta {delta_text[:40]!r} tokenises differently after "
                f"{text[-20:]!r} than alone (a BPE merge crosses the split), so its ids would "
                "not be the template's: this template cannot be continued token-exactly"
            )


def message_delta_ids(
    tokenizer: Tokenizer,
    message: Mapping | Sequence[Mapping],
    *,
    turn_closed: bool,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Ids to append after a finished assistant turn: the template's closing of that turn (unless
    `turn_closed`), then `message` ({"role": "tool" | "user" | ..., "content": str}; or a list of
    messages, e.g. several tool results in a row) as the template renders it after an assistant
    turn, then the next assistant turn's generation prompt (unless `add_generation_prompt=False`).

    `turn_closed`: whether the sampled ids already end with `end_of_turn_id(tokenizer)`.
    `template_kwargs` are template variables, as for `apply_chat_template` (Qwen3's
    `enable_thinking=False`, Llama 3's `date_string`); pass the ones the prompt was rendered with.

    Contents are encoded as text: their special-token strings never become special ids (unless
    a content is `models.tokenizer.Trusted`). CharTokenizer (whose template concatenates
    contents) gets the encoded contents, whatever `turn_closed`. Raises UnstableDeltaError when
    the ids of the delta would depend on the sampled text before it.
    """
    messages = _as_messages(message)
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode_chat(messages)
    text, cut = _after_assistant(tokenizer, messages, add_generation_prompt, template_kwargs)
    if turn_closed:
        eot = _end_of_turn(tokenizer, template_kwargs)
        if eot is None:
            raise ValueError(
                "turn_closed=True, but the chat template closes an assistant message with no "
                f"special token (it renders {text[cut : cut + 40]!r} after the content), so a "
                "sampled turn cannot end with it: pass turn_closed=False"
            )
        eot_text = eot[1]
        if not text.startswith(eot_text, cut):
            raise ValueError(
                f"the chat template closes a final assistant message with {eot_text!r} but "
                f"renders {text[cut : cut + 40]!r} after one that {messages[0]['role']!r} follows"
            )
        cut += len(eot_text)  # after a special token: stable whatever follows
    delta = text[cut:]
    ids = tokenizer.encode_rendered(delta)
    if not turn_closed and ids and not _is_special(tokenizer, ids[0]):
        # The delta starts with plain text right after the sampled text. Merges happen within a
        # pre-token, and the pre-tokens after the first one that starts inside the delta line up
        # whatever precedes it, so the delta's first characters decide: check them after the
        # dummy's assistant content and after typical endings of sampled text.
        head = delta[:_HEAD_CHARS]
        _check_stable(tokenizer, [text[:cut], *_PROBE_ENDINGS], head)
    return ids
