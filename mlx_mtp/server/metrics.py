"""`GET /metrics`: the engine's counters in Prometheus' text format.

Names follow vLLM's (`vllm:spec_decode_num_drafts` and friends) under our own `mlx_mtp:`
prefix, so a vLLM dashboard needs only the prefix changed.
"""

from __future__ import annotations

from typing import Optional

PREFIX = "mlx_mtp:"
# (engine key, metric name, type, help)
METRICS = [
    ("requests_running", "num_requests_running", "gauge", "Requests generating now."),
    ("requests_waiting", "num_requests_waiting", "gauge", "Requests waiting for a row."),
    ("requests_total", "requests_total", "counter", "Requests accepted since start."),
    ("prompt_tokens_total", "prompt_tokens_total", "counter", "Prompt tokens prefilled."),
    ("generation_tokens_total", "generation_tokens_total", "counter", "Tokens generated."),
    ("spec_drafts", "spec_decode_num_drafts_total", "counter", "Verify forwards that carried drafts."),
    ("spec_draft_tokens", "spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed."),
    ("spec_accepted_tokens", "spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted."),
    ("prefix_cache_queries", "prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits_total", "counter", "Prompt tokens restored from the prefix cache."),
    ("prefix_cache_bytes", "prefix_cache_bytes", "gauge", "Bytes of K/V the prefix cache holds."),
    ("prefix_cache_states", "prefix_cache_states", "gauge", "States the prefix cache can restore."),
    ("prefix_cache_disk_hits", "prefix_cache_disk_hits_total", "counter", "Requests that resumed from a state on disk."),
    ("prefix_cache_disk_hit_tokens", "prefix_cache_disk_hit_tokens_total", "counter",
     "Prompt tokens restored from states on disk."),
    ("prefix_cache_disk_misses", "prefix_cache_disk_misses_total", "counter",
     "Requests for which the disk held no state deeper than memory."),
    ("prefix_cache_disk_writes", "prefix_cache_disk_writes_total", "counter", "States written to disk."),
    ("prefix_cache_disk_evictions", "prefix_cache_disk_evictions_total", "counter",
     "Files removed from the prefix cache's directory to stay within its budget."),
    ("prefix_cache_disk_corrupt", "prefix_cache_disk_corrupt_total", "counter",
     "Files found torn or corrupt on disk (and removed)."),
    ("prefix_cache_disk_bytes", "prefix_cache_disk_bytes", "gauge", "Bytes in the prefix cache's directory."),
    ("prefix_cache_disk_states", "prefix_cache_disk_states", "gauge", "States on disk the prefix cache can restore."),
    ("active_memory_bytes", "memory_active_bytes", "gauge", "Bytes of MLX arrays alive."),
    ("cache_memory_bytes", "memory_cache_bytes", "gauge", "Bytes MLX keeps in its buffer cache for reuse."),
    ("peak_memory_bytes", "memory_peak_bytes", "gauge", "Most bytes of MLX arrays alive at once."),
]
PER_POS = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"


POOL = [
    ("models_loaded", "gauge", "Models loaded (each a target with its drafter)."),
    ("pool_reserved_bytes", "gauge", "Bytes the loaded models reserve: weights, KV cache and prefix cache."),
    ("pool_budget_bytes", "gauge", "Bytes all loaded models may reserve together (--memory-gb)."),
]


def render(values: dict, pool: Optional[dict] = None) -> str:
    """Prometheus exposition text (format 0.0.4) for `Engine.metrics()` (the start model's), and the
    pool's gauges where the server has a pool."""
    lines = []
    for name, kind, help_text in POOL if pool is not None else ():
        lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name} {pool[name]}"]
    for key, name, kind, help_text in METRICS:
        if key.startswith("prefix_cache_disk_") and key not in values:  # no disk tier
            continue
        lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}",
                  f"{PREFIX}{name} {values.get(key, 0)}"]
    lines += [f"# HELP {PER_POS} Draft tokens accepted at each draft position.", f"# TYPE {PER_POS} counter"]
    per_pos = values.get("spec_accepted_per_pos", [])
    lines += [f'{PER_POS}{{position="{i}"}} {n}' for i, n in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict:
    """Samples of a metrics page by name (labels kept in the name): for tests and the load test."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
