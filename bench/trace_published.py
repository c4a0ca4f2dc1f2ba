#!/usr/bin/env python3
"""The published runs of issue 29's "Why" table (and tests/accuracy/published.json's torchtune
and Hugging Face rows) that memplan.trace can run, traced at full depth, next to what was
measured. A trace gives *allocated* bytes (max_memory_allocated); a published nvidia-smi figure
also holds the CUDA context and the caching allocator's reserved-over-allocated, and a
"reserved" figure the latter: the table says which each is, and memplan's estimator adds those
items.

    PYTHONPATH=integration/python python3 bench/trace_published.py [--json out.json]

Runs that the tracer cannot express are listed with the reason (FSDP outside torchtitan, a
checkpointing policy not traced)."""

import argparse
import json
import sys
import time

RUNS = [
    {"id": "torchtune-llama3.1-8b-lora-4090",
     "source": "issue 29 table: torchtune LoRA recipe, Llama-3.1-8B, one RTX 4090, 2 x 2048 "
               "packed, AC on", "measured_gib": 16.2, "kind": "unstated (torchtune logs "
               "peak allocated, reserved and active)",
     "setup": {"framework": "torchtune", "model": "llama-3.1-8b", "micro_batch": 2,
               "seq_len": 2048, "precision": "bf16", "checkpointing": "full",
               "loss": "chunked", "optimizer": "adamw-fused", "lora_rank": 8,
               "lora_alpha": 16, "gpu": "rtx4090",
               "lora_targets": ["q_proj", "v_proj", "output_proj", "mlp"]}},
    {"id": "torchtune-llama3.1-8b-qlora-4090",
     "source": "issue 29 table: torchtune QLoRA recipe, same", "measured_gib": 7.4,
     "kind": "unstated",
     "setup": {"framework": "torchtune", "model": "llama-3.1-8b", "micro_batch": 2,
               "seq_len": 2048, "precision": "bf16", "checkpointing": "full",
               "loss": "chunked", "optimizer": "adamw-fused", "lora_rank": 8,
               "lora_alpha": 16, "qlora": True, "gpu": "rtx4090",
               "lora_targets": ["q_proj", "v_proj", "output_proj", "mlp"]}},
    {"id": "torchtune-llama2-7b-sgd",
     "source": "published.json torchtune-llama2-7b-sgd (torchtune PR 389), seq 256 assumed",
     "measured_gib": 27.83e9 / 2**30, "kind": "max_memory_allocated",
     "setup": {"framework": "torchtune", "model": "llama-2-7b", "micro_batch": 1,
               "seq_len": 256, "precision": "bf16", "checkpointing": "none", "loss": "full",
               "optimizer": "sgd", "gpu": "a100"}},
    {"id": "torchtune-llama2-7b-adamw",
     "source": "published.json torchtune-llama2-7b-adamw (AdamW foreach=False), seq 256 "
               "assumed", "measured_gib": 54.0e9 / 2**30, "kind": "max_memory_allocated",
     "setup": {"framework": "torchtune", "model": "llama-2-7b", "micro_batch": 1,
               "seq_len": 256, "precision": "bf16", "checkpointing": "none", "loss": "full",
               "optimizer": "adamw-forloop", "gpu": "a100"}},
    {"id": "hf-trainer-bert-large-fp16-v100",
     "source": "issue 29 table: Hugging Face Trainer, BERT-large fp16, V100, batch 4 (the "
               "docs' training-anatomy page: BertForSequenceClassification, seq 512)",
     "measured_gib": 13939 / 1024, "kind": "nvidia-smi (context ~1.31 GiB + reserved)",
     "setup": {"framework": "transformers", "model": "bert-large-uncased", "micro_batch": 4,
               "seq_len": 512, "precision": "fp16-mixed", "optimizer": "adamw-forloop",
               "attention": "eager", "gpu": "v100"}},
    {"id": "torchtitan-llama3.1-8b-8xh100-sac",
     "source": "issue 29 table: torchtitan, Llama-3.1-8B, FSDP2 on 8 x H100, 2 x 8192, "
               "selective (per-op) AC; the trainer of that run computed whole logits (the "
               "chunked loss came later)", "measured_gib": 82.4,
     "kind": "reserved (torchtitan logs max reserved)",
     "setup": {"framework": "torchtitan", "model": "llama-3.1-8b", "micro_batch": 2,
               "seq_len": 8192, "ranks": 8, "precision": "bf16-mixed", "checkpointing": "op",
               "loss": "full", "optimizer": "adamw-fused", "gpu": "h100"}},
    {"id": "litgpt-llama2-7b-lora-mbs1",
     "source": "published.json litgpt-llama2-7b-lora-mbs1 (bf16-true, r 8, q/v, seq 1304)",
     "measured_gib": 21.3e9 / 2**30, "kind": "max_memory_allocated",
     "setup": {"framework": "litgpt", "model": "llama-2-7b", "micro_batch": 1,
               "seq_len": 1304, "precision": "bf16", "loss": "chunked", "lora_rank": 8,
               "lora_alpha": 16, "gpu": "a100"}},
]

NOT_TRACED = [
    ("fms-fsdp Llama-2-13B, 128 x A100, 2 x 4096, every k-th block", "fms-fsdp's own FSDP "
     "wrapping: the tracer simulates ranks for torchtitan only"),
    ("llm-foundry MPT-1B / MPT-7B on 8 x A100", "Composer's FSDP over 8 "
     "GPUs (ranks are simulated for torchtitan only); the unsharded single-GPU trace is in "
     "the grid (llm-foundry/mpt-*)"),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the traces here")
    parser.add_argument("--only", help="run the ids containing this")
    args = parser.parse_args(argv)
    from memplan import trace
    rows = []
    print("%-36s %10s %10s %8s  %s" % ("run", "measured", "traced", "ratio", "what the measured "
                                       "figure is; where the trace peaks"))
    for run in RUNS:
        if args.only and args.only not in run["id"]:
            continue
        t0 = time.time()
        result = trace.run(run["setup"])
        traced = result["peak"]["bytes"] / 2**30
        rows.append({"run": run, "trace": {k: result[k] for k in ("peak", "phases", "model",
                                                                  "workspaces")},
                     "seconds": round(time.time() - t0, 1)})
        print("%-36s %10.2f %10.2f %8.3f  %s; %s of step 2 (%s)" % (
            run["id"], run["measured_gib"], traced, traced / run["measured_gib"], run["kind"],
            result["peak"]["phase"], result["peak"]["op"]), flush=True)
    for what, why in NOT_TRACED:
        print("not traced: %s: %s" % (what, why))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
