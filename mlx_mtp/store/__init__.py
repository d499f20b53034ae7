"""The model store: which models an app can name, what each needs in memory, and pulls from the Hub.

A layer of its own, below the server and the pool of engines, above loading. It reads configs
and safetensors headers, never a weight.

    from mlx_mtp.store import Store

    store = Store()                       # models dir: $MLX_MTP_MODELS or ~/.cache/mlx_mtp/models,
                                          # plus the Hugging Face cache ($HF_HUB_CACHE / $HF_HOME/hub)
    for entry in store.entries():         # usable models only, by name
        entry.name, entry.aliases         # "google/gemma-4-31B-it", ("gemma4:31b",)
        entry.target.path, entry.drafter  # what `mlx_mtp.load(target.path, drafter=drafter.path)` takes
        entry.bytes                       # target + drafter tensor bytes (each: entry.target.bytes, ...)
        entry.target.tower_bytes          # of which vision/audio towers, read with the first image/audio
        entry.kv.bytes(num_ctx)           # KV of one sequence of num_ctx tokens (entry.kv.token_bytes())
    store.problems()                      # [Refused], a line each: "org/x: model.safetensors is truncated"
    entry = store.resolve("gemma4:31b")   # or "google/gemma-4-31B-it[:latest]", "hf.co/...", an alias;
                                          # NotFound (a LookupError): "model 'x' not found; near: a, b"
    store.pull("gemma4:31b", progress=callback)   # target + drafter; callback(PullEvent) per step,
                                          # event.json() is Ollama's /api/pull line; PullError on failure
    store.pull("gemma4:31b-4bit")         # the same, converted to 4-bit MLX on the way (or quantize="4bit")
    store.delete("gemma4:31b")            # target, and its drafter where no other entry uses it

What the pool of engines calls: `resolve(name)` per request (cheap: one look at the disk serves
`rescan_s` seconds, headers are re-read only when files change); `entry.bytes`, `entry.kv` and
`entry.target.tower_bytes` for admission before a load; `entry.target.path` / `entry.drafter.path`
to load; `entry.name` as the key of a loaded pair (aliases resolve to it); `entries()` for `/api/tags`
and `/v1/models` (`target.digest`, `target.modified`, `target.quantization`, `target.parameters`,
`target.config` for `details`, `model_info` and capabilities); `pull` on a worker thread, its events
into the NDJSON stream; `delete`, after which open files stay readable to the requests in flight.

Layout of the models dir: `<org>/<name>/` per Hub repo (`<name>/` for one put there by hand),
`models.json` for explicit pairs and aliases (settings.py), and hidden work directories
(`.partial/` for pulls in flight, `.trash/`). Pairing (pairing.py): models.json, else the drafter
named `<target>-assistant` (or the same model under a format suffix) whose config fits the target.
Names (names.py): Ollama's `name:tag` rules; Gemma 4 repos also answer to Ollama's `gemma4:<tag>`.
"""

from .catalog import Catalog, Entry
from .checkpoint import Checkpoint, KVShape
from .errors import NotFound, NotOnHub, PullError, Refused, StoreError
from .names import Name
from .pull import QUANTIZE, PullEvent
from .store import ENV, Store, default_hf_cache, default_models_dir, named

__all__ = ["Store", "Entry", "Catalog", "Checkpoint", "KVShape", "Name", "PullEvent", "QUANTIZE",
           "StoreError", "NotFound", "Refused", "PullError", "NotOnHub", "ENV", "default_models_dir", "default_hf_cache", "named"]
