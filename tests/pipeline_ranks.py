"""One rank of the two-rank pipeline group that `test_pipeline.py` starts.

    python tests/pipeline_ranks.py OUT DENSE_DIR check   # rank 0 runs pipeline_jobs, writes OUT/jobs.json
    python tests/pipeline_ranks.py OUT DENSE_DIR stall   # rank 0 generates until stopped from outside

Every rank writes OUT/rank<r>.json: its layers and the weight bytes it holds.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_jobs import TINY, one_row, prompts, run_jobs  # noqa: E402

from mlx_mtp.distributed import pipeline  # noqa: E402
from mlx_mtp.distributed.group import launched  # noqa: E402


def stall(loaded) -> None:
    print("generating", flush=True)
    while True:
        one_row(loaded, prompts("dense", 1)[0], draft_tokens=3)


def main() -> None:
    out, dense, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    group = launched()
    models = {"dense": dense, "moe": TINY / "moe" / "target"} if mode == "check" else {"dense": dense}
    results, ranks = {}, {}
    for variant, target in models.items():
        loaded = pipeline.load(target, TINY / variant / "drafter", None, group)
        stage = loaded.target.pipeline
        ranks[variant] = dict(span=stage.span, weight_bytes=stage.weight_bytes, active=mx.get_active_memory())
        if not group.leader:
            stage.follow(loaded)
            continue
        results[variant] = run_jobs(loaded, variant) if mode == "check" else stall(loaded)
        stage.done()
    (out / f"rank{group.rank}.json").write_text(json.dumps(ranks))
    if group.leader:
        (out / "jobs.json").write_text(json.dumps(results))
    group.close()


if __name__ == "__main__":
    main()
