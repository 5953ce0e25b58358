"""Config documents for tests: a head's document and its server entries, as `GlobalConfig.from_document` takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.support.loopback import LOOPBACK


def server_entry(port: int, server_type: str = "responses_api_models", host: str = LOOPBACK, **extra: Any) -> dict:
    """`{server_type: {impl: {host, port, ...}}}` for a config document."""
    return {server_type: {f"{server_type}_impl": {"host": host, "port": port, **extra}}}


def document(servers: dict[str, dict], **global_keys: Any) -> dict[str, Any]:
    return {"head_server": {"host": LOOPBACK, "port": 0}, **servers, **global_keys}


# 9 levels of 9 aliases: 9**9 = 387 million strings once expanded, from 350 bytes of text.
BILLION_LAUGHS = "".join(
    f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * 9) if level else ', '.join(['lol'] * 9)}]\n"
    for level in range(9)
)


def write_config(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path
