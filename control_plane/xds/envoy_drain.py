"""Envoy with a graceful stop: ``bootstrap --run --drain-on-stop SECONDS``.

Envoy exits at once on SIGTERM, resetting every stream in flight. Kubernetes drains it from a
preStop hook (deploy/kubernetes/envoy.yaml); a container engine has no such hook, so under
``docker compose stop`` (compose.private.yaml) this process runs Envoy as its child and, on
the first SIGTERM or SIGINT:

1. asks Envoy to drain its listeners (``POST /drain_listeners?graceful``: with
   ``--drain-strategy immediate`` every client gets HTTP/2 GOAWAY or ``connection: close`` at
   once, and the listeners close after ``--drain-time-s``), so requests in flight finish and
   clients reconnect elsewhere;
2. waits until Envoy holds no client connection, or ``SECONDS`` have passed;
3. stops Envoy with SIGTERM (SIGKILL if it has not exited 10 s later) and exits with its code.

A second signal stops Envoy at once. If Envoy exits on its own, so does this process, with
its code. Envoy gets SIGKILL from the kernel if this process dies (``infermesh.pdeathsig``).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence

from infermesh.pdeathsig import guarded

log = logging.getLogger(__name__)
KILL_AFTER_S = 10.0  # after the SIGTERM that ends the drain
POLL_S = 0.2


def run_draining(command: Sequence[str], admin_port: int, drain_s: float) -> int:
    """Runs ``command`` (Envoy) until it exits; a stop signal drains it first (above)."""
    envoy = subprocess.Popen(guarded(command, signal.SIGKILL))
    asked = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if asked.is_set():  # a second signal: no more waiting
            envoy.send_signal(signal.SIGTERM)
        asked.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    while envoy.poll() is None and not asked.wait(POLL_S):
        pass
    if envoy.poll() is None:
        _drain(envoy, admin_port, drain_s)
    try:
        return envoy.wait(KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        envoy.kill()
        return envoy.wait()


def _drain(envoy: subprocess.Popen[bytes], admin_port: int, drain_s: float) -> None:
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        request = urllib.request.Request(f"{admin}/drain_listeners?graceful", method="POST")
        urllib.request.urlopen(request, timeout=5).close()
    except OSError as exc:  # Envoy not answering: nothing to drain through it
        log.warning("Envoy's admin did not take the drain (%s): stopping it", exc)
    else:
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and envoy.poll() is None:
            if client_connections(admin) in (0, None):  # all gone, or the admin with them
                break
            time.sleep(POLL_S)
    if envoy.poll() is None:
        envoy.send_signal(signal.SIGTERM)


def client_connections(admin: str) -> int | None:
    """Connections Envoy's listeners hold from clients (its admin's own left out); None when
    the admin does not answer."""
    try:
        with urllib.request.urlopen(f"{admin}/stats?filter=downstream_cx_active", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith("listener.") and not name.startswith("listener.admin."):
            total += int(value) if value.strip().isdigit() else 0
    return total
