"""Credentials read from files, never from command lines (``ps`` shows those) or logs.

One syntax everywhere a header carries a shared credential: ``HEADER=@FILE``. The model
server's ``--restricted-api`` and the control plane's ``--model-server-credential`` take it,
so an operator writes the same thing on both sides of the call.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

MIN_GENERATED_BYTES = 32


class SecretError(ValueError):
    """A credential that cannot be used; the message names the file, never the content."""


def read_secret(path: Path, what: str, min_length: int = 1) -> str:
    """The one-line secret in ``path`` (surrounding whitespace dropped)."""
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise SecretError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if not value:
        raise SecretError(f"{what}: {path} is empty")
    if len(value) < min_length or any(c.isspace() for c in value):
        raise SecretError(f"{what}: {path} must hold one token of at least {min_length} characters")
    return value


def split_header_secret(text: str, what: str) -> tuple[str, Path]:
    """``HEADER=@FILE`` -> (header in lower case, FILE), the syntax only: nothing is read."""
    header, eq, source = text.partition("=")
    header = header.strip().lower()
    if not eq or not header:
        raise SecretError(f"{what}: expected HEADER=@FILE, got {header or text!r}")
    if not source.startswith("@") or len(source) < 2:
        raise SecretError(
            f"{what}: the credential for header {header!r} must come from a file: "
            "HEADER=@FILE (a value on the command line shows in process listings)"
        )
    return header, Path(source[1:])


def parse_header_secret(text: str, what: str) -> tuple[str, str]:
    """``HEADER=@FILE`` -> (header in lower case, the credential in FILE)."""
    header, path = split_header_secret(text, what)
    return header, read_secret(path, what)


def ensure_secret_file(path: Path) -> bool:
    """Creates ``path`` with a new random token (mode 0600) if absent; True if it made one."""
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(MIN_GENERATED_BYTES)
    with open(path, "x", opener=lambda name, flags: os.open(name, flags, 0o600)) as out:
        out.write(token + "\n")
    return True


# --- the local mesh's credentials (``infermesh up``, compose.yaml) ------------------------------

STATE_DIR = Path(".infermesh")
OPERATOR_KEY_FILE = STATE_DIR / "operator.key"
ADMIN_TOKEN_FILE = STATE_DIR / "admin.token"  # the control planes' admin write token


def ensure_operator_credentials(root: Path) -> list[Path]:
    """The operator key and admin token of a local mesh under ``root``; the files it made
    (``infermesh.api_keys.ensure_local_credentials`` adds the client's API key)."""
    made = []
    for relative in (OPERATOR_KEY_FILE, ADMIN_TOKEN_FILE):
        if ensure_secret_file(root / relative):
            made.append(root / relative)
    return made
