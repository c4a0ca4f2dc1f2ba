#!/usr/bin/env python3
"""Replay a training step's allocations through PyTorch's CUDA caching allocator, without a GPU.

    $MEMPLAN_MODERN_VENV/bin/python bench/allocator_replay.py [--config CONFIG.json | --bert-large]
        [--batch 4] [--seq 512] [--grad-accum 1] [--checkpointing] [--torch-1.10-softmax]
        [--optimizer hf|torch] [--steps 3] [--dtype fp32|bf16] [--sdpa]

Builds the Transformers model on the meta device (no memory, no compute), runs forward, backward
and the optimizer step under a TorchDispatchMode that records every storage an op creates and
when it is freed, in order, then replays that sequence through the caching allocator's rules
(c10/cuda/CUDACachingAllocator.cpp, defaults: 512-byte rounding; requests up to 1 MiB from 2 MiB
segments, up to 10 MiB from 20 MiB segments, larger ones rounded to 2 MiB; best fit; a block is
split when more than 1 MiB (large) or 512 bytes (small) remains; freed blocks merge with free
neighbours; segments are never released). It prints peak allocated (torch.cuda.
max_memory_allocated) and peak reserved (what nvidia-smi shows beside the CUDA context) after
each step.

What meta differs in, and how it is corrected: dropout on non-CUDA devices is decomposed with a
float mask; CUDA runs the fused native_dropout with a bool mask, so dropout is routed to it.
--torch-1.10-softmax makes softmax keep its input as PyTorch before 1.11 did (pytorch#64000).
Kernel-internal workspaces (cuBLAS) are not seen.

This is the evidence behind tests/accuracy/published.json's allocator notes (the Hugging Face
anatomy rows: --bert-large --torch-1.10-softmax --optimizer hf with --batch 4; --batch 1
--grad-accum 4; and --checkpointing) and behind memplan's allocator margin: reserved exceeds
allocated by a few percent of the activations for BERT-large (2-7%) and by about 11% for GPT-2
Large at 8 x 256 tokens. Needs torch >= 2.1 and transformers (the modern venv).
"""
import argparse
import bisect
import itertools
import json
import sys
import weakref

MIB = 1 << 20
SMALL_SIZE = 1 * MIB         # kSmallSize: requests up to this use the small pool
SMALL_BUFFER = 2 * MIB       # kSmallBuffer: segment size for the small pool
LARGE_BUFFER = 20 * MIB      # kLargeBuffer: segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB   # kMinLargeAlloc
ROUND_LARGE = 2 * MIB        # kRoundLarge
MIN_BLOCK = 512              # kMinBlockSize

