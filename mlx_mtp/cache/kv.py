"""One KV cache per batch of sequences, owned by the target and read in place by the drafter.

Every slot carries the absolute position of the token stored in it (-1 = empty or rolled back)
and every mask is derived from positions, so causal and sliding masks, ragged rows and the
drafter's own masks follow one rule. Slots are addressed by position: full-attention layers
store position t in slot t (the buffer grows), sliding layers in slot t mod C of a ring of
C = window + 1 + max_rollback slots (`ring_size`), which grows with the full buffers until it
reaches C, so a short sequence holds no more than it uses. Rolling back is then only a matter of
marking positions empty, which the speculative round does on the device (`rollback_to`) without
the host ever reading how many drafts were accepted; a host-side `trim`/`rollback` checks that
the positions it needs are still retained and either succeeds exactly or raises `CacheError`. A
one-row cache can be read out by position and rebuilt at a length from such reads (`read`,
`resume`), which is how the prefix cache stores and restores states. A ragged forward runs the
next tokens of several one-row caches side by side, each through its own cache's step (`Ragged`).

The host keeps an upper bound of each row's length (`bound`); it is exact until a device-side
rollback, and `sync()` makes it exact again.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..runtime.jit import small

FULL = "full_attention"
SLIDING = "sliding_attention"


class CacheError(RuntimeError):
    """A cache operation that cannot be done exactly (e.g. rollback past retained slots)."""


class SharedKV(NamedTuple):
    """A read-only view of one store layer's K/V as the drafter needs it.

    keys/values: (B, n_kv, T, head_dim). positions: (B, T) int32 absolute positions of
    each slot, -1 for empty or rolled-back slots; masks are derived from these.
    """

    keys: mx.array
    values: mx.array
    positions: mx.array


# Forwards of at most this many tokens per row (decoding, verifying drafts) attend over whole
# buffers, so that their arrays keep their shapes from step to step and compiled forwards are reused.
FIXED_LENGTH = 8


class _Write(NamedTuple):
    """Where one forward's K/V go in the buffers of one attention type (cache internals)."""

    slots: mx.array  # (B, count) slots receiving this forward's last `count` tokens
    count: int  # tokens written: all L, or the last C of a chunk longer than a ring of C slots
    concat: bool  # attend over the old slots plus the new K/V (a chunk longer than the ring allows)
    view: Optional[tuple]  # (start, stop) of the slots returned to attention; None: all of them
    capacity: int  # slots of a buffer
    start: Optional[mx.array] = None  # (1,): every row writes slots start .. start + count - 1

    def store(self, buf: mx.array, values: mx.array, axis: int) -> mx.array:
        """`buf` with `values` (this forward's last `count` entries along `axis`) in their slots."""
        if self.start is not None:
            return mx.slice_update(buf, values, self.start, axes=(axis,))
        slots = self.slots if axis == 1 else self.slots[:, None, :, None]
        return mx.put_along_axis(buf, slots, values, axis=axis)

    def visible(self, buf: mx.array) -> mx.array:
        return buf if self.view is None else buf[:, :, self.view[0] : self.view[1]]


