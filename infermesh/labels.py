"""What a routing label may look like, for the model server that reports labels and the
control plane that reads them from its topology (one rule, so both accept the same)."""

from __future__ import annotations

import re

# Like a Kubernetes label value: letters and digits at both ends, '_', '.', '-' between.
_LABEL_TEXT = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
LABEL_TEXT_RULE = "letters, digits, '_', '.', '-'"


def is_label_text(value: object) -> bool:
    """Whether ``value`` may be a label name or value."""
    return isinstance(value, str) and _LABEL_TEXT.fullmatch(value) is not None
