"""One KV cache per sequence batch, owned by the target and read in place by the drafter.

Every slot carries the absolute position of the token stored in it (-1 = empty, padding or
rolled back), and all masks are derived from positions. That one rule covers causal and
sliding-window masks, left padding, ragged per-row rollback and the drafter's own masks,
and it makes rollback after the sliding window has wrapped an ordinary operation: sliding
layers are linear buffers that retain `window + 1 + max_rollback` positions and are
compacted every few tokens, never rotated in place.

Rollback (`trim`, `rollback`) either succeeds exactly or raises `CacheError`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .models.base import SharedKV

FULL = "full_attention"
SLIDING = "sliding_attention"


class CacheError(RuntimeError):
    """A cache operation that cannot be done exactly (e.g. rollback past retained slots)."""


class _Track:
    """Slot bookkeeping shared by every cached layer of one attention type."""

    def __init__(self, batch_size: int, window: Optional[int], keep: Optional[int], step: int):
        self.window = window  # None: full attention
        self.keep = keep  # positions a sliding track retains; None: everything
        self.step = step
        self.pos = mx.full((batch_size, 0), -1, dtype=mx.int32)
        self.length = 0  # slots in use (shared by all rows)
        # Per row: every position below this has been evicted (sliding tracks only).
        self.evicted = np.zeros(batch_size, dtype=np.int64)
        self.holes = False  # True when -1 slots (padding, ragged rollback) lie inside the used slots

    @property
    def capacity(self) -> int:
        return self.pos.shape[1]


class KVCache:
    """K/V buffers for every non-shared layer of a model, for a batch of sequences.

    Args:
        layer_types: attention type of each cached layer (index = cache slot of the layer).
        sliding_window: the target's window W (a query sees W keys including itself).
        batch_size: number of rows.
        max_rollback: how many most-recent tokens `trim` must always be able to undo;
            speculative decoding needs K + 1 for K drafts.
        step: growth / compaction granularity in slots.
    """

    def __init__(
        self,
        layer_types: Sequence[str],
        sliding_window: int,
        batch_size: int = 1,
        max_rollback: int = 0,
        step: int = 256,
    ):
        self.layer_types = list(layer_types)
        self.window = sliding_window
        self.max_rollback = max_rollback
        # The drafter reads the last W + 1 sliding positions (the reference convention).
        keep = sliding_window + 1 + max_rollback
        self.tracks = {
            FULL: _Track(batch_size, None, None, step),
            SLIDING: _Track(batch_size, sliding_window, keep, min(step, max(16, keep // 2))),
        }
        self.keys: list[Optional[mx.array]] = [None] * len(self.layer_types)
        self.values: list[Optional[mx.array]] = [None] * len(self.layer_types)
        self.offset = np.zeros(batch_size, dtype=np.int64)  # next position of each row
        self._unmasked = False

    @property
    def batch_size(self) -> int:
        return len(self.offset)

    # ---- forward pass ---------------------------------------------------------------

    def begin(self, length: int, pad: Optional[Sequence[int]] = None) -> tuple[mx.array, mx.array]:
        """Reserve `length` slots per row for the next forward.

        Args:
            length: tokens per row in this forward.
            pad: left-padding tokens per row in this chunk (not real tokens).

        Returns:
            (positions, rope_offset): (B, L) int32 query positions (-1 for padding) and the
            (B,) per-row RoPE offset of the chunk's first token.
        """
        pad_np = np.zeros(self.batch_size, dtype=np.int64) if pad is None else np.asarray(pad)
        start = self.offset - pad_np
        qpos = start[:, None] + np.arange(length)[None, :]
        qpos = np.where(np.arange(length)[None, :] >= pad_np[:, None], qpos, -1)
        qpos_mx = mx.array(qpos.astype(np.int32))
        for track in self.tracks.values():
            self._reserve(track, length)
            track.pos[:, track.length : track.length + length] = qpos_mx
            track.length += length
            track.holes = track.holes or bool(pad_np.any())
        self.offset = self.offset + (length - pad_np)
        # One token of one row over hole-free slots: no mask needed (sliding layers get a
        # window-sized view instead), which keeps plain decoding cheap.
        self._unmasked = length == 1 and self.batch_size == 1 and not any(
            t.holes for t in self.tracks.values())
        return qpos_mx, mx.array(start.astype(np.int32))

    def attention_mask(self, layer_type: str, qpos: mx.array) -> Optional[mx.array]:
        """The mask for this forward's attention: None when `update` returns exactly the
        visible slots (one query, no holes), else `mask`."""
        return None if self._unmasked else self.mask(layer_type, qpos)

    def mask(self, layer_type: str, qpos: mx.array) -> mx.array:
        """Boolean (B, 1, L, T) mask for queries at `qpos` over this type's slots."""
        track = self.tracks[layer_type]
        kpos = track.pos[:, None, : track.length]  # (B, 1, T)
        q = qpos[:, :, None]  # (B, L, 1)
        visible = (kpos >= 0) & (kpos <= q)
        if track.window is not None:
            visible = visible & (kpos > q - track.window)
        return visible[:, None]

    def update(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write this forward's K/V for `layer`; return all of its slots."""
        track = self.tracks[self.layer_types[layer]]
        end = track.length
        begin = end - keys.shape[2]
        buf_k, buf_v = self._buffers(layer, keys, values, track.capacity)
        buf_k[..., begin:end, :] = keys
        buf_v[..., begin:end, :] = values
        self.keys[layer], self.values[layer] = buf_k, buf_v
        first = max(0, end - track.window) if self._unmasked and track.window else 0
        return buf_k[..., first:end, :], buf_v[..., first:end, :]

    def shared_kv(self, layer: int) -> SharedKV:
        """Zero-copy view of `layer`'s K/V and slot positions (what the drafter reads)."""
        track = self.tracks[self.layer_types[layer]]
        n = track.length
        return SharedKV(self.keys[layer][..., :n, :], self.values[layer][..., :n, :], track.pos[:, :n])

    # ---- rollback -------------------------------------------------------------------

    def trim(self, n: int) -> None:
        """Remove the last `n` tokens of every row; exact or raises CacheError."""
        self.rollback([n] * self.batch_size)

    def rollback(self, n_per_row: Sequence[int]) -> None:
        """Remove the last `n_per_row[b]` tokens of row b (ragged speculative rollback)."""
        n = np.asarray(n_per_row, dtype=np.int64)
        if n.shape != self.offset.shape or (n < 0).any():
            raise CacheError(f"rollback needs {self.batch_size} non-negative counts, got {list(n_per_row)}")
        common = int(n.min())
        new_offset = self.offset - n
        for name, track in self.tracks.items():
            self._check_rollback(name, track, n, new_offset)
        for track in self.tracks.values():
            if common:
                track.pos[:, track.length - common : track.length] = -1
                track.length -= common
            if (n > common).any():
                # Ragged tails become holes: their slots stay but are masked out.
                kpos = track.pos[:, : track.length]
                limit = mx.array(new_offset.astype(np.int32))[:, None]
                track.pos[:, : track.length] = mx.where(kpos >= limit, -1, kpos)
                track.holes = True
        self.offset = new_offset

    def _check_rollback(self, name: str, track: _Track, n: np.ndarray, new_offset: np.ndarray):
        if (new_offset < 0).any():
            raise CacheError(f"cannot roll back {n.tolist()} tokens: rows hold only {self.offset.tolist()}")
        if track.window is not None:
            need_from = np.maximum(0, new_offset - (track.window + 1))
            if (track.evicted > need_from).any():
                raise CacheError(
                    f"cannot roll back {n.tolist()} tokens: the sliding-window cache retains only "
                    f"{track.keep} positions (window {track.window} + 1 + max_rollback {self.max_rollback})"
                )
        if (n > track.length).any():
            raise CacheError(f"cannot roll back {n.tolist()} tokens: only {track.length} slots in {name}")

    # ---- batch membership -------------------------------------------------------------

    def select(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in this order (sequences leaving a batch)."""
        rows_np = np.asarray(rows, dtype=np.int64)
        index = mx.array(rows_np.astype(np.int32))
        for track in self.tracks.values():
            track.pos = track.pos[index]
            track.evicted = track.evicted[rows_np]
        for i, buf in enumerate(self.keys):
            if buf is not None:
                self.keys[i], self.values[i] = buf[index], self.values[i][index]
        self.offset = self.offset[rows_np]

    def extend(self, other: "KVCache") -> None:
        """Append `other`'s rows (sequences joining a batch). Slots are aligned on the right,
        the shorter side left-padded with empty (-1) slots."""
        if (other.layer_types, other.window, other.max_rollback) != (self.layer_types, self.window, self.max_rollback):
            raise CacheError("cannot join caches of different models or rollback budgets")
        for name, track in self.tracks.items():
            theirs = other.tracks[name]
            length = max(track.length, theirs.length)
            capacity = length + track.step
            mine_idx, their_idx = track.length, theirs.length
            track.pos = mx.concatenate(
                [_right_align(track.pos, mine_idx, length, capacity, -1),
                 _right_align(theirs.pos, their_idx, length, capacity, -1)], axis=0)
            for i, kind in enumerate(self.layer_types):
                if kind != name:
                    continue
                for bufs, obufs in ((self.keys, other.keys), (self.values, other.values)):
                    bufs[i] = mx.concatenate(
                        [_right_align(bufs[i], mine_idx, length, capacity, 0, axis=2),
                         _right_align(obufs[i], their_idx, length, capacity, 0, axis=2)], axis=0)
            track.length = length
            track.evicted = np.concatenate([track.evicted, theirs.evicted])
            track.holes = track.holes or theirs.holes or mine_idx != their_idx
        self.offset = np.concatenate([self.offset, other.offset])

    # ---- memory ---------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values if a is not None)

    def capacity(self, layer_type: str) -> int:
        return self.tracks[layer_type].capacity

    def _reserve(self, track: _Track, length: int) -> None:
        """Make room for `length` more slots, compacting sliding tracks."""
        over_keep = track.keep is not None and track.length > track.keep + track.step
        if track.length + length <= track.capacity and not over_keep:
            return
        index = self._kept_slots(track)
        kept = index.shape[1]
        capacity = kept + max(length, track.step)
        self._relayout(track, index, capacity)

    def _kept_slots(self, track: _Track) -> np.ndarray:
        """(B, kept) slot indices to retain, left-padded with -1; drops holes and evicted slots."""
        pos = np.array(track.pos[:, : track.length])
        need = pos >= 0
        if track.keep is not None:
            need &= pos >= (self.offset - track.keep)[:, None]
        counts = need.sum(axis=1)
        width = int(counts.max(initial=0))
        index = np.full((self.batch_size, width), -1, dtype=np.int64)
        for b in range(self.batch_size):
            slots = np.nonzero(need[b])[0]
            index[b, width - len(slots) :] = slots
        if track.keep is not None:
            dropped = np.where(pos >= 0, pos, -1)
            dropped = np.where(need, -1, dropped).max(axis=1, initial=-1)
            track.evicted = np.maximum(track.evicted, dropped + 1)
        return index

    def _relayout(self, track: _Track, index: np.ndarray, capacity: int) -> None:
        """Move kept slots to the front of freshly sized buffers."""
        B, kept = index.shape
        contiguous = kept == 0 or (
            (index >= 0).all() and (index == index[:1, :1] + np.arange(kept)).all()
        )
        first = int(index[0, 0]) if kept else 0
        safe = mx.array(np.maximum(index, 0).astype(np.int32))
        pad = mx.array(index < 0)
        pos = track.pos[:, first : first + kept] if contiguous else mx.take_along_axis(track.pos, safe, axis=1)
        pos = mx.where(pad, -1, pos) if not contiguous else pos
        track.pos = mx.concatenate([pos, mx.full((B, capacity - kept), -1, dtype=mx.int32)], axis=1)
        track.length = kept
        track.holes = bool((index < 0).any())
        for i, kind in enumerate(self.layer_types):
            if self.tracks[kind] is not track or self.keys[i] is None:
                continue
            self.keys[i] = self._move(self.keys[i], first, kept, safe, contiguous, capacity)
            self.values[i] = self._move(self.values[i], first, kept, safe, contiguous, capacity)

    @staticmethod
    def _move(buf, first, kept, safe, contiguous, capacity):
        B, H, _, D = buf.shape
        if contiguous:
            data = buf[..., first : first + kept, :]
        else:
            data = mx.take_along_axis(buf, safe[:, None, :, None], axis=2)
        tail = mx.zeros((B, H, capacity - kept, D), dtype=buf.dtype)
        return mx.concatenate([data, tail], axis=2)

    def _buffers(self, layer: int, keys: mx.array, values: mx.array, capacity: int):
        """The layer's buffers, created at the track's capacity on first use (`_relayout`
        resizes existing ones whenever the capacity changes)."""
        if self.keys[layer] is None:
            B, H, _, _ = keys.shape
            self.keys[layer] = mx.zeros((B, H, capacity, keys.shape[3]), dtype=keys.dtype)
            self.values[layer] = mx.zeros((B, H, capacity, values.shape[3]), dtype=values.dtype)
        return self.keys[layer], self.values[layer]


def _right_align(buf: mx.array, used: int, length: int, capacity: int, fill, axis: int = 1) -> mx.array:
    """buf[..., :used] placed at [length - used, length) of a `capacity`-long axis."""
    data = buf[:, :used] if axis == 1 else buf[:, :, :used]

    def filler(width):
        shape = list(data.shape)
        shape[axis] = width
        return mx.full(shape, fill, dtype=buf.dtype)

    return mx.concatenate([filler(length - used), data, filler(capacity - length)], axis=axis)
