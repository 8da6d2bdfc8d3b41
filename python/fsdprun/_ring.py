"""The worker's flight recorder ring, written from Python.

Mirrors ``common/include/fsdp/common/flight_ring.hpp`` (version 3): the agent makes the ring (a
memfd) and hands its descriptor in ``FSDPRUN_FLIGHT_FD``; this process maps it and is its only
writer. Field offsets are the C++ structs' (``tests/unit/common/flight_ring_python_test.cpp``
checks both against each other). 8-byte aligned stores through the mapping are single stores on
the machines we run on, as the C++ side's relaxed atomics are.
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from typing import Optional

MAGIC = 0x31544C4650445346  # "FSDPFLT1"
VERSION = 3
HEADER_BYTES = 256
SLOT_BYTES = 192

# Header offsets (flight_ring.hpp, struct Header).
H_MAGIC, H_VERSION, H_CAPACITY, H_SLOT_BYTES, H_RANK, H_PID, H_ATTACHED = 0, 8, 12, 16, 20, 24, 32
H_ISSUED, H_PROGRESS_COUNT, H_PROGRESS_STEP, H_PROGRESS_NS, H_LONGEST_GAP = 40, 48, 56, 64, 72
H_LAST_COMPLETED, H_BUSY_SINCE, H_PROGRESS_WHAT = 80, 88, 96
H_STEPS, H_STEP_NS, H_WAIT_NS, H_DATA_NS = 120, 128, 136, 144
H_LAST_STEP_NS, H_LAST_WAIT_NS, H_LAST_DATA_NS, H_BYTES = 152, 160, 168, 176
H_SAMPLES, H_TOKENS, H_LAST_SAMPLES, H_LAST_TOKENS, H_LOSS, H_STRAGGLER = 184, 192, 200, 208, 216, 224
H_BUSY_WHAT = 232

# Slot offsets (struct Slot).
S_GENERATION, S_SEQ, S_COUNT, S_ISSUED, S_STARTED, S_COMPLETED = 0, 8, 16, 24, 32, 40
S_STATE, S_OP, S_GROUP_SIZE, S_GROUP_RANK, S_DTYPE, S_GROUP, S_TAG = 48, 49, 52, 56, 60, 72, 96

OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_BROADCAST, OP_BARRIER, OP_WAIT = 1, 2, 3, 4, 5, 6
STATE_ISSUED, STATE_COMPLETED, STATE_FAILED = 1, 2, 3


def now_ns() -> int:
    """CLOCK_REALTIME nanoseconds, the ring's clock."""
    return time.time_ns()


def _text(buf: mmap.mmap, offset: int, size: int, value: str) -> None:
    data = value.encode("utf-8", "replace")[: size - 1]
    buf[offset:offset + size] = data + b"\0" * (size - len(data))


