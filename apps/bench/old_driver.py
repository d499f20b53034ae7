"""A request server for an older checkout of mlx_mtp, run as a child process by `engine` mode.

    PYTHONPATH=OLD_TREE python apps/bench/old_driver.py REGIME TARGET_DIR DRAFTER_DIR

It imports mlx_mtp from OLD_TREE (PYTHONPATH comes first), loads the pair as stored, and
answers one JSON line per request on stdin, {"prompt": [ids], "max_tokens": n, "mtp": bool},
with {"tokens": [...], "seconds": s, "ttft": s, "stats": {...}}: one request through that
checkout's `generate_tokens` (the single-request driver its Engine ran, on this process's main
thread: that Engine's worker thread fails on MLX 0.32 with "There is no Stream(cpu, 0) in current
thread", fixed by the commit after it), timed from the call to its last token. Stop tokens are
disabled (every request generates exactly max_tokens). It imports nothing from apps/ but the regime module,
loaded from its file, so the old tree's own apps/ cannot shadow it.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path


def main() -> None:
    regime_name, target_dir, drafter_dir = sys.argv[1:4]
    spec = importlib.util.spec_from_file_location("bench_regime", Path(__file__).with_name("regime.py"))
    regime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regime)
    regime.setup(regime_name)

    import mlx_mtp
    from mlx_mtp.generate import generate_tokens
    from mlx_mtp.stats import Stats

    loaded = mlx_mtp.load(target_dir, drafter_dir)
    print(json.dumps({"ready": True, "mlx_mtp": mlx_mtp.__file__, "regime": regime.describe()["label"]}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        stats = Stats()
        start = time.perf_counter()
        tokens, first = [], None
        for token, _ in generate_tokens(loaded.target, ask["prompt"], drafter=loaded.drafter if ask["mtp"] else None,
                                        max_tokens=ask["max_tokens"], stats=stats):
            tokens.append(token)
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        print(json.dumps({"tokens": tokens, "seconds": end - start, "ttft": first - start,
                          "stats": {"rounds": stats.rounds, "accepted": stats.accepted,
                                    "plain_steps": stats.plain_steps}}), flush=True)


if __name__ == "__main__":
    main()
