"""System shared memory regions, Triton's extension: a client names a POSIX shared-memory
object (``tritonclient.utils.shared_memory``'s key, a file under /dev/shm), the server opens it
and reads inputs from it or writes outputs into it instead of carrying them in messages.

A region is a name, a key and a byte range of that object. Registering opens the object once
(no symlink followed, a regular file only, the range checked against its size). Inputs are
read and outputs written through the descriptor (``preadv``/``pwrite``), never through a
mapping: the client owns the object and may shrink it at any time, and a load or store in a
mapped page past its end is SIGBUS, which would kill the server. A read that comes up short
is refused instead. Every use counts, so that Unregister (or shutdown) closes a region's
descriptor only when no request still reads or writes it.

Keys are plain names: an optional leading '/' (as tritonclient writes them), then letters,
digits, '.', '_' or '-', never '.' or '..': nothing outside ``directory`` can be named.
Everything here runs on the event loop; a read is one system call and one copy (about 0.3 ms
for 4 MiB on the 2-core development host, against the message's decode of several ms).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from model_server.core.errors import InferenceError, InvalidInput

log = logging.getLogger(__name__)

SHM_DIRECTORY = Path("/dev/shm")
MAX_REGIONS = 256  # each holds a descriptor
_KEY = re.compile(r"/?([A-Za-z0-9._-]{1,255})")
_NAME_MAX = 255


class RegionNotFound(InferenceError):
    code = grpc.StatusCode.NOT_FOUND  # Triton's code for a region it does not know


class RegionExists(InferenceError):
    code = grpc.StatusCode.ALREADY_EXISTS  # Triton's code for a duplicate region name


@dataclass(frozen=True)
class RegionStatus:
    """What SystemSharedMemoryStatus reports of a region."""

    name: str
    key: str
    offset: int
    byte_size: int


def key_file(key: str) -> str:
    """The file name under /dev/shm that ``key`` stands for; InvalidInput for anything else."""
    match = _KEY.fullmatch(key)
    if match is None or match.group(1) in (".", ".."):
        raise InvalidInput(
            f"key {key!r}: expected a POSIX shared-memory name, an optional leading '/' then "
            "1-255 letters, digits, '.', '_' or '-' (not '.' or '..'): a plain name under "
            f"{SHM_DIRECTORY}"
        )
    return match.group(1)


def check_region_name(name: str, field: str = "name") -> None:
    if not name or len(name) > _NAME_MAX or not name.isprintable():
        raise InvalidInput(
            f"{field} {name[:64]!r}: expected a region name of 1-{_NAME_MAX} printable characters"
        )


class Region:
    """One registered range of a shared-memory object, open."""

    def __init__(self, status: RegionStatus, fd: int) -> None:
        self.status = status
        self._fd = fd
        self.users = 0  # requests holding it now
        self.retired = False  # unregistered: closed once unused

    def span(self, offset: int, byte_size: int, where: str) -> tuple[int, int]:
        """[start, end) in the object of ``byte_size`` bytes at ``offset`` into the region."""
        size = self.status.byte_size
        if offset + byte_size > size:
            raise InvalidInput(
                f"{where}: shared_memory_offset {offset} + shared_memory_byte_size {byte_size} "
                f"= {offset + byte_size} is beyond region {self.status.name!r} "
                f"({size} bytes)"
            )
        start = self.status.offset + offset
        return start, start + byte_size

    def read(self, start: int, end: int) -> memoryview:
        """A read-only copy of the object's bytes [start, end), read through the descriptor:
        a client that shrank the object gets FAILED_PRECONDITION, never a SIGBUS."""
        data = np.empty(end - start, np.uint8)
        view, at = data.data, start
        while view:
            got = os.preadv(self._fd, [view], at)
            if got == 0:
                raise self._shrank(at)
            view, at = view[got:], at + got
        return data.data.toreadonly()

    def write(self, start: int, data: bytes) -> None:
        """Writes an output at ``start``, through the descriptor: a store into a mapped page
        past the end of an object the client shrank would be SIGBUS; ``pwrite`` grows it."""
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd, view, start)
            view, start = view[written:], start + written

    def _shrank(self, at: int) -> InferenceError:
        return InferenceError(
            f"region {self.status.name!r}: key {self.status.key!r} ends at {at} bytes, "
            f"shorter than when it was registered (the region needs "
            f"{self.status.offset + self.status.byte_size}); register it again",
            grpc.StatusCode.FAILED_PRECONDITION,
        )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class SharedMemoryRegistry:
    """The server's system shared-memory regions, by name."""

    def __init__(self, directory: Path = SHM_DIRECTORY, max_regions: int = MAX_REGIONS) -> None:
        self.directory = directory
        self.max_regions = max_regions
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> RegionStatus:
        check_region_name(name)
        if name in self._regions:
            raise RegionExists(f"shared memory region {name!r} is already registered")
        if len(self._regions) >= self.max_regions:
            raise InferenceError(
                f"{self.max_regions} shared memory regions are registered, the most this server "
                "holds; unregister some first",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        file = key_file(key)
        if byte_size <= 0 or offset < 0:
            raise InvalidInput(
                f"region {name!r}: expected byte_size > 0 and offset >= 0, got byte_size "
                f"{byte_size}, offset {offset}"
            )
        fd = _open(self.directory / file, f"region {name!r}: key {key!r}")
        try:
            _check_size(fd, f"region {name!r}: key {key!r}", offset, byte_size)
        except BaseException:
            os.close(fd)
            raise
        status = RegionStatus(name, key, offset, byte_size)
        self._regions[name] = Region(status, fd)
        log.info("system shared memory %r registered: key %r, %d bytes at %d", name, key,
                 byte_size, offset)  # fmt: skip
        return status

    def unregister(self, name: str) -> None:
        """Unregisters ``name`` (every region when empty); an unknown name is no error, as in
        Triton. A region in use is closed when its last request ends."""
        names = [name] if name else list(self._regions)
        for each in names:
            region = self._regions.pop(each, None)
            if region is None:
                continue
            region.retired = True
            if region.users == 0:
                region.close()
            log.info("system shared memory %r unregistered", each)

    def status(self, name: str) -> list[RegionStatus]:
        if not name:
            return [r.status for _, r in sorted(self._regions.items())]
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"no system shared memory region {name!r} is registered")
        return [region.status]

    def get(self, name: str, where: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            known = sorted(self._regions)[:8]
            raise RegionNotFound(
                f"{where}: parameters['shared_memory_region'] names {name[:64]!r}, which is not "
                f"registered (registered: {known or 'none'})"
            )
        return region

    def hold(self, regions: list[Region]) -> Callable[[], None]:
        """Holds ``regions`` for one request (none is closed before it ends); the call
        returned releases them, once."""
        for region in regions:
            region.users += 1
        pending = [regions]

        def release() -> None:
            for region in pending.pop() if pending else ():
                region.users -= 1
                if region.retired and region.users == 0:
                    region.close()

        return release

    def close(self) -> None:
        """Closes every region (shutdown); one a request still holds closes when it ends."""
        self.unregister("")

    def __len__(self) -> int:
        return len(self._regions)


def _open(path: Path, where: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        why = {
            errno.ENOENT: f"no such shared-memory object in {path.parent}",
            errno.ELOOP: "a symbolic link, which is never followed",
            errno.EACCES: "the server may not read and write it",
        }.get(exc.errno or 0, exc.strerror or "cannot be opened")
        raise InvalidInput(f"{where}: {why}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise InvalidInput(f"{where}: not a shared-memory object (not a regular file)")
    return fd


def _check_size(fd: int, where: str, offset: int, byte_size: int) -> None:
    size = os.fstat(fd).st_size
    if offset + byte_size > size:
        raise InvalidInput(
            f"{where}: offset {offset} + byte_size {byte_size} = {offset + byte_size} is beyond "
            f"the object's {size} bytes"
        )