class Ring:
    """A mapping of this worker's ring; every public method is thread-safe."""

    def __init__(self, fd: int):
        self._map = mmap.mmap(fd, HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        magic, version, capacity, slot_bytes = struct.unpack_from("<QIII", self._map, 0)
        if magic != MAGIC or version != VERSION or slot_bytes != SLOT_BYTES or capacity == 0:
            self._map.close()
            raise ValueError(f"not a flight recorder ring of version {VERSION} (magic {magic:#x}, "
                             f"version {version}, slot bytes {slot_bytes})")
        self._map.close()
        self.capacity = capacity
        self._map = mmap.mmap(fd, HEADER_BYTES + capacity * SLOT_BYTES, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        self._lock = threading.Lock()

    # -- header fields ---------------------------------------------------------------------
    def _i64(self, offset: int) -> int:
        return struct.unpack_from("<q", self._map, offset)[0]

    def _set_i64(self, offset: int, value: int) -> None:
        struct.pack_into("<q", self._map, offset, int(value))

    def _set_f64(self, offset: int, value: float) -> None:
        struct.pack_into("<d", self._map, offset, float(value))

    def attach(self, rank: int) -> None:
        """Marks the ring as this process's (the agent then judges its progress)."""
        with self._lock:
            struct.pack_into("<i", self._map, H_RANK, rank)
            self._set_i64(H_PID, os.getpid())
            self._set_i64(H_ATTACHED, now_ns())

    def mark_progress(self, step: int, what: str) -> None:
        with self._lock:
            now = now_ns()
            previous = self._i64(H_PROGRESS_NS)
            if previous != 0 and now - previous > self._i64(H_LONGEST_GAP):
                self._set_i64(H_LONGEST_GAP, now - previous)
            _text(self._map, H_PROGRESS_WHAT, 24, what)
            if step >= 0:
                self._set_i64(H_PROGRESS_STEP, step)
            self._set_i64(H_PROGRESS_NS, now)
            self._set_i64(H_PROGRESS_COUNT, self._i64(H_PROGRESS_COUNT) + 1)

    def publish_timing(self, t: dict) -> None:
        """The step split and throughput (Header version 3), as libfsdp publishes it."""
        with self._lock:
            for offset, key in ((H_STEP_NS, "step_ns"), (H_WAIT_NS, "wait_ns"), (H_DATA_NS, "data_ns"),
                                (H_LAST_STEP_NS, "last_step_ns"), (H_LAST_WAIT_NS, "last_wait_ns"),
                                (H_LAST_DATA_NS, "last_data_ns"), (H_SAMPLES, "samples"),
                                (H_TOKENS, "tokens"), (H_LAST_SAMPLES, "last_samples"),
                                (H_LAST_TOKENS, "last_tokens")):
                self._set_i64(offset, t[key])
            self._set_f64(H_LOSS, t["loss"])
            self._set_i64(H_STEPS, t["steps"])  # last: a reader that sees the count sees the rest

    def add_bytes(self, count: int) -> None:
        with self._lock:
            self._set_i64(H_BYTES, self._i64(H_BYTES) + count)

    # -- collectives -------------------------------------------------------------------------
    def _slot(self, index: int) -> int:
        return HEADER_BYTES + (index % self.capacity) * SLOT_BYTES

    def issue(self, group: str, group_size: int, group_rank: int, seq: int, op: int, count: int,
              dtype: str, tag: str) -> int:
        """A new record, issued and started now; returns its index."""
        with self._lock:
            index = struct.unpack_from("<Q", self._map, H_ISSUED)[0]
            base = self._slot(index)
            struct.pack_into("<Q", self._map, base + S_GENERATION, 2 * index + 1)
            now = now_ns()
            struct.pack_into("<QqqqqBB", self._map, base + S_SEQ, seq, count, now, now, 0, STATE_ISSUED, op)
            struct.pack_into("<II", self._map, base + S_GROUP_SIZE, max(group_size, 0), max(group_rank, 0))
            _text(self._map, base + S_DTYPE, 12, dtype)
            _text(self._map, base + S_GROUP, 24, group)
            _text(self._map, base + S_TAG, 48, tag)
            struct.pack_into("<Q", self._map, base + S_GENERATION, 2 * index + 2)
            struct.pack_into("<Q", self._map, H_ISSUED, index + 1)
            return index

    def complete(self, index: int, ok: bool = True) -> None:
        with self._lock:
            base = self._slot(index)
            if struct.unpack_from("<Q", self._map, base + S_GENERATION)[0] != 2 * index + 2:
                return  # reused since
            if self._map[base + S_STATE] != STATE_ISSUED:
                return
            now = now_ns()
            self._set_i64(base + S_COMPLETED, now)
            self._map[base + S_STATE] = STATE_COMPLETED if ok else STATE_FAILED
            if now > self._i64(H_LAST_COMPLETED):
                self._set_i64(H_LAST_COMPLETED, now)


def open_ring() -> Optional[Ring]:
    """This worker's ring (FSDPRUN_FLIGHT_FD), or None outside fsdprun or with the recorder off."""
    text = os.environ.get("FSDPRUN_FLIGHT_FD")
    if not text or os.environ.get("FSDPRUN_FLIGHT_RECORDER") == "0":
        return None
    try:
        return Ring(int(text))
    except (ValueError, OSError):
        return None
