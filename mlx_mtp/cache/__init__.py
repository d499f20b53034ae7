"""The caches: the KV cache the target writes and the drafter reads (kv.py), and the prefix
cache that starts a request from the deepest stored state its prompt shares (prefix.py),
with its disk tier (disk.py)."""

from .kv import CacheError, FIXED_LENGTH, FULL, KVCache, Ragged, SLIDING, SharedKV, Step
