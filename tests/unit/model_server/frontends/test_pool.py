"""The shared-memory pool: the slot allocator's first fit and merging, and the two mappings of
one file (the front end's and the engine's) seeing the same bytes, the file unlinked once
both hold it, in a 0700 directory."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from model_server.frontends.pool import (
    PAGE,
    EnginePool,
    FrontendPool,
    SlotAllocator,
    round_up,
    slot_bytes,
)
from model_server.frontends.private import PrivateDirectory, reserve_port
from tests.support import ROOT


def test_slots_are_page_aligned_first_fit_and_merge_when_freed() -> None:
    slots = SlotAllocator(10 * PAGE)
    a = slots.allocate(1)
    b = slots.allocate(PAGE + 1)
    c = slots.allocate(3 * PAGE)
    assert (a, b, c) == (0, PAGE, 3 * PAGE)
    assert a is not None and b is not None and c is not None
    assert slots.allocate(5 * PAGE) is None  # 4 pages left
    slots.free(b)
    assert slots.allocate(2 * PAGE) == PAGE  # the hole, first fit
    slots.free(PAGE)
    slots.free(a)
    slots.free(c)
    assert slots.free_bytes == 10 * PAGE and slots.taken == 0
    assert slots.allocate(10 * PAGE) == 0  # every run merged back into one


def test_slot_sizes() -> None:
    assert round_up(1) == PAGE and round_up(PAGE) == PAGE
    assert slot_bytes(12288) == 2 * 12288
    assert slot_bytes(10) == 2 * PAGE


def test_both_sides_see_the_same_bytes(tmp_path: Path) -> None:
    front = FrontendPool(tmp_path, "pool-0-1", 4 * PAGE)
    assert stat.S_IMODE(front.path.stat().st_mode) == 0o600
    engine = EnginePool(tmp_path, "pool-0-1", front.size)
    assert not front.path.exists()  # unlinked: the memory lives in the two mappings only
    assert front.put(PAGE, [b"abc", b"defg"]) == (3, 4)
    views = engine.views(PAGE, 2 * PAGE, (3, 4))
    assert [bytes(v) for v in views] == [b"abc", b"defg"]
    assert views[0].readonly
    engine.write(2 * PAGE, [b"out", b"put!"])
    assert front.take(2 * PAGE, (3, 4)) == [b"out", b"put!"]
    assert not engine.close()  # a view is alive
    for view in views:
        view.release()
    assert engine.close()
    front.close()


def test_engine_refuses_slots_outside_and_odd_names(tmp_path: Path) -> None:
    front = FrontendPool(tmp_path, "pool", 2 * PAGE)
    engine = EnginePool(tmp_path, "pool", front.size)
    with pytest.raises(ValueError, match="outside the pool"):
        engine.views(PAGE, 2 * PAGE, (1,))
    with pytest.raises(ValueError, match="outside the pool"):
        engine.views(0, PAGE, (PAGE, 1))
    with pytest.raises(ValueError, match="plain name"):
        EnginePool(tmp_path, "../etc", PAGE)
    engine.close()
    front.close()


def test_private_directory_is_the_users_alone() -> None:
    private = PrivateDirectory.create()
    try:
        info = private.path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        assert private.grpc_socket.parent == private.path
    finally:
        private.remove()
    assert not private.path.exists()


def test_reserved_port_takes_no_connections_and_admits_reuseport_listeners() -> None:
    held, port = reserve_port("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        listener.close()
        plain = socket.socket()  # a socket without SO_REUSEPORT cannot take the port
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        plain.close()
    finally:
        held.close()


def test_the_front_end_imports_no_onnx_runtime() -> None:
    code = (
        "import sys, model_server.frontends.frontend;"
        "print(sorted(m for m in sys.modules if m.startswith(('onnx', 'model_server.lifecycle',"
        " 'model_server.server'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"
