"""The prefix cache: a request starts from the deepest stored state its prompt shares with an
earlier one, and prefills only the rest.

States live in a radix tree of token spans. A node holds the K/V of its span's positions: of
every position for full-attention layers, and for sliding-window layers only of the tails that
checkpoints keep. A sliding layer's ring forgets positions older than its window, so the state
after m tokens can be rebuilt exactly only where the sliding K/V of the W + 1 positions before m
(what attention and the drafter still see) were kept: from those and the full-attention K/V of
every position before m. The driver leaves checkpoints where prompts tend to part ways: after
each turn of a rendered conversation, before a prompt's last token and after it, and at the end
of each reply; each keeps that tail and what else its row's ring still held, so the state a few
positions before it can be rebuilt too (a template that trims a reply's end parts ways there).
A later request resumes at the deepest such position
within what it shares: an agent's next call after its previous prompt or reply, another client
after the common system prompt. A template that re-renders history (thinking stripped, text
trimmed) parts ways inside the last reply: the re-rendered tail is prefilled again, the rest
reused.

Memory: a position's K/V is held once however many checkpoints share it, and a byte budget
evicts the least recently used checkpoints (with whatever only they needed) first. A client may
pin checkpoints (a conversation keeps its latest turn); eviction never touches those. Rows in a
batch hold their own copy (a batch is one array per layer), so a hit copies its prefix into the
row: a copy, not a prefill. Sizes are counted from the model's config rather than the arrays at
hand, so the ranks of a pipeline group, each holding some layers, count and evict alike.

Disk: with a `DiskTier` (`disk.py`) every state kept is also written to a directory, and a
request whose deepest match is deeper there than in memory loads it (and keeps it in memory too).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

from .kv import FULL, SLIDING, KVCache
from .disk import DiskTier


@dataclasses.dataclass(eq=False)
class _Node:
    start: int  # position of the span's first token
    tokens: np.ndarray  # int32 token ids of the span
    parent: Optional[_Node]
    children: dict = dataclasses.field(default_factory=dict)  # first token -> node
    full: dict = dataclasses.field(default_factory=dict)  # layer -> (K, V) of every position of the span
    sliding: dict = dataclasses.field(default_factory=dict)  # layer -> (K, V) of positions held .. end - 1
    held: int = 0  # the first position whose sliding K/V is held (end: none)
    anchor: float = math.inf  # a checkpoint: the first position whose sliding K/V it keeps
    pins: int = 0
    reach: float = math.inf  # the lowest anchor at or below this node

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclasses.dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hits: int = 0  # of which were restored instead of prefilled (prefix_cache_hits)


@dataclasses.dataclass
class _Hit:
    path: list  # the nodes from the root's child down to the one holding position length - 1
    length: int


class PrefixCache:
    """Stored states of one model, shared by every request of an Engine.

    Args:
        target: the target model (its cache layout and K/V sizes).
        budget: bytes of K/V the cache may hold (pinned checkpoints aside); 0 keeps nothing
            that is not pinned.
        disk: where states are also written and looked up (None: memory only).
    """

    def __init__(self, target, budget: int, disk: Optional[DiskTier] = None):
        if budget < 0:
            raise ValueError(f"a prefix cache budget must be >= 0 bytes, got {budget}")
        self.window = target.make_cache(1).window
        self.token_bytes = token_bytes(target)
        self.budget = int(budget)
        self.stats = PrefixStats()
        self.disk = disk
        self.clear()

    def clear(self) -> None:
        """Forget every state, pinned ones included."""
        self.root = _Node(0, np.zeros(0, dtype=np.int32), None)
        self.nbytes = 0
        self._lru: dict[_Node, None] = {}  # checkpoints, least recently used first
        self._pins: dict[Hashable, list[_Node]] = {}

    @property
    def checkpoints(self) -> int:
        return len(self._lru)

    def metrics(self) -> dict:
        """Counters for monitoring (`Engine.metrics`), the disk tier's included."""
        out = dict(prefix_cache_queries=self.stats.queries, prefix_cache_hits=self.stats.hits,
                   prefix_cache_bytes=self.nbytes, prefix_cache_states=self.checkpoints)
        if self.disk is not None:
            out.update({f"prefix_cache_disk_{k}": v for k, v in dataclasses.asdict(self.disk.stats).items()},
                       prefix_cache_disk_states=self.disk.states)
        return out

    # ---- resuming ----------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` `resume` would restore (0: none)."""
        ids = np.asarray(tokens, dtype=np.int32)
        length = self._deepest(ids).length
        found = self.disk.lookup(ids, length) if self.disk is not None else None
        return found[1] if found else length

    def resume(self, tokens: Sequence[int], cache: KVCache) -> int:
        """Fill the empty one-row `cache` with the deepest state on `tokens`' path that leaves
        at least one token to feed (the next token comes out of a forward over it). Returns how
        many tokens it holds (0: nothing stored applies, the cache stays empty)."""
        ids = np.asarray(tokens, dtype=np.int32)
        hit = self._deepest(ids)
        self.stats.queries += len(ids)
        if self.disk is not None and (m := self.disk.resume(ids, cache, beyond=hit.length)):
            self.stats.hits += m
            if self.budget:
                self._keep(ids[:m], cache)  # the next request finds it in memory
            return m
        if not hit.length:
            return 0
        self.stats.hits += hit.length
        m, last = hit.length, hit.path[-1]
        lo = max(m - self.window - 1, 0)
        self._touch_keepers(last, lo)
        full = {layer: tuple(mx.concatenate([_span(n.full[layer][j], n, n.start, m) for n in hit.path], axis=2)
                             for j in (0, 1)) for layer in last.full}
        tail = [n for n in hit.path if n.end > lo]
        sliding = {layer: tuple(mx.concatenate([_span(n.sliding[layer][j], n, max(lo, n.start), m, n.held)
                                                for n in tail], axis=2) for j in (0, 1))
                   for layer in last.sliding}
        cache.resume(m, full, sliding)
        return m

    def _deepest(self, ids: np.ndarray) -> _Hit:
        """The deepest position m < len(ids) on ids' path whose state can be rebuilt: the path
        holds the sliding K/V of the W + 1 positions before it."""
        best, path, node, pos = _Hit([], 0), [], self.root, 0
        run = 0  # positions run .. pos - 1 all have their sliding K/V held
        limit = len(ids) - 1
        while pos < limit and (child := node.children.get(int(ids[pos]))) is not None:
            n = _common(child.tokens, ids[pos:])
            path.append(child)
            run = child.held if child.held > child.start else run
            deepest = min(child.start + n, limit)
            if deepest >= max(run + self.window + 1 if run else 0, child.start + 1):
                best = _Hit(list(path), deepest)
            if n < len(child.tokens):
                break
            node, pos = child, child.end
        return best

    def _touch_keepers(self, node: _Node, lo: int) -> None:
        """Mark as used the checkpoints that keep the tail from `lo` on alive."""
        stack = [node]
        while stack:
            n = stack.pop()
            if n.anchor <= lo:
                self._touch(n)
            stack += [c for c in n.children.values() if c.reach <= lo]

    # ---- storing -----------------------------------------------------------------------------

    def store(self, tokens: Sequence[int], cache: KVCache, pin: Optional[Hashable] = None) -> Optional[_Node]:
        """Keep the state of the one-row `cache`, which holds `tokens`, as a checkpoint; pinned
        by `pin` if given. Returns the checkpoint, or None when the budget leaves it no room."""
        if not len(tokens):
            return None
        ids = np.asarray(tokens, dtype=np.int32)
        if self.disk is not None:
            self.disk.save(ids, cache, max(int(cache.oldest()[0]), 0))
        if pin is None and self.budget == 0:
            return None
        return self._keep(ids, cache, pin)

    def _keep(self, ids: np.ndarray, cache: KVCache, pin: Optional[Hashable] = None) -> Optional[_Node]:
        node = self._insert(ids, cache)
        anchor = max(int(cache.oldest()[0]), 0)  # what the ring holds: the window's tail at least
        self._hold(node, anchor, cache)
        node.anchor = min(node.anchor, anchor)
        for n in self._path(node):
            n.reach = min(n.reach, anchor)
        self._touch(node)
        if pin is not None:
            node.pins += 1
            self._pins.setdefault(pin, []).append(node)
        self.evict(self.budget)
        return node if node.anchor < math.inf else None

    def _insert(self, ids: np.ndarray, cache: KVCache) -> _Node:
        """The node ending after `ids`, made (or split off) as needed; new spans' full-attention
        K/V come from `cache`."""
        node, pos = self.root, 0
        while pos < len(ids) and (child := node.children.get(int(ids[pos]))) is not None:
            n = _common(child.tokens, ids[pos:])
            if n < len(child.tokens):
                child = self._split(child, child.start + n)
            node, pos = child, child.end
        if pos == len(ids):
            return node
        new = _Node(pos, ids[pos:].copy(), node, full=cache.read(pos, len(ids), FULL), held=len(ids))
        node.children[int(ids[pos])] = new
        self.nbytes += (new.end - new.start) * self.token_bytes[FULL]
        return new

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` at position `at`; returns the new upper part."""
        cut, below = at - node.start, max(at - node.held, 0)  # sliding positions held above `at`
        upper = _Node(node.start, node.tokens[:cut].copy(), node.parent, {int(node.tokens[cut]): node},
                      _cut(node.full, 0, cut), _cut(node.sliding, 0, below) if below else {}, min(node.held, at),
                      reach=node.reach)
        node.parent.children[int(node.tokens[0])] = upper
        node.full = _cut(node.full, cut, None)
        node.sliding = _cut(node.sliding, below, None) if below else node.sliding
        node.start, node.tokens, node.held, node.parent = at, node.tokens[cut:].copy(), max(node.held, at), upper
        return upper

    def _hold(self, node: _Node, lo: int, cache: KVCache) -> None:
        """Make the path to `node` hold the sliding K/V of every position from `lo` on."""
        while node is not self.root and node.end > lo:
            first = max(lo, node.start)
            if first < node.held:
                got = cache.read(first, node.held, SLIDING)
                node.sliding = {layer: tuple(mx.concatenate([kv[j], node.sliding[layer][j]], axis=2)
                                             if layer in node.sliding else kv[j] for j in (0, 1))
                                for layer, kv in got.items()}
                self.nbytes += (node.held - first) * self.token_bytes[SLIDING]
                node.held = first
            node = node.parent

    # ---- pins and eviction -------------------------------------------------------------------

    def release(self, pin: Hashable, keep: Iterable[Optional[_Node]] = ()) -> None:
        """Unpin what `pin` pinned, but for `keep`; unpinned states are then subject to the budget."""
        keep = {id(n) for n in keep if n is not None}
        kept = []
        for node in self._pins.pop(pin, []):
            if id(node) in keep:
                kept.append(node)
            else:
                node.pins -= 1
        if kept:
            self._pins[pin] = kept
        self.evict(self.budget)

    def evict(self, limit: int) -> None:
        """Drop least recently used checkpoints that nobody pins until at most `limit` bytes are held."""
        for node in list(self._lru):
            if self.nbytes <= limit:
                return
            if not node.pins:
                self._drop(node)

    def _drop(self, node: _Node) -> None:
        node.anchor = math.inf
        del self._lru[node]
        while node is not self.root and node.anchor == math.inf and not node.children:  # nothing needs it
            del node.parent.children[int(node.tokens[0])]
            self.nbytes -= (node.end - node.start) * self.token_bytes[FULL] + self._sliding_bytes(node)
            node = node.parent
        for n in reversed(self._path(node)):  # what the checkpoints left below it still need
            n.reach = min([n.anchor, *(c.reach for c in n.children.values())])
            want = int(min(n.end, max(n.start, n.reach)))
            if n.held < want:
                self.nbytes -= (want - n.held) * self.token_bytes[SLIDING]
                n.sliding, n.held = _cut(n.sliding, want - n.held, None), want

    def _sliding_bytes(self, node: _Node) -> int:
        return (node.end - node.held) * self.token_bytes[SLIDING]

    def _touch(self, node: _Node) -> None:
        self._lru.pop(node, None)
        self._lru[node] = None

    def _path(self, node: _Node) -> list[_Node]:
        """The nodes from the root's child down to `node`."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]


def token_bytes(target) -> dict[str, int]:
    """K/V bytes of one position for each attention type, over every cached layer of the model
    (alike on every rank of a pipeline group, whichever layers it holds)."""
    cfg = target.config
    itemsize = target.embed(mx.zeros((1, 1), dtype=mx.int32)).dtype.size  # lazy: only the dtype is read
    out = {FULL: 0, SLIDING: 0}
    for i, kind in enumerate(target.make_cache(1).layer_types):
        out[kind] += 2 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) * itemsize
    return out


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _span(a: mx.array, node: _Node, start: int, stop: int, first: Optional[int] = None) -> mx.array:
    """Positions start .. stop - 1 (clipped to the node) of `a`, whose first entry is position
    `first` (default: the node's start)."""
    first = node.start if first is None else first
    return a[:, :, max(start, node.start) - first : min(stop, node.end) - first]


def _cut(kv: dict, start: int, stop: Optional[int]) -> dict:
    """Copies of positions start:stop of each layer's (K, V): a view would keep the whole array alive."""
    return {layer: tuple(mx.contiguous(a[:, :, start:stop]) for a in pair) for layer, pair in kv.items()}
