"""One rank of the distributed training test (tests/python/test_distributed.py), launched by
``torchrun --nproc_per_node N``: trains a model through memplan.torch.offload with parameters and
optimizer on NVMe, each rank on its slice of every global batch, and writes its losses (the global
batch's mean loss) and its engine statistics to <out>/rank<r>.json.

Also importable: ``build(model)`` and ``global_batches(...)`` are what the single-process reference
uses, so both runs see the same model and data.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.environ["MEMPLAN_SOURCE_DIR"], "examples"))
import train_gpt  # noqa: E402

VOCAB = 128
SEQ = 16


def build(kind):
    """The model, identical in every process (seeded)."""
    torch.manual_seed(0)
    if kind == "gpt":
        model = train_gpt.GPT(vocab=VOCAB, hidden=64, layers=2, heads=4, seq=SEQ)
        return model, lambda m, tokens: m(tokens)
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ + 1,
        use_cache=False)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config)
    return model, lambda m, tokens: m(input_ids=tokens, labels=tokens).loss


def global_batches(steps, batch):
    return list(train_gpt.batches(steps, batch, SEQ + 1, VOCAB, seed=3))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("gpt", "llama"), required=True)
    p.add_argument("--nvme", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--resume", action="store_true", help="continue from the stores in --nvme")
    p.add_argument("--kill-step", type=int, default=-1,
                   help="at this step, --kill-rank SIGKILLs itself after its backward, once the "
                        "other ranks have committed the step (so they are one step ahead)")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--save", help="save() the trained model here; rank 0 also writes the "
                                  "trained model's logits on a fixed input to <out>/logits.pt")
    p.add_argument("--clip", type=float, default=0.0,
                   help="torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) every step; "
                        "the norms are written with the losses")
    p.add_argument("--checkpoint-at", type=int, default=-1,
                   help="after this many steps, save_checkpoint(<out>/ckpt) (every rank)")
    args = p.parse_args(argv)

    import torch.distributed as dist
    import memplan.torch
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_of = build(args.model)
    trainer = memplan.torch.offload(model, args.nvme, lr=args.lr, weight_decay=0.01,
                                    sub_group_elements=16 << 10, param_buffer_bytes=256 << 10,
                                    direct=False, resume=args.resume)
    local = args.batch // world
    losses, norms = [], []
    marker = os.path.join(args.out, "committed")
    for step, tokens in enumerate(global_batches(args.steps, args.batch)):
        if step < trainer.resumed_step:
            continue  # seen before the restart
        loss = loss_of(model, tokens[rank * local:(rank + 1) * local])
        loss.backward()
        if args.clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
        if step == args.kill_step and rank == args.kill_rank:
            deadline = time.time() + 60
            while not os.path.exists(marker) and time.time() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step()
        if step == args.kill_step and rank != args.kill_rank:
            with open(marker, "w", encoding="utf-8") as f:
                f.write(str(step))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if step + 1 == args.checkpoint_at:
            trainer.save_checkpoint(os.path.join(args.out, "ckpt"))
    stats = trainer.stats()
    weights = trainer.master_weights()
    if args.save:
        trainer.save(args.save)
    resumed_step = trainer.resumed_step
    trainer.close()
    if args.save and rank == 0:
        with torch.no_grad():
            probe = global_batches(1, 2)[0]
            torch.save(model(input_ids=probe).logits, os.path.join(args.out, "logits.pt"))
    checksum = sum(float(w.double().sum()) for w in weights.values())
    if rank == 0:
        torch.save(weights, os.path.join(args.out, "weights.pt"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "world_size": world, "losses": losses, "stats": stats,
                   "checksum": checksum, "resumed_step": resumed_step, "norms": norms}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
