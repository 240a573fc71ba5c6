"""Keeps freed memory in the process's heap, so a model run's large arrays do not fault in
fresh pages every time.

glibc's malloc maps an allocation above ``M_MMAP_THRESHOLD`` (128 KiB at first) on its own and
unmaps it when freed, and gives the heap's free top back to the kernel above
``M_TRIM_THRESHOLD``. A generation step allocates and frees megabytes of arrays (the running
sequences' gathered KV cache, ONNX Runtime's outputs), so every step asked the kernel for
fresh pages again, and the kernel zeroes each 4 KiB page it hands out: with 11 sequences of
430 tokens, gathering the demo LM's cache took 4.5 ms a step, 0.33 ms with memory kept
(``bench/README.md``, "Generation: CPU per token"). ``keep_freed_memory`` raises both
thresholds once at start: allocations up to 32 MiB (glibc's largest threshold on 64-bit)
come from the heap, and up to ``keep_mib`` of freed heap stays mapped for the next step.

What it costs: the process's resident memory may stay up to ``keep_mib`` above what it uses
(the memory guard counts resident memory). ``--malloc-keep-mib 0`` leaves glibc's defaults.
Other C libraries (musl) are left alone.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc refuses more on 64-bit hosts
DEFAULT_KEEP_MIB = 64


def keep_freed_memory(keep_mib: int = DEFAULT_KEEP_MIB) -> bool:
    """Raises glibc's mmap and trim thresholds; False (and nothing changed) where it cannot."""
    if keep_mib <= 0:
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # musl has a mallopt that does nothing
        log.info("malloc thresholds left alone: not glibc")
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim = min(keep_mib << 20, 2**31 - 1)
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, trim)):
        log.warning("glibc refused the malloc thresholds; its defaults apply")
        return False
    log.info(
        "malloc keeps up to %d MiB freed; arrays up to %d MiB come from the heap",
        keep_mib,
        MMAP_THRESHOLD_BYTES >> 20,
    )
    return True
