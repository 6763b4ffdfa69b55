"""Large host blocks outside the allocator's arenas, so that a long run's anonymous memory stays flat.

On the CPU backend the "device" memory is this process's heap: the expert cache's slots, every program's
buffers, the transfers' blocks. glibc serves a block of up to 32 MiB from its arenas once a freed mapping has
raised its dynamic threshold (it rises to the largest block freed, and loading a checkpoint frees several), and
keeps what is freed there: the arenas' free space is never handed back when a long-lived block sits above it.
Blocks of a megabyte or so made and freed at every MoE layer by several threads (XLA's and the AsyncIO link's)
fragmented them, and the run's anonymous memory climbed batch after batch. A fixed threshold maps every block at
least that large on its own and returns it to the system when freed; smaller blocks stay in the arenas (their
churn is small and reused). Measured in README "Full-depth quantized models on a 24 GB machine".
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt option (malloc.h)
MAX_THRESHOLD = 32 * 2**20  # glibc refuses larger (HEAP_MAX_SIZE / 2 on 64-bit)


def glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc (the option exists nowhere else), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
        return libc
    except (OSError, AttributeError):
        return None


def map_large_blocks(threshold_kib: Optional[int]) -> bool:
    """Serve host blocks of at least `threshold_kib` KiB from their own mappings, returned to the system when freed
    (glibc's M_MMAP_THRESHOLD; it also stops the threshold from rising). None: the allocator's default. Returns
    whether it was set (False off glibc, where the option does not exist)."""
    if threshold_kib is None:
        return False
    if not 0 < threshold_kib * 1024 <= MAX_THRESHOLD:
        raise ValueError(f"offload.host_mmap_threshold_kib={threshold_kib}: expected 1 to {MAX_THRESHOLD // 1024} "
                         "(KiB), or null for the allocator's default")
    libc = glibc()
    if libc is None:
        log.info("offload.host_mmap_threshold_kib: not glibc, the allocator's default kept")
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold_kib * 1024)))
