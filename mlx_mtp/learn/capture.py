"""Served requests kept to adapt the drafter to (`Engine(learn_dir=...)`, `mlx-mtp-server --learn-dir`).

Opt-in: nothing is kept without a directory. A kept request is its token ids (the prompt, then the
target's reply) and the drafter's counts on it (rounds, drafted, accepted), nothing else: no text, no
metadata. `mlx_mtp.learn` reads them.

Files. Each process appends to segment files of its own (`c-<time>-<pid>-<random>.bin`, a new one
past SEGMENT_BYTES), so several processes append to one directory without a lock. A record is a
header (magic, lengths, counts, time) and the ids, followed by a CRC-32 of both: a record torn by a
crash mid-write fails its check, and a reader stops reading that file there, with one warning per
file; every whole record before it is read. The byte budget removes the oldest segments first
(another process's too): the newest traffic is what is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"MTPc"
HEADER = struct.Struct("<4sIIIIId")  # magic, prompt ids, reply ids, rounds, drafted, accepted, time
CRC = struct.Struct("<I")
SEGMENT_BYTES = 64 << 20
PATTERN = "c-*.bin"


@dataclasses.dataclass(frozen=True)
class Record:
    prompt: np.ndarray  # int32 ids
    reply: np.ndarray
    rounds: int  # MTP rounds of the reply
    drafted: int
    accepted: int
    time: float  # when it finished (seconds since the epoch)

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.reply])


class Capture:
    """Appends finished requests to `folder`, within `budget` bytes (None: unbounded); from any thread."""

    def __init__(self, folder, budget: Optional[int] = None):
        self.folder, self.budget = Path(folder), budget
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file, self._path, self._written = None, None, 0

    def add(self, prompt: Sequence[int], reply: Sequence[int], rounds: int = 0, drafted: int = 0,
            accepted: int = 0) -> None:
        data = encode(Record(np.asarray(prompt, np.int32), np.asarray(reply, np.int32), rounds, drafted, accepted,
                             time.time()))
        with self._lock:
            if self._file is None or self._written + len(data) > SEGMENT_BYTES:
                self._next_segment()
            self._file.write(data)
            self._file.flush()  # a whole record reaches the file (the OS) before the next
            self._written += len(data)
            if self.budget is not None:
                self._trim()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _next_segment(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"c-{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}.bin"
        self._path = self.folder / name
        self._file, self._written = open(self._path, "ab"), 0

    def _trim(self) -> None:
        """Remove the oldest segments (by name: their start time) while the folder is over budget."""
        segments = sorted(self.folder.glob(PATTERN))
        total = sum(_size(p) for p in segments)
        for path in segments:
            if total <= self.budget or path == self._path:
                break
            total -= _size(path)
            path.unlink(missing_ok=True)


def encode(r: Record) -> bytes:
    body = HEADER.pack(MAGIC, len(r.prompt), len(r.reply), r.rounds, r.drafted, r.accepted, r.time) \
        + r.prompt.astype("<i4").tobytes() + r.reply.astype("<i4").tobytes()
    return body + CRC.pack(zlib.crc32(body))


def read(folder, warn: bool = True) -> Iterator[Record]:
    """Every whole record in `folder`, oldest segment first; a segment's torn or corrupt tail is
    skipped with one warning (`warn`)."""
    for path in sorted(Path(folder).glob(PATTERN)):
        yield from _records(path, warn)


def newest(folder, max_tokens: int) -> list[Record]:
    """The newest records of `folder` holding at most `max_tokens` tokens in all, newest first. Memory
    holds those and one segment: a first pass reads only when each record finished and its length."""
    sizes = sorted(((r.time, len(r.prompt) + len(r.reply)) for r in read(folder, warn=False)), reverse=True)
    total, cutoff = 0, float("inf")
    for when, n in sizes:
        if total + n > max_tokens:
            break
        total, cutoff = total + n, when
    kept, total = [], 0
    for r in sorted((r for r in read(folder) if r.time >= cutoff), key=lambda r: r.time, reverse=True):
        total += len(r.prompt) + len(r.reply)
        if total > max_tokens:  # (a record appended between the passes)
            break
        kept.append(r)
    return kept


def _records(path: Path, warn: bool = True) -> Iterator[Record]:
    try:
        data = path.read_bytes()
    except OSError:  # removed by another process's budget meanwhile
        return
    at = 0
    while at < len(data):
        record, size = _decode(data, at)
        if record is None:
            if warn:
                log.warning("capture %s: a torn or corrupt record at byte %d; the rest of the file is skipped",
                            path.name, at)
            return
        yield record
        at += size


def _decode(data: bytes, at: int) -> tuple[Optional[Record], int]:
    if len(data) - at < HEADER.size:
        return None, 0
    magic, n_prompt, n_reply, rounds, drafted, accepted, when = HEADER.unpack_from(data, at)
    size = HEADER.size + 4 * (n_prompt + n_reply) + CRC.size
    if magic != MAGIC or len(data) - at < size:
        return None, 0
    body = data[at : at + size - CRC.size]
    if CRC.unpack_from(data, at + size - CRC.size)[0] != zlib.crc32(body):
        return None, 0
    ids = np.frombuffer(body, "<i4", offset=HEADER.size).astype(np.int32)
    return Record(ids[:n_prompt], ids[n_prompt:], rounds, drafted, accepted, when), size


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
