"""Secret redaction: which keys look secret, and copies of documents and text with their values replaced.

The head serves a redacted document to callers without the token, and every repr and log line of a config goes
through here, so an API key never reaches a caller or a log that should not see it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
SECRET_KEY_MARKERS = (
    "api_key",
    "apikey",
    "token",
    "secret",
    "secrets",
    "password",
    "authorization",
    "credential",
    "credentials",
    "private_key",
    "passwd",
    "passphrase",
    "auth",
    "jwt",
    "access_key",
)


def configured_token(value: str | None) -> str | None:
    """A usable token: neither empty nor the placeholder a redacted config carries."""
    if value is None:
        return None
    value = value.strip()
    return value if value and value != REDACTED else None


def is_secret_key(key: str) -> bool:
    """A marker must stand as whole words (`hf_token`, `apiKey`, `DB_PASSWORD`): `max_tokens` or `tokenizer`
    hold ordinary settings that must reach clients unredacted."""
    words = "_".join(re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", key)).lower()
    return any(re.search(rf"(?:^|_){marker}(?:_|$)", words) for marker in SECRET_KEY_MARKERS)


def redact_secrets(value: Any) -> Any:
    """A copy of a JSON-like value with the values of secret-looking keys replaced. Booleans, numbers and nulls
    are no secrets and stay (NeMo Gym's `return_token_id_information: false` must not become a truthy string)."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_key(k) and may_be_secret(v) else redact_secrets(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    if isinstance(value, str):
        return redact_secret_text(value)
    return value


# `scheme://USERINFO@host`: greedy up to the last "@" before the path, since passwords may hold an unescaped "@".
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
# `NAME=value` inside text: `env: ["OPENAI_API_KEY=sk-..."]`, a query string, a `--api-key=...` flag.
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_-])(?P<name>[A-Za-z0-9_-]+)=(?P<value>[^\s&;,]+)")


def redact_secret_text(text: str) -> str:
    """`text` with URL userinfo (`postgres://user:PW@db`) and the values of secret-named `NAME=value` pairs
    replaced: secrets hide inside strings under ordinary keys (a DSN, a command line, an `env:` list)."""
    if "@" in text:
        text = _URL_USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
    if "=" in text:
        text = _ASSIGNMENT.sub(lambda m: f"{m['name']}={REDACTED}" if is_secret_key(m["name"]) else m[0], text)
    return text


def may_be_secret(value: Any) -> bool:
    return not (value is None or isinstance(value, bool | int | float))