class Step(NamedTuple):
    """What one forward over L new tokens per row needs besides the weights, with the K/V buffers
    it reads and writes: arrays and constants only, so that a compiled forward takes it whole."""

    positions: mx.array  # (B, L) int32 query positions
    offset: Union[mx.array, int]  # RoPE offset of the first query, (B,) or one int for all rows
    masks: dict  # layer type -> (B, 1, L, T) bool, or None when every returned slot is visible
    writes: dict  # layer type -> _Write
    scratch: dict  # what a model computes once per forward for all its layers (e.g. RoPE tables)
    kinds: tuple = ()  # attention type of each cached layer
    keys: Optional[list] = None  # K buffer of each cached layer (the cache's own list): `store` writes it
    values: Optional[list] = None
    fixed: bool = False  # every array keeps its shape from one fixed step to the next (at one batch size)

    def last(self, n: int) -> "Step":
        """The same forward restricted to its last `n` queries (layers whose other outputs
        are never used)."""
        L = self.positions.shape[1]
        masks = {t: None if m is None else m[:, :, L - n :] for t, m in self.masks.items()}
        return self._replace(positions=self.positions[:, L - n :], offset=self.offset + (L - n), masks=masks,
                             scratch={})

    def store(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write this forward's K/V (B, n_kv, L, D) of cached layer `layer`; return the K/V its
        queries attend over (matching `masks` for the layer's type)."""
        write = self.writes[self.kinds[layer]]
        if self.keys[layer] is None:
            B, H, _, _ = keys.shape
            self.keys[layer] = mx.zeros((B, H, write.capacity, keys.shape[3]), dtype=keys.dtype)
            self.values[layer] = mx.zeros((B, H, write.capacity, values.shape[3]), dtype=values.dtype)
        old_k, old_v = self.keys[layer], self.values[layer]
        n = write.count
        self.keys[layer] = write.store(old_k, keys[:, :, keys.shape[2] - n :], axis=2)
        self.values[layer] = write.store(old_v, values[:, :, values.shape[2] - n :], axis=2)
        if write.concat:  # the slots from before this forward, then its own K/V
            if write.view[1] == 0:
                return keys, values
            return mx.concatenate([old_k, keys], axis=2), mx.concatenate([old_v, values], axis=2)
        return write.visible(self.keys[layer]), write.visible(self.values[layer])


class Ragged(NamedTuple):
    """One forward over the next tokens of several one-row caches, laid side by side on one token
    axis (rows of different lengths: ragged). Each row attends through the `Step` its cache
    made, exactly as a forward of its own would; `wanted`: rows whose last position's output is
    wanted (the others only fill their caches)."""

    steps: tuple  # each row's Step
    sizes: tuple  # each row's tokens
    wanted: tuple  # bool per row

    @classmethod
    def begin(cls, caches: Sequence["KVCache"], sizes: Sequence[int], wanted: Sequence[bool]) -> "Ragged":
        """Reserve `sizes[i]` slots in `caches[i]` (one-row caches), as each forward alone would."""
        if any(c.batch_size != 1 for c in caches):
            raise CacheError("a ragged forward takes one-row caches")
        steps = tuple(c.begin(n) for c, n in zip(caches, sizes))
        return cls(steps, tuple(sizes), tuple(bool(w) for w in wanted))

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """(start, stop) of each row on the token axis."""
        ends = np.cumsum(self.sizes).tolist()
        return [(e - n, e) for e, n in zip(ends, self.sizes)]

    def last_tokens(self) -> list[int]:
        """Where each wanted row's last token sits on the token axis."""
        return [stop - 1 for (_, stop), w in zip(self.bounds, self.wanted) if w]

    def last(self) -> "Ragged":
        """The same forward restricted to the wanted rows' last positions (see `Step.last`)."""
        keep = [i for i, w in enumerate(self.wanted) if w]
        return Ragged(tuple(self.steps[i].last(1) for i in keep), (1,) * len(keep), (True,) * len(keep))


@dataclasses.dataclass
class _Track:
    """The slots of one attention type, shared by its cached layers: the position each holds
    (-1: none), how many there are, and which of them a forward writes and sees."""

    window: Optional[int]  # None: full attention
    capacity: int
    pos: mx.array  # (B, capacity) int32

    @property
    def ring(self) -> bool:
        return self.window is not None

    def write(self, positions: mx.array, length: int, end: int, first: Optional[int], single: bool,
              fixed: bool, blocks: Optional[tuple] = None) -> tuple[_Write, Optional[mx.array]]:
        """Store a forward's new positions (B, length) in the slots; return the write plan and the
        mask. `end`: 1 + the last position any row writes; `first`: every row's first new position
        where all rows have one known length (None: rows apart). A fixed step attends over the
        whole buffer, masked, so that its shapes stay the same. `blocks`: see `KVCache.begin` (rings only)."""
        C = self.capacity
        if not self.ring:
            start = None if first is None else mx.array([first], dtype=mx.int32)
            write = _Write(positions, length, False, None if fixed else (0, end), C, start)
            self.pos = write.store(self.pos, positions, axis=1)
            if fixed:
                return write, _visible(self.pos, positions, None)
            return write, None if single and length == 1 else _visible(self.pos[:, :end], positions, None)
        W = self.window
        slots = positions % C
        n = min(length, C)
        scatter = first is None or (first + length - n) % C + n > C  # rows apart, or a write across the ring's end
        start = None if scatter else mx.array([(first + length - n) % C], dtype=mx.int32)
        if length > C - W + 1 and end > C:  # later tokens of the chunk would overwrite keys earlier ones need
            old = (0, 0) if end == length else (0, C)  # an empty cache has nothing older
            kpos = mx.concatenate([self.pos[:, old[0] : old[1]], positions], axis=1)
            write = _Write(slots[:, length - n :], n, True, old, C, start)
            self.pos = write.store(self.pos, positions[:, length - n :], axis=1)
            return write, _visible(kpos, positions, W, blocks)
        if single and length == 1 and end <= C and not fixed and blocks is None:  # not wrapped yet: the window is a plain slice
            write = _Write(slots, length, False, (max(0, end - W), end), C, start)
            self.pos = write.store(self.pos, positions, axis=1)
            return write, None
        write = _Write(slots, length, False, None, C, start)
        self.pos = write.store(self.pos, positions, axis=1)
        return write, _visible(self.pos, positions, W, blocks)


class _Sizer:
    """Sizes a cache's buffers to the positions its rows hold: full-attention buffers get a rounded
    number of slots (grown with slack, shrunk as rows leave), rings as many up to `ring_size`.
    It works on the cache's own tracks and buffer lists, in place (forwards hold those lists)."""

    def __init__(self, layer_types: list, tracks: dict, keys: list, values: list, step: int, ring_size: int):
        self.layer_types, self.tracks, self.keys, self.values = layer_types, tracks, keys, values
        self.step, self.ring_size = step, ring_size

    def grow(self, needed: int) -> None:
        """Room for positions 0 .. needed - 1 (with slack: growing often makes many sizes)."""
        if needed > self.tracks[FULL].capacity:
            self.resize(self.rounded(needed + self.step // 2))

    def shrink(self, top: int) -> None:
        """No more slots than positions 0 .. top (rows whose later positions left)."""
        needed = self.rounded(top + 1)
        if needed < self.tracks[FULL].capacity:
            self.resize(needed)

    def rounded(self, n: int) -> int:
        """Full-attention slots for n positions: a multiple of `step`, and of an eighth of n (as a power
        of two) past 8 steps, so that a long context's buffers take few sizes: every size is a
        compiled forward of its own."""
        granule = max(self.step, 1 << max(n.bit_length() - 4, 0))
        return -(-n // granule) * granule

    def resize(self, capacity: int) -> None:
        """Full-attention buffers with `capacity` slots, rings with as many up to `ring_size`. Slot =
        position in both while a ring is shorter than `ring_size` (no position at or past `capacity`
        was ever written: the cache's `top` bounds them), so no data moves."""
        for kind, size in ((FULL, capacity), (SLIDING, min(capacity, self.ring_size))):
            track = self.tracks[kind]
            if size == track.capacity:
                continue
            track.pos = _fit(track.pos, size, -1, axis=1)
            for i, t in enumerate(self.layer_types):
                if t == kind and self.keys[i] is not None:
                    self.keys[i] = _fit(self.keys[i], size, 0, axis=2)
                    self.values[i] = _fit(self.values[i], size, 0, axis=2)
            track.capacity = size


class KVCache:
    """K/V buffers for every non-shared layer of a model, for a batch of sequences.

    Args:
        layer_types: attention type of each cached layer (index = cache slot of the layer).
        sliding_window: the target's window W (a query sees W keys including itself).
        batch_size: number of rows.
        max_rollback: how many most recent tokens can always be rolled back.
        step: growth granularity of full-attention buffers, in slots.
    """

    def __init__(self, layer_types: Sequence[str], sliding_window: int, batch_size: int = 1,
                 max_rollback: int = 0, step: int = 256):
        self.layer_types = list(layer_types)
        self.window = sliding_window
        self.max_rollback = max_rollback
        self.step = step
        self.ring_size = sliding_window + 1 + max_rollback  # the drafter reads the last W + 1 positions
        # Both buffers start empty and grow (`sizer`); a ring is as long as the full buffers (slot =
        # position: nothing wraps) until it reaches `ring_size`. Never rebound, only changed in place:
        # the sizer and every forward's `Step` hold these very lists.
        self.tracks = {FULL: _Track(None, 0, _empty(batch_size, 0)),
                       SLIDING: _Track(sliding_window, 0, _empty(batch_size, 0))}
        self.keys: list[Optional[mx.array]] = [None] * len(self.layer_types)
        self.values: list[Optional[mx.array]] = [None] * len(self.layer_types)
        self.sizer = _Sizer(self.layer_types, self.tracks, self.keys, self.values, step, self.ring_size)
        self.offset = mx.zeros((batch_size,), dtype=mx.int32)  # next position of each row
        self.bound = np.zeros(batch_size, dtype=np.int64)  # upper bound of `offset`
        self.top = np.zeros(batch_size, dtype=np.int64)  # upper bound of 1 + the last written position
        self.floor = np.zeros(batch_size, dtype=np.int64)  # rings hold nothing older (a resumed row's)
        self.exact = True  # bound == offset

    @property
    def batch_size(self) -> int:
        return len(self.bound)

    def offsets(self) -> np.ndarray:
        """Each row's length (syncs with the device if a rollback happened there)."""
        self.sync()
        return self.bound.copy()

    def settle(self, rows: Sequence[int], lengths: Sequence[int], ahead: int, reach: int) -> None:
        """Tighten the host's bounds: rows `rows` had lengths `lengths` (read by the driver),
        forwards of at most `ahead` tokens were queued since, and no position at or past
        `lengths + reach` was ever written."""
        index, lengths = np.asarray(rows, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        self.bound[index] = np.minimum(self.bound[index], lengths + ahead)
        self.top[index] = np.minimum(self.top[index], lengths + reach)

    def sync(self) -> None:
        if not self.exact:
            self.bound = np.array(self.offset).astype(np.int64)
            self.exact = True

    # ---- forward pass ---------------------------------------------------------------

    def begin(self, length: int, blocks: Optional[tuple] = None) -> Step:
        """Reserve slots for `length` new tokens per row at positions offset .. offset + length - 1.
        `blocks`: (starts, ends), each (B, M) int32, the absolute positions [start, end) of runs whose
        tokens see each other on sliding layers, within the window's look-back (Gemma 4's images;
        empty runs start = end). Every run lies wholly in this forward."""
        positions = self.offset[:, None] + mx.array(np.arange(length, dtype=np.int32))  # a constant: no graph node
        end = int(self.bound.max(initial=0)) + length
        self.sizer.grow(end)
        fixed = (length <= min(FIXED_LENGTH, self.ring_size - self.window + 1)
                 and all(k is not None for k in self.keys))
        single = self.exact and self.batch_size == 1
        offset = int(self.bound[0]) if single and not fixed else self.offset
        # Rows of one known length write the same slots: a slice update instead of a scatter.
        aligned = self.exact and (self.bound == self.bound[0]).all()
        first = int(self.bound[0]) if aligned else None
        masks, writes = {}, {}
        for name, track in self.tracks.items():
            writes[name], masks[name] = track.write(positions, length, end, first, single, fixed,
                                                    blocks if track.ring else None)
        self.offset = self.offset + length
        self.bound = self.bound + length
        self.top = np.maximum(self.top, self.bound)
        return Step(positions, offset, masks, writes, {}, tuple(self.layer_types), self.keys, self.values, fixed)

    def shared_kv(self, layer: int) -> SharedKV:
        """`layer`'s K/V buffers and slot positions (what the drafter reads): whole, empty slots
        included (position -1), so that their shapes change only when a buffer grows."""
        track = self.tracks[self.layer_types[layer]]
        return SharedKV(self.keys[layer], self.values[layer], track.pos)

    # ---- rollback -------------------------------------------------------------------

    def rollback_to(self, offset: mx.array) -> None:
        """Set each row's length to `offset` (B,) on the device, forgetting later positions.
        The caller guarantees it lies within `max_rollback` of every row's last write."""
        tracks = list(self.tracks.values())
        for track, pos in zip(tracks, _forget([t.pos for t in tracks], offset)):
            track.pos = pos
        self.offset = offset.astype(mx.int32)
        self.exact = False

    def trim(self, n: int) -> None:
        """Remove the last `n` tokens of every row; exact or raises CacheError."""
        self.rollback([n] * self.batch_size)

    def rollback(self, n_per_row: Sequence[int]) -> None:
        """Remove the last `n_per_row[b]` tokens of row b; exact or raises CacheError."""
        n = np.asarray(n_per_row, dtype=np.int64)
        if n.shape != self.bound.shape or (n < 0).any():
            raise CacheError(f"rollback needs {self.batch_size} non-negative counts, got {list(n_per_row)}")
        self.sync()
        self.truncate(self.bound - n)

    def truncate(self, lengths: Sequence[int]) -> None:
        """Set each row's length to `lengths[b]` (host-known); exact or raises CacheError.
        Valid while the device length is at most `max_rollback` past it (or any time for rows
        whose kept positions were never evicted)."""
        new = np.asarray(lengths, dtype=np.int64)
        if (new < 0).any() or (new > self.bound).any():
            raise CacheError(f"cannot set lengths {new.tolist()}: rows hold at most {self.bound.tolist()}")
        needed = np.maximum(new - (self.window + 1), 0)
        if (needed < self.oldest()).any():
            raise CacheError(
                f"cannot roll back to {new.tolist()}: the sliding-window cache retains only {self.ring_size} "
                f"positions (window {self.window} + 1 + max_rollback {self.max_rollback})")
        self.rollback_to(mx.array(new.astype(np.int32)))
        self.bound, self.exact = new, True

    # ---- prefix states (what the prefix cache stores and restores) ------------------------

    def read(self, start: int, stop: int, kind: str) -> dict[int, tuple[mx.array, mx.array]]:
        """Copies of the K/V of positions start .. stop - 1 of every cached layer of `kind`
        (`FULL` or `SLIDING`), in position order, from a one-row cache. Raises CacheError where
        the cache does not hold them (not written yet, or gone round a sliding ring)."""
        if self.batch_size != 1:
            raise CacheError("only a one-row cache can be read out")
        self.sync()
        track = self.tracks[kind]
        oldest = int(self.oldest()[0]) if track.ring else 0
        if not oldest <= start <= stop <= int(self.bound[0]):
            raise CacheError(f"positions {start}..{stop - 1} are not all held ({kind}: {oldest}..{int(self.bound[0]) - 1})")
        slots = mx.arange(start, stop, dtype=mx.int32) % track.capacity if track.ring else None
        out = {}
        for i, t in enumerate(self.layer_types):
            if t != kind or self.keys[i] is None:
                continue
            if slots is None:  # a copy, not a view: a view would keep the whole buffer alive
                out[i] = (mx.contiguous(self.keys[i][:, :, start:stop]), mx.contiguous(self.values[i][:, :, start:stop]))
            else:
                out[i] = (mx.take(self.keys[i], slots, axis=2), mx.take(self.values[i], slots, axis=2))
        return out

    def resume(self, length: int, full: dict, sliding: dict) -> None:
        """Make this empty one-row cache hold `length` positions, as if it had read them:
        `full[layer]` is the (K, V) of positions 0 .. length - 1 of a full-attention layer,
        `sliding[layer]` the (K, V) of the last min(length, window + 1) of them (what attention
        and the drafter can still see) of a sliding layer."""
        if self.batch_size != 1 or int(self.bound[0]) != 0:
            raise CacheError("only an empty one-row cache can be resumed")
        self.sizer.grow(length)
        capacity = self.tracks[FULL].capacity
        self.tracks[FULL].pos = _fit(mx.arange(length, dtype=mx.int32)[None], capacity, -1, axis=1)
        for i, (k, v) in full.items():
            self.keys[i], self.values[i] = _fit(k, capacity, 0, axis=2), _fit(v, capacity, 0, axis=2)
        ring = self.tracks[SLIDING]
        positions = mx.arange(max(length - self.window - 1, 0), length, dtype=mx.int32)[None]
        write = _Write(positions % ring.capacity, positions.shape[1], False, None, ring.capacity)
        ring.pos = write.store(_empty(1, ring.capacity), positions, axis=1)
        for i, (k, v) in sliding.items():
            if k.shape[2] != positions.shape[1]:
                raise CacheError(f"a sliding layer needs the last {positions.shape[1]} positions, got {k.shape[2]}")
            empty = mx.zeros((*k.shape[:2], ring.capacity, k.shape[3]), dtype=k.dtype)
            self.keys[i], self.values[i] = write.store(empty, k, axis=2), write.store(empty, v, axis=2)
        self.offset = mx.array([length], dtype=mx.int32)
        self.bound = np.array([length], dtype=np.int64)
        self.top = self.bound.copy()
        self.floor = np.array([length - positions.shape[1]], dtype=np.int64)

    def oldest(self) -> np.ndarray:
        """Each row's oldest position whose sliding K/V the rings still hold (at most)."""
        return np.maximum(self.top - self.tracks[SLIDING].capacity, self.floor)

    # ---- batch membership -------------------------------------------------------------

    def select(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in this order (sequences leaving a batch)."""
        rows_np = np.asarray(rows, dtype=np.int64)
        index = mx.array(rows_np.astype(np.int32))
        for track in self.tracks.values():
            track.pos = track.pos[index]
        for i, buf in enumerate(self.keys):
            if buf is not None:
                self.keys[i], self.values[i] = buf[index], self.values[i][index]
        self.offset = self.offset[index]
        self.bound, self.top, self.floor = self.bound[rows_np], self.top[rows_np], self.floor[rows_np]
        self.sizer.shrink(int(self.top.max(initial=0)))

    def take(self, row: int) -> "KVCache":
        """A new one-row cache holding `row` (arrays are values: nothing is shared mutably)."""
        out = KVCache(self.layer_types, self.window, 1, self.max_rollback, self.step)
        pick = slice(row, row + 1)
        for name, track in self.tracks.items():
            out.tracks[name] = _Track(track.window, track.capacity, track.pos[pick])
        out.keys[:] = [None if a is None else a[pick] for a in self.keys]
        out.values[:] = [None if a is None else a[pick] for a in self.values]
        out.offset = self.offset[pick]
        out.bound, out.top, out.exact = self.bound[pick].copy(), self.top[pick].copy(), self.exact
        out.floor = self.floor[pick].copy()
        out.sizer.shrink(int(out.top.max(initial=0)))
        return out

    def extend(self, other: "KVCache") -> None:
        """Append `other`'s rows (sequences joining a batch)."""
        if (other.layer_types, other.window, other.max_rollback) != (self.layer_types, self.window, self.max_rollback):
            raise CacheError("cannot join caches of different models or rollback budgets")
        capacity = max(self.tracks[FULL].capacity, other.tracks[FULL].capacity)
        self.sizer.resize(capacity)
        other.sizer.resize(capacity)
        for name, track in self.tracks.items():
            track.pos = mx.concatenate([track.pos, other.tracks[name].pos])
        for bufs, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for i, (mine, their) in enumerate(zip(bufs, theirs)):
                if mine is not None or their is not None:
                    like = mine if mine is not None else their
                    bufs[i] = mx.concatenate([_rows_or_zeros(mine, self.batch_size, like),
                                              _rows_or_zeros(their, other.batch_size, like)])
        self.offset = mx.concatenate([self.offset, other.offset])
        self.bound = np.concatenate([self.bound, other.bound])
        self.top = np.concatenate([self.top, other.top])
        self.floor = np.concatenate([self.floor, other.floor])
        self.exact = self.exact and other.exact

    # ---- memory ---------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values if a is not None)


def _empty(batch_size: int, width: int) -> mx.array:
    return mx.full((batch_size, width), -1, dtype=mx.int32)


def _rows_or_zeros(buf: Optional[mx.array], rows: int, like: mx.array) -> mx.array:
    """`buf` in `like`'s dtype, or zeros shaped like `like` for `rows` rows without K/V yet."""
    if buf is None:
        return mx.zeros((rows, *like.shape[1:]), dtype=like.dtype)
    return buf.astype(like.dtype)


@small  # one kernel per track: slots at or past each row's new length are emptied
def _forget(positions: list, offset: mx.array) -> list:
    row = offset[:, None]  # one view for every track
    return [mx.where(pos >= row, -1, pos) for pos in positions]


@small  # one kernel for the comparisons, per step and attention type
def _visible(kpos: mx.array, qpos: mx.array, window: Optional[int], blocks: Optional[tuple] = None) -> mx.array:
    """(B, 1, L, T): key slot at kpos is visible to the query at qpos (also a later key of the
    query's block, `KVCache.begin`)."""
    k, q = kpos[:, None, :], qpos[:, :, None]
    visible = (k >= 0) & (k <= q)
    if blocks is not None:
        qb, kb = _block_of(qpos, *blocks), _block_of(kpos, *blocks)
        visible = visible | ((k >= 0) & (qb[:, :, None] == kb[:, None, :]) & (qb[:, :, None] >= 0))
    if window is not None:
        visible = visible & (k > q - window)
    return visible[:, None]


def _block_of(pos: mx.array, starts: mx.array, ends: mx.array) -> mx.array:
    """(B, N): index of the run holding each position (B, N), -1 for none (runs do not overlap)."""
    inside = (pos[:, :, None] >= starts[:, None, :]) & (pos[:, :, None] < ends[:, None, :])
    index = mx.arange(starts.shape[1], dtype=mx.int32)
    return mx.max(mx.where(inside, index, -1), axis=-1)


def _fit(buf: mx.array, capacity: int, fill, axis: int) -> mx.array:
    """`buf` cut or padded with `fill` to `capacity` along `axis`."""
    size = buf.shape[axis]
    if capacity <= size:
        index = [slice(None)] * buf.ndim
        index[axis] = slice(0, capacity)
        return buf[tuple(index)]
    shape = list(buf.shape)
    shape[axis] = capacity - size
    return mx.concatenate([buf, mx.full(shape, fill, dtype=buf.dtype)], axis=axis)
