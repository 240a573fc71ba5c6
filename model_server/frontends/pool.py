"""The shared-memory pool a front end's tensors cross to the engine in.

Each front end creates one file in the private directory (0600, in a 0700 directory on tmpfs
when /dev/shm exists), reserves its pages (``posix_fallocate``: a full tmpfs fails the start,
never a later write with SIGBUS) and maps it; the engine maps the same file when the front end
says hello, then unlinks it, so the memory goes with the last of the two mappings, even when a
process is killed.

A request takes one slot: its inputs end to end, then room for its outputs. ``SlotAllocator``
hands out page-aligned ranges first-fit; a request that does not fit carries its tensors in
the message instead (slower for large tensors, never refused).
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
from pathlib import Path

PAGE = 4096
DEFAULT_POOL_BYTES = 16 * 1024 * 1024
MIN_OUTPUT_ROOM = PAGE


def round_up(size: int, unit: int = PAGE) -> int:
    return -(-size // unit) * unit


def slot_bytes(input_bytes: int) -> int:
    """A slot for ``input_bytes`` of inputs: those, then as much again for the outputs."""
    room = round_up(input_bytes)
    return room + max(room, MIN_OUTPUT_ROOM)


def write_parts(mapping: mmap.mmap, start: int, parts: list[bytes]) -> tuple[int, ...]:
    """Writes ``parts`` end to end from ``start``; their lengths."""
    at = start
    for part in parts:
        mapping[at : at + len(part)] = part
        at += len(part)
    return tuple(len(part) for part in parts)


class SlotAllocator:
    """First-fit, page-aligned ranges of ``size`` bytes; freed neighbours merge."""

    def __init__(self, size: int) -> None:
        self.size = size - size % PAGE
        self._starts: list[int] = [0] if self.size else []  # free runs, sorted by start
        self._lengths: dict[int, int] = {0: self.size} if self.size else {}
        self._taken: dict[int, int] = {}

    def allocate(self, size: int) -> int | None:
        need = round_up(max(size, 1))
        for index, start in enumerate(self._starts):
            length = self._lengths[start]
            if length < need:
                continue
            del self._lengths[start]
            if length == need:
                del self._starts[index]
            else:
                self._starts[index] = start + need
                self._lengths[start + need] = length - need
            self._taken[start] = need
            return start
        return None

    def free(self, start: int) -> None:
        length = self._taken.pop(start)
        index = bisect.bisect_left(self._starts, start)
        after = start + length
        if index < len(self._starts) and self._starts[index] == after:  # merge with the next
            length += self._lengths.pop(after)
            del self._starts[index]
        if index > 0:  # merge with the previous
            before = self._starts[index - 1]
            if before + self._lengths[before] == start:
                self._lengths[before] += length
                return
        self._starts.insert(index, start)
        self._lengths[start] = length

    @property
    def free_bytes(self) -> int:
        return sum(self._lengths.values())

    @property
    def taken(self) -> int:
        return len(self._taken)


class FrontendPool:
    """The front end's side: creates, reserves and maps the pool file."""

    def __init__(self, directory: Path, name: str, size: int) -> None:
        self.path = directory / name
        self.size = round_up(size)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)
            self.mapping = mmap.mmap(fd, self.size, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.buffer = memoryview(self.mapping)
        self.slots = SlotAllocator(self.size)

    def put(self, start: int, parts: list[bytes]) -> tuple[int, ...]:
        """Writes ``parts`` end to end from ``start``; their lengths."""
        return write_parts(self.mapping, start, parts)

    def take(self, start: int, lengths: tuple[int, ...]) -> list[bytes]:
        """Copies out ``lengths`` bytes laid end to end from ``start``."""
        out, at = [], start
        for length in lengths:
            out.append(bytes(self.buffer[at : at + length]))
            at += length
        return out

    def close(self) -> None:
        self.buffer.release()
        with contextlib.suppress(BufferError):
            self.mapping.close()
        self.path.unlink(missing_ok=True)  # normally gone: the engine unlinks it once mapped


class EnginePool:
    """The engine's side: one front end's pool, mapped by name, then unlinked."""

    def __init__(self, directory: Path, name: str, size: int) -> None:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"pool file {name!r}: expected a plain name")
        path = directory / name
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < size:
                raise ValueError(f"pool file {name!r} is smaller than the {size} bytes announced")
            self.mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        self.size = size

    def views(self, start: int, length: int, lengths: tuple[int, ...]) -> list[memoryview]:
        """Read-only views of the inputs laid end to end in the slot ``[start, start+length)``."""
        if start < 0 or start + length > self.size or sum(lengths) > length:
            raise ValueError(f"slot [{start}, {start + length}) is outside the pool")
        whole = memoryview(self.mapping)
        out, at = [], start
        for size in lengths:
            out.append(whole[at : at + size].toreadonly())
            at += size
        whole.release()
        return out

    def write(self, start: int, parts: list[bytes]) -> tuple[int, ...]:
        return write_parts(self.mapping, start, parts)

    def close(self) -> bool:
        """Unmaps; False while a view is still alive."""
        try:
            self.mapping.close()
        except BufferError:
            return False
        return True
