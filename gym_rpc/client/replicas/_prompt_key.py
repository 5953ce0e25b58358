"""The prompt a model call starts from, as one 32-bit number: calls that share it share a prefix an engine may
still hold in its KV cache (the turns of one rollout, the rollouts of one GRPO group).

The prompt is what every turn of a conversation repeats unchanged at its start: the system text (the Responses
API's `instructions`, or the leading `system`/`developer` items) and the first user message. Later turns append
items after it; the rollouts of one group send the same one. A completions `prompt` string grows with the turns:
only its head counts. The number is the same in every process (no `hash()`, whose seed is per process), and
reading it costs what the text it reads costs: at most `HEAD` characters from the start of the prompt and `TAIL`
from its end (two prompts alike there and of one length are taken as one: they share a prefix, and the load bound
keeps their instance from being overloaded).

    text             = instructions (or ""), then NUL + the text of each system/developer item before the first
                       user message and of that message ("\0sys\0user"); a string `input` alone ("user", or
                       "instructions\0user")
    prompt_key(body) = crc32(UTF-8 of text, or of (its first HEAD characters + NUL + its last TAIL + NUL + its
                       length in decimal) when longer than HEAD + TAIL), or None
"""

from __future__ import annotations

import zlib
from typing import Any

HEAD = 256  # characters read from the prompt's start
TAIL = 256  # and from its end (the task text, after a system prompt the whole run shares)
_BOUND = HEAD + TAIL
_SCANNED = 8  # input items looked at for the first user message
_crc32 = zlib.crc32


def prompt_key(body: Any) -> int | None:
    """The number of the prompt a Responses, Chat Completions or Completions body starts from; None when it has
    none this can read (the call is then picked by its rollout, or by load alone).

    One pass, on every model call of a replicated server: no helper call in the common case (string contents),
    and the joined text is built once, then bounded."""
    if type(body) is not dict:
        return None
    items = body.get("input")
    if items is None:
        items = body.get("messages")
    instructions = body.get("instructions")
    if type(items) is list:
        # The system texts and the first user message, joined; None without a user message among the first
        # _SCANNED items (nothing a group of rollouts shares is readable).
        text = instructions if type(instructions) is str else ""
        for item in items if len(items) <= _SCANNED else items[:_SCANNED]:
            if type(item) is not dict:
                return None
            role = item.get("role")
            if role == "user":
                content = item.get("content")
                text = f"{text}\0{content if type(content) is str else _content_text(content)}"
                break
            if role == "system" or role == "developer":
                content = item.get("content")
                text = f"{text}\0{content if type(content) is str else _content_text(content)}"
        else:
            return None
        if len(text) > _BOUND:
            text = f"{text[:HEAD]}\0{text[-TAIL:]}\0{len(text)}"
    elif type(items) is str:
        text = items if not instructions else f"{instructions}\0{items}"
        if len(text) > _BOUND:
            text = f"{text[:HEAD]}\0{text[-TAIL:]}\0{len(text)}"
    else:
        prompt = body.get("prompt")
        if type(prompt) is not str or not prompt:
            return None
        text = prompt[:HEAD]  # it grows with the turns: its head only
    try:
        return _crc32(text.encode())
    except UnicodeEncodeError:  # a lone surrogate (JSON can carry one): kept, never raised on
        return _crc32(text.encode("utf-8", "surrogatepass"))


def _content_text(content: Any) -> str:
    """The text of a message's content parts ([{"type": "input_text", "text": ...}, ...]); "" for anything else."""
    if type(content) is list:
        texts = (part.get("text") for part in content if type(part) is dict)
        return "".join(text for text in texts if type(text) is str)
    return ""
