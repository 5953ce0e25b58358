"""Instance labels (`weights_version: "42"`): what a registration may carry, checked the same way on both ends.

The bounds are the contract's (InstanceReport.labels): at most 16 labels, keys of at most 63 characters of
[A-Za-z0-9._/-] that start and end with a letter or digit, values of at most 256 printable characters. Labels are
echoed in every status report and watch message, so they stay small.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

MAX_LABELS = 16
MAX_LABEL_KEY_LENGTH = 63
MAX_LABEL_VALUE_LENGTH = 256
_LABEL_KEY = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._/-]*[A-Za-z0-9])?")


def label_problem(labels: Mapping[str, str]) -> str | None:
    """Why `labels` cannot be an instance's labels (naming the first bad label), or None when they can."""
    if len(labels) > MAX_LABELS:
        return f"{len(labels)} labels, more than the {MAX_LABELS} an instance may carry"
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            return f"label {key!r}: keys and values are text"
        shown = key if len(key) <= MAX_LABEL_KEY_LENGTH else f"{key[:MAX_LABEL_KEY_LENGTH]}..."
        if len(key) > MAX_LABEL_KEY_LENGTH:
            return f"label {shown!r}: the key is longer than {MAX_LABEL_KEY_LENGTH} characters"
        if not _LABEL_KEY.fullmatch(key):
            return (
                f"label {shown!r}: a key is letters, digits and . _ / - and starts and ends with a letter or digit"
            )
        if len(value) > MAX_LABEL_VALUE_LENGTH:
            return f"label {shown!r}: the value is longer than {MAX_LABEL_VALUE_LENGTH} characters"
        if not value.isprintable():
            return f"label {shown!r}: the value has a character that is not printable (a newline, a control)"
    return None
