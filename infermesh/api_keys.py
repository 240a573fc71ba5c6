"""API keys for the public listener: made here, stored hashed, sent as HTTP Basic.

A key is ``TENANT.KEYID:SECRET``. The control plane's key file (``listener.auth.api_keys_file``)
holds ``TENANT.KEYID:{SHA}BASE64(SHA-1(SECRET))`` only, the form Envoy's basic_auth filter
checks (``htpasswd -nbs TENANT.KEYID SECRET`` writes the same line). The secret is 256 random
bits, so an unsalted SHA-1 of it cannot be reversed or looked up; a secret a person chose
could be, which is why keys are only ever made here.

A client sends ``Authorization: Basic base64(TENANT.KEYID:SECRET)``: ``curl -u KEY``, or
``client_headers()`` for tritonclient's ``headers=``. The local mesh's key (``infermesh up``)
is ``.infermesh/api.key``; ``INFERMESH_API_KEY`` (the key itself) or
``INFERMESH_API_KEY_FILE`` take precedence.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
from pathlib import Path

from infermesh.secrets import STATE_DIR, SecretError, ensure_operator_credentials, read_secret

API_KEY_FILE = STATE_DIR / "api.key"  # the local tenant's key: TENANT.KEYID:SECRET (0600)
API_KEYS_FILE = STATE_DIR / "api-keys"  # what the control plane reads: hashes only (0600)
LOCAL_TENANT = "local"
TENANT = re.compile(r"[A-Za-z0-9_-]{1,64}")
KEY = re.compile(r"([A-Za-z0-9_-]{1,64})\.([A-Za-z0-9_-]{1,64}):(\S{16,})")
HEADER_COMMENT = (
    "# InferMesh API keys (listener.auth.api_keys_file): TENANT.KEYID:{SHA}BASE64(SHA-1(SECRET)).\n"
    "# Add one with `infermesh keys add TENANT`; remove a line to revoke its key.\n"
)


def hash_line(key_id: str, secret: str) -> str:
    digest = base64.b64encode(hashlib.sha1(secret.encode()).digest()).decode()
    return f"{key_id}:{{SHA}}{digest}"


def new_key(tenant: str) -> str:
    """A new ``TENANT.KEYID:SECRET``."""
    if not TENANT.fullmatch(tenant) or tenant == "other":
        raise SecretError(
            f"tenant {tenant!r}: expected letters, digits, '_' or '-' (at most 64), not 'other'"
        )
    return f"{tenant}.{secrets.token_hex(4)}:{secrets.token_urlsafe(32)}"


def add_key(keys_file: Path, key: str) -> str:
    """Appends ``key``'s hash line to ``keys_file`` (made 0600 if absent); its key id."""
    match = KEY.fullmatch(key)
    if match is None:
        raise SecretError("an API key must be TENANT.KEYID:SECRET (secret not shown)")
    key_id = f"{match[1]}.{match[2]}"
    keys_file.parent.mkdir(parents=True, exist_ok=True)
    fresh = not keys_file.exists()
    if not fresh and any(line.startswith(f"{key_id}:") for line in _lines(keys_file)):
        raise SecretError(f"{keys_file}: key id {key_id!r} is already there")
    fd = os.open(keys_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as out:
        if fresh:
            out.write(HEADER_COMMENT)
        out.write(hash_line(key_id, match[3]) + "\n")
    return key_id


def _lines(keys_file: Path) -> list[str]:
    return keys_file.read_text().splitlines(keepends=True) if keys_file.exists() else []


def revoke_key(keys_file: Path, key_id: str) -> bool:
    """Removes ``key_id``'s line; True if there was one. The file is replaced whole (a new
    file renamed over it), so the control plane never reads it half written."""
    lines = _lines(keys_file)
    kept = [line for line in lines if not line.strip().startswith(f"{key_id}:")]
    if len(kept) == len(lines):
        return False
    fresh = keys_file.with_name(f".{keys_file.name}.{secrets.token_hex(4)}")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("".join(kept))
    os.replace(fresh, keys_file)
    return True


def ensure_local_api_key(root: Path) -> list[Path]:
    """The local mesh's key (``.infermesh/api.key``) and its hash in ``.infermesh/api-keys``;
    the files it made. A present key file is left as it is."""
    key_path, keys_path = root / API_KEY_FILE, root / API_KEYS_FILE
    if key_path.exists():
        return []
    key = new_key(LOCAL_TENANT)
    key_path.parent.mkdir(parents=True, exist_ok=True)
    with open(key_path, "x", opener=lambda name, flags: os.open(name, flags, 0o600)) as out:
        out.write(key + "\n")
    add_key(keys_path, key)
    return [key_path, keys_path]


def ensure_local_credentials(root: Path) -> list[Path]:
    """Everything a local mesh under ``root`` reads (operator key, admin token, the API key
    and its hash); the files it made."""
    return ensure_operator_credentials(root) + ensure_local_api_key(root)


def client_key(root: Path | None = None) -> str | None:
    """The key a client sends: ``INFERMESH_API_KEY``, else the file
    ``INFERMESH_API_KEY_FILE``, else ``ROOT/.infermesh/api.key``; None when there is none."""
    if os.environ.get("INFERMESH_API_KEY"):
        return os.environ["INFERMESH_API_KEY"].strip()
    path = Path(os.environ.get("INFERMESH_API_KEY_FILE") or (root or Path.cwd()) / API_KEY_FILE)
    if not path.exists():
        return None
    return read_secret(path, "the API key")


def basic_authorization(key: str) -> str:
    return "Basic " + base64.b64encode(key.encode()).decode()


def client_headers(root: Path | None = None) -> dict[str, str]:
    """``{"authorization": "Basic ..."}`` for the client's key, or {} when it has none."""
    key = client_key(root)
    return {"authorization": basic_authorization(key)} if key else {}