BERT_LARGE = {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24,
              "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522,
              "max_position_embeddings": 512, "hidden_act": "gelu",
              "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}


class Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next", "small")

    def __init__(self, segment, offset, size, small):
        self.segment, self.offset, self.size, self.small = segment, offset, size, small
        self.free, self.prev, self.next = True, None, None

    def key(self):
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """The caching allocator's block bookkeeping for one device and one stream."""

    def __init__(self):
        self.pools = {True: [], False: []}  # sorted (size, segment, offset) -> best fit
        self.by_key = {}
        self.live = {}
        self.segments = 0
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    @staticmethod
    def round_size(n):
        return MIN_BLOCK if n < MIN_BLOCK else (n + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK

    @staticmethod
    def segment_size(n):
        if n <= SMALL_SIZE:
            return SMALL_BUFFER
        if n < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return (n + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE

    def _insert(self, block):
        key = block.key()
        bisect.insort(self.pools[block.small], key)
        self.by_key[(block.small, key)] = block

    def _remove(self, block):
        key = block.key()
        pool = self.pools[block.small]
        del pool[bisect.bisect_left(pool, key)]
        del self.by_key[(block.small, key)]

    def malloc(self, uid, nbytes):
        size = self.round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            block = self.by_key.pop((small, pool.pop(i)))
        else:
            self.segments += 1
            block = Block(self.segments, 0, self.segment_size(size), small)
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = Block(block.segment, block.offset + size, remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        self.live[uid] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, uid):
        block = self.live.pop(uid, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for other in (block.prev, block.next):
            if other is None or not other.free:
                continue
            self._remove(other)
            if other is block.prev:
                block.offset, block.prev = other.offset, other.prev
                if other.prev is not None:
                    other.prev.next = block
            else:
                block.next = other.next
                if other.next is not None:
                    other.next.prev = block
            block.size += other.size
        self._insert(block)


def trace_training(args):
    """The allocation events of `args.steps` training steps on the meta device."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    import transformers

    def cuda_dropout(input, p=0.5, training=True, inplace=False):
        return torch.native_dropout(input, p, True)[0] if training and p > 0 else input
    F.dropout = cuda_dropout

    if args.torch_110_softmax:
        class SoftmaxKeepingInput(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, dim):
                y = torch._softmax(x, dim, False)
                ctx.save_for_backward(x, y)
                ctx.dim = dim
                return y

            @staticmethod
            def backward(ctx, grad):
                _, y = ctx.saved_tensors
                return torch._softmax_backward_data(grad, y, ctx.dim, y.dtype), None

        def softmax(input, dim=None, _stacklevel=3, dtype=None):
            return SoftmaxKeepingInput.apply(input if dtype is None else input.to(dtype), dim)
        F.softmax = softmax

    events = []

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = {}
            self.ids = itertools.count()

        def note(self, tensor):
            if not isinstance(tensor, torch.Tensor):
                return
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.live or storage.nbytes() == 0:
                return
            uid = next(self.ids)
            self.live[key] = uid
            events.append(("alloc", uid, storage.nbytes()))

            def freed(key=key, uid=uid, live=self.live):
                if live.get(key) == uid:
                    del live[key]
                events.append(("free", uid, 0))
            weakref.finalize(storage, freed)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                self.note(t)
            return out

    config = dict(BERT_LARGE) if args.bert_large else json.load(open(args.config))
    model_type = config.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    cfg._attn_implementation = "sdpa" if args.sdpa else "eager"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    with torch.device("meta"):
        if args.bert_large or model_type == "bert":
            model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=dtype)
        else:
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    params = list(model.parameters())
    recorder = Recorder()
    states = {}
    with recorder:
        for p in params:  # model.to("cuda"): one allocation per parameter, in order
            recorder.note(p)
        torch_adamw = torch.optim.AdamW(params, lr=1e-5, foreach=False)
        for step in range(args.steps):
            for _ in range(args.grad_accum):
                ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
                if args.bert_large or model_type == "bert":
                    labels = torch.zeros(args.batch, dtype=torch.long, device="meta")
                else:
                    labels = ids
                loss = model(input_ids=ids, labels=labels).loss
                if args.grad_accum > 1:
                    loss = loss / args.grad_accum
                loss.backward()
                del loss
            with torch.no_grad():
                if args.optimizer == "torch":
                    torch_adamw.step()
                else:  # transformers.AdamW of 2022: per tensor, one temporary (denom)
                    for p in params:
                        if p not in states:
                            states[p] = (torch.zeros_like(p), torch.zeros_like(p))
                        m, v = states[p]
                        m.mul_(0.9).add_(p.grad, alpha=0.1)
                        v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                        p.addcdiv_(m, v.sqrt().add_(1e-6), value=-1e-5)
            model.zero_grad(set_to_none=False)  # the Trainer's zero_grad in PyTorch < 2.0
            events.append(("step", step, 0))
    return events


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="a Hugging Face config.json (model_type needed)")
    src.add_argument("--bert-large", action="store_true", help="bert-large-uncased, classifier")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--optimizer", default="torch", choices=["torch", "hf"])
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--sdpa", action="store_true", help="SDPA attention (default: eager)")
    ap.add_argument("--torch-1.10-softmax", dest="torch_110_softmax", action="store_true")
    args = ap.parse_args()
    allocator = CachingAllocator()
    gib = float(1 << 30)
    for kind, uid, nbytes in trace_training(args):
        if kind == "alloc":
            allocator.malloc(uid, nbytes)
        elif kind == "free":
            allocator.free(uid)
        else:
            print(f"after step {uid}: peak allocated {allocator.peak_allocated / gib:.3f} GiB, "
                  f"peak reserved {allocator.peak_reserved / gib:.3f} GiB "
                  f"({allocator.segments} segments)")
    over = allocator.peak_reserved - allocator.peak_allocated
    print(f"reserved over allocated at the peak: {over / gib:.3f} GiB")


if __name__ == "__main__":
    sys.exit(main())
