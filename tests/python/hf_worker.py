"""One rank of test_hf_trainer.py's 2-rank runs, under ``torchrun --nproc_per_node 2``: every
matrix cell (hf_cases.CELLS) in one launch, the plain Trainer (DistributedDataParallel) and
MemplanTrainer (ZeRO-3 in memplan's engine) each, their logs written to <out>/cells-rank<r>.json.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_cases  # noqa: E402


def main():
    import torch.distributed as dist
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for model, precision, clip in hf_cases.CELLS:
        start = time.time()
        cell = hf_cases.run_cell(model, precision, clip, world=world, tmp=out)
        cell["seconds"] = time.time() - start
        results[f"{model}/{precision}/{clip}"] = cell
    with open(os.path.join(out, f"cells-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
