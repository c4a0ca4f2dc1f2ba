#!/usr/bin/env python3
"""A model whose training states exceed this machine's RAM, trained on the drive (issue 33 item 2).

    PY=$(bash scripts/python-env.sh --modern)       # PyPI torch 2 + DeepSpeed 0.19 (the peer)
    PYTHONPATH=build/python $PY bench/larger_than_ram.py --path /var/tmp [--size auto]
        [--state-slots 1] [--steps 4] [--arms memplan,deepspeed] [--json out.json]

The model is Llama-shaped (untied token embedding and head, RMSNorm, attention with q/k/v/o
projections without biases, a SwiGLU MLP of 8/3 the hidden size rounded up to 256, vocabulary
32000; causal softmax attention without rotary embeddings), fp32, AdamW (lr 1e-4, weight decay
0.01), batch 1 x --seq tokens (default 64). Every parameter's initial values are a function of its
name alone (normal(0, 0.02) from a generator seeded by the name's CRC-32, norms 1), made by the
module's reset_parameters(): the same model whether it is built in memory, on torch's meta device
or under DeepSpeed's zero.Init, whatever the order.

--size auto (the default) picks the hidden size 2560 and the fewest layers whose AdamW training
states (16 bytes per parameter: fp32 weights, gradients and two moments) are at least --ratio
(1.55) x MemTotal, fewer where memplan's stores would leave the drive less than --min-free (8 GiB)
free, and refuses to start when even the size given does not leave it; HIDDENxLAYERS gives a size.
memplan keeps on the drive its fp32 working copy of the parameters (4 bytes per parameter), a
gradient slot (4) and the optimizer's master weights and two moments (12) in --state-slots slots:
2 (memplan's default: a step writes the other slot, so a crash mid-step resumes from the last
step; about 33 bytes per parameter with extent rounding) or 1 (rewritten in place: about 21 bytes
per parameter, and a step interrupted after its first write cannot be resumed: training restarts
from a checkpoint; Note [One slot per sub-group] in offload/optimizer_swapper.cc). The run of
record uses --state-slots 1: this machine's drive cannot hold two copies of the states of a model
whose states are 1.5 x its RAM.

Each part runs in a process of its own, watched by this one (its RSS sampled every 0.2 s and the
process killed at --rss-limit (0.8) x MemTotal; --timeout seconds at most):
  reference  Losses: the same code at a slice (--slice: hidden 256, 4 layers; vocabulary 512; the
             same seq and steps) trained through memplan.torch.offload on the drive (built on the
             meta device, as the big model) and through torch.optim.AdamW in memory; PASS when every
             step's |loss difference| <= --loss-tolerance (1e-5; both fp32 on the same batches).
  compute    The compute floor: forward + backward of the big model's shape in memory with 1 and
             2 layers (same hidden, MLP and vocabulary; torch.optim not involved), medians of 3
             after a warm-up; compute(L) = t1 + (L - 1) x (t2 - t1): the per-layer cost scaled to
             the model's layers plus the embedding, head and loss.
  memplan    The big model built on the meta device (never whole in host memory: memplan.torch
             makes each parameter's values as the engine writes its stores, Note [A model never
             materialised]) and memplan.torch.offload(model, path, lr=, weight_decay=) with its
             defaults (machine-sized buffers, overlap_optimizer "auto") and --threads optimizer
             threads; parameters and optimizer on the drive, O_DIRECT. Per step: seconds, the
             engine's NVMe bytes read and written (parameters, optimizer states, gradients) and
             /proc/self/io's read_bytes / write_bytes and /proc/diskstats for the drive under
             --path as cross-checks, the engine's step profile; VmHWM at the end.
  deepspeed  DeepSpeed ZeRO-Infinity (ZeRO-3, offload_param and offload_optimizer on NVMe under
             --path, the model built under deepspeed.zero.Init(remote_device="nvme") so that it
             is never whole in memory either), on its CPU accelerator, the same model, batches and
             steps. Where it cannot start or finish (memory, pinned limits, aio, the time limit)
             the output records the error or what killed it and the RSS it had reached.
The drive's bandwidth is measured in the same run, before the memplan part: --bw-bytes (1 GiB)
written then read back through memplan.IoFile (memplan's NVMe engine: 1 MiB blocks, queue depth
16, O_DIRECT) in a file under --path. The summary gives the states and their ratio to MemTotal,
the median step, bytes per step, the I/O time (read bytes / read bandwidth + written bytes /
write bandwidth), the compute, the step over max(compute, I/O time), peak RSS (this process's,
each part's VmHWM) and the acceptance of issue 33 (states >= 1.5 x RAM, peak RSS <= 60% of RAM,
step <= 1.3 x max(compute, I/O), losses PASS). A benchmark, not a test:
tests/python/test_larger_than_ram.py (modern environment) runs it at a toy size and checks its
output.
"""
import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VOCAB, LR, WD, HIDDEN = 32000, 1e-4, 0.01, 2560
SLICE_VOCAB = 512  # the reference's vocabulary (--slice gives its hidden size and layers)
# memplan's stores per fp32 parameter on the drive, by the optimizer's state slots: the master
# weights and two moments in one or two slots (Note [Two slots per sub-group] and Note [One slot
# per sub-group] in offload/optimizer_swapper.cc), a gradient slot, the parameters' working copy:
# 2 x 12 + 4 + 4 = 32 bytes or 12 + 4 + 4 = 20, and extent rounding (34 measured at 3.7 M
# parameters with two slots, less for larger ones).
DRIVE_BYTES_PER_PARAM = {2: 33, 1: 21}


SLOTS_WHY = {
    2: "2 (memplan's default: a step writes the other slot, so a crash mid-step resumes from the "
       "last step)",
    1: "1 (--state-slots 1: each step rewrites the optimizer's states in place, in half the drive "
       "space, giving up the torn-step safety: a step interrupted after its first write cannot be "
       "resumed and training restarts from a checkpoint; this run uses it because the drive "
       "cannot hold two copies of the states)"}


def mem_total():
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def intermediate(hidden):
    return -(-(8 * hidden // 3) // 256) * 256


def n_params(hidden, layers, vocab=VOCAB):
    inter = intermediate(hidden)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


# ---- the model -----------------------------------------------------------------------------------

def build_model_classes():
    import torch
    from torch import nn
    import torch.nn.functional as F

    def seeded(name, shape):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g) * 0.02

    class Linear(nn.Linear):
        def __init__(self, name, fan_in, fan_out, device=None):
            object.__setattr__(self, "seed_name", name)
            super().__init__(fan_in, fan_out, bias=False, device=device)

        def reset_parameters(self):
            if not self.weight.is_meta:
                with torch.no_grad():
                    self.weight.copy_(seeded(self.seed_name, self.weight.shape))

    class Embedding(nn.Embedding):
        def __init__(self, name, vocab, hidden, device=None):
            object.__setattr__(self, "seed_name", name)
            super().__init__(vocab, hidden, device=device)

        def reset_parameters(self):
            if not self.weight.is_meta:
                with torch.no_grad():
                    self.weight.copy_(seeded(self.seed_name, self.weight.shape))

    class RMSNorm(nn.Module):
        def __init__(self, hidden, device=None):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(hidden, device=device))
            self.reset_parameters()

        def reset_parameters(self):
            if not self.weight.is_meta:
                with torch.no_grad():
                    self.weight.fill_(1.0)

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Layer(nn.Module):
        def __init__(self, i, hidden, device=None):
            super().__init__()
            p, inter = f"layers.{i}.", intermediate(hidden)
            self.heads = max(1, hidden // 128)
            self.attn_norm, self.mlp_norm = RMSNorm(hidden, device), RMSNorm(hidden, device)
            self.q = Linear(p + "q", hidden, hidden, device)
            self.k = Linear(p + "k", hidden, hidden, device)
            self.v = Linear(p + "v", hidden, hidden, device)
            self.o = Linear(p + "o", hidden, hidden, device)
            self.gate = Linear(p + "gate", hidden, inter, device)
            self.up = Linear(p + "up", hidden, inter, device)
            self.down = Linear(p + "down", inter, hidden, device)

        def forward(self, x):
            b, s, h = x.shape
            y = self.attn_norm(x)
            q, k, v = (t(y).view(b, s, self.heads, h // self.heads).transpose(1, 2)
                       for t in (self.q, self.k, self.v))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            x = x + self.o(attn.transpose(1, 2).reshape(b, s, h))
            y = self.mlp_norm(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Llama(nn.Module):
        def __init__(self, hidden, layers, vocab=VOCAB, device=None):
            super().__init__()
            self.embed = Embedding("embed", vocab, hidden, device)
            self.layers = nn.ModuleList(Layer(i, hidden, device) for i in range(layers))
            self.norm = RMSNorm(hidden, device)
            self.head = Linear("head", hidden, vocab, device)

        def forward(self, tokens):
            x = self.embed(tokens[:, :-1])
            for layer in self.layers:
                x = layer(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   tokens[:, 1:].reshape(-1))

    return Llama


def batches(steps, seq, vocab, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, seq + 1), generator=g) for _ in range(steps)]


# ---- what a process reads about itself -----------------------------------------------------------

def proc_status(pid="self"):
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def proc_io():
    out = {}
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value)
    return out


def drive_of(path):
    """The /proc/diskstats name of the block device holding `path` (the whole disk), or None."""
    dev = os.stat(path).st_dev
    name = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        real = os.path.realpath(f"/sys/dev/block/{name}")
        if os.path.exists(os.path.join(real, "partition")):
            real = os.path.dirname(real)
        return os.path.basename(real)
    except OSError:
        return None


def diskstats(device):
    """Bytes read and written so far by `device` (sectors of 512 bytes), or None."""
    if device is None:
        return None
    with open("/proc/diskstats", encoding="ascii") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 9 and fields[2] == device:
                return int(fields[5]) * 512, int(fields[9]) * 512
    return None


def engine_io(stats):
    """NVMe bytes the engine moved (read, written), from its statistics."""
    param = stats["param"]
    read = param["nvme_read_bytes"] + stats["optimizer_read_bytes"]
    write = param["nvme_write_bytes"] + stats["optimizer_write_bytes"] + stats["grad_write_bytes"]
    return read, write


def du(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


# ---- the parts, each in its own process ----------------------------------------------------------

def part_reference(args):
    import torch
    import memplan.torch
    Llama = build_model_classes()
    hidden, layers, vocab = args.hidden, args.layers, args.vocab
    data = batches(args.steps, args.seq, vocab)
    with torch.device("meta"):
        model = Llama(hidden, layers, vocab)
    store = os.path.join(args.path, f"ltram-reference-{os.getpid()}")
    try:
        trainer = memplan.torch.offload(model, store, lr=LR, weight_decay=WD,
                                        threads=args.threads, state_slots=args.state_slots)
        offloaded = []
        for tokens in data:
            loss = model(tokens)
            loss.backward()
            trainer.step()
            offloaded.append(float(loss.detach()))
        trainer.close()
    finally:
        shutil.rmtree(store, ignore_errors=True)
    torch.manual_seed(1)  # no parameter's values depend on the RNG
    model = Llama(hidden, layers, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    in_memory = []
    for tokens in data:
        optimizer.zero_grad()
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        in_memory.append(float(loss.detach()))
    diff = max(abs(a - b) for a, b in zip(offloaded, in_memory))
    return {"shape": {"hidden": hidden, "layers": layers, "vocab": vocab},
            "params": sum(p.numel() for p in model.parameters()), "memplan_losses": offloaded,
            "torch_losses": in_memory, "max_loss_diff": diff, "tolerance": args.loss_tolerance,
            "pass": diff <= args.loss_tolerance}


def part_compute(args):
    import torch
    Llama = build_model_classes()
    data = batches(1, args.seq, args.vocab)[0]
    times = {}
    for layers in (1, 2):
        model = Llama(args.hidden, layers, args.vocab)
        runs = []
        for i in range(4):
            start = time.perf_counter()
            loss = model(data)
            loss.backward()
            elapsed = time.perf_counter() - start
            for p in model.parameters():
                p.grad = None
            if i > 0:
                runs.append(elapsed)
        times[layers] = statistics.median(runs)
        del model
    per_layer = max(0.0, times[2] - times[1])
    return {"t1_s": times[1], "t2_s": times[2], "per_layer_s": per_layer,
            "compute_s": times[1] + (args.layers - 1) * per_layer,
            "how": "forward+backward in memory with 1 and 2 layers (same hidden, MLP, vocabulary, "
                   "batch), medians of 3 after a warm-up; t1 + (layers - 1) x (t2 - t1)"}


def part_memplan(args):
    import torch
    import memplan.torch
    Llama = build_model_classes()
    data = batches(args.steps, args.seq, args.vocab)
    with torch.device("meta"):
        model = Llama(args.hidden, args.layers, args.vocab)
    params = sum(p.numel() for p in model.parameters())
    store = os.path.join(args.path, f"ltram-memplan-{os.getpid()}")
    device = drive_of(args.path)
    out = {"params": params, "drive_device": device, "steps": []}
    try:
        start = time.perf_counter()
        trainer = memplan.torch.offload(model, store, lr=LR, weight_decay=WD,
                                        threads=args.threads, state_slots=args.state_slots)
        out["offload_s"] = time.perf_counter() - start
        out["state_slots"] = args.state_slots
        out["drive_need"] = {k: trainer.drive[k] for k in ("params", "optimizer", "total",
                                                           "states_copy", "free_bytes")}
        out["chosen"] = trainer.explain()
        out["rss_after_offload"] = proc_status()["VmRSS"]
        out["drive_bytes"] = du(store)
        for i, tokens in enumerate(data):
            before = (engine_io(trainer.stats()), proc_io(), diskstats(device))
            start = time.perf_counter()
            loss = model(tokens)
            loss.backward()
            trainer.step()
            elapsed = time.perf_counter() - start
            stats = trainer.stats()
            after = (engine_io(stats), proc_io(), diskstats(device))
            step = {"step": i, "s": elapsed, "loss": float(loss.detach()),
                    "engine_read_bytes": after[0][0] - before[0][0],
                    "engine_write_bytes": after[0][1] - before[0][1],
                    "proc_read_bytes": after[1]["read_bytes"] - before[1]["read_bytes"],
                    "proc_write_bytes": after[1]["write_bytes"] - before[1]["write_bytes"],
                    "profile": stats["step_profile"], "rss": proc_status()["VmRSS"]}
            if before[2] is not None and after[2] is not None:
                step["disk_read_bytes"] = after[2][0] - before[2][0]
                step["disk_write_bytes"] = after[2][1] - before[2][1]
            out["steps"].append(step)
            print(f"memplan step {i}: {elapsed:.2f} s, loss {step['loss']:.6f}, read "
                  f"{step['engine_read_bytes'] / 1e9:.2f} GB, written "
                  f"{step['engine_write_bytes'] / 1e9:.2f} GB, RSS {step['rss'] / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)
        out["stats"] = trainer.stats()
        trainer.close()  # the parameters go back to the meta device: nothing read into memory
    finally:
        shutil.rmtree(store, ignore_errors=True)
    out["vm_hwm"] = proc_status()["VmHWM"]
    return out


def part_deepspeed(args):
    import deepspeed_peer  # noqa: F401  (DS_ACCELERATOR=cpu, TORCH_EXTENSIONS_DIR)
    import torch
    import deepspeed
    Llama = build_model_classes()
    data = batches(args.steps, args.seq, args.vocab)
    store = os.path.join(args.path, f"ltram-deepspeed-{os.getpid()}")
    os.makedirs(store, mode=0o700)
    deepspeed_peer.single_rank_environment()
    config = deepspeed_peer.zero_infinity_config(store, args.vocab * args.hidden, 1, LR, WD,
                                                 json.loads(args.deepspeed_options))
    out = {"config": config, "steps": []}

    def phase(what):
        print(f"deepspeed phase: {what} (RSS {proc_status()['VmRSS'] / 2**30:.2f} GiB)",
              file=sys.stderr, flush=True)
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        start = time.perf_counter()
        phase("building the model under zero.Init")
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme",
                                 pin_memory=True):
            model = Llama(args.hidden, args.layers, args.vocab)
        phase("deepspeed.initialize")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        phase("training")
        out["init_s"] = time.perf_counter() - start
        out["rss_after_init"] = proc_status()["VmRSS"]
        for i, tokens in enumerate(data):
            start = time.perf_counter()
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            elapsed = time.perf_counter() - start
            out["steps"].append({"step": i, "s": elapsed, "loss": float(loss.detach()),
                                 "rss": proc_status()["VmRSS"]})
            print(f"deepspeed step {i}: {elapsed:.2f} s, loss {float(loss.detach()):.6f}",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    out["vm_hwm"] = proc_status()["VmHWM"]
    return out


PARTS = {"reference": part_reference, "compute": part_compute, "memplan": part_memplan,
         "deepspeed": part_deepspeed}


# ---- the parent ----------------------------------------------------------------------------------

def run_part(name, args, shape, limit_bytes):
    """Runs part `name` in a child process, killing it past `limit_bytes` of RSS or --timeout
    seconds: {"ok", "result" | "error", "peak_rss", "killed"}."""
    fd, out_file = tempfile.mkstemp(prefix=f"ltram-{name}.", suffix=".json")
    os.close(fd)
    command = [sys.executable, os.path.abspath(__file__), "--part", name, "--out", out_file,
               "--path", args.path, "--steps", str(args.steps), "--seq", str(args.seq),
               "--threads", str(args.threads), "--loss-tolerance", str(args.loss_tolerance),
               "--state-slots", str(args.state_slots),
               "--deepspeed-options", args.deepspeed_options,
               "--hidden", str(shape[0]), "--layers", str(shape[1]), "--vocab", str(shape[2])]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.torch_threads))
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=env, start_new_session=True)
    watch = {"peak_rss": 0, "killed": None}
    # The drive is shared: a part that would leave it less than half of --min-free is stopped
    # (memplan's stores are preallocated within --min-free; a peer's grow as it runs).
    floor_bytes = args.min_free * 2**30 / 2

    def watcher():
        while child.poll() is None:
            rss = proc_status(child.pid).get("VmRSS", 0)
            watch["peak_rss"] = max(watch["peak_rss"], rss)
            elapsed = time.perf_counter() - start
            free = shutil.disk_usage(args.path).free
            why = None
            if rss > limit_bytes:
                why = (f"killed by the bench at {rss / 2**30:.2f} GiB RSS (limit "
                       f"{limit_bytes / 2**30:.2f} GiB, {args.rss_limit:.0%} of MemTotal)")
            elif free < floor_bytes:
                why = (f"killed by the bench with {free / 2**30:.2f} GiB left free on "
                       f"{args.path} (less than half of --min-free {args.min_free} GiB)")
            elif elapsed > args.timeout:
                why = f"killed by the bench after {elapsed:.0f} s (--timeout {args.timeout})"
            if why:
                watch["killed"] = why
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    stderr_lines = []
    for line in child.stderr:
        stderr_lines.append(line)
        if line.startswith(("memplan step", "deepspeed step", "deepspeed phase")):
            print("  " + line.rstrip(), flush=True)
            if line.startswith("deepspeed phase"):
                watch["phase"] = line.strip()
    child.wait()
    child.stderr.close()
    thread.join()
    # A child killed (or crashed) leaves its store: removed here, by the name it used.
    for store in (f"ltram-{name}-{child.pid}", f"ltram-reference-{child.pid}"):
        shutil.rmtree(os.path.join(args.path, store), ignore_errors=True)
    result = {"part": name, "wall_s": time.perf_counter() - start, "peak_rss": watch["peak_rss"],
              "returncode": child.returncode}
    try:
        if child.returncode == 0:
            with open(out_file, encoding="utf-8") as f:
                result["result"] = json.load(f)
            result["ok"] = True
        else:
            result["ok"] = False
            tail = "".join(stderr_lines)[-4000:]
            result["error"] = watch["killed"] or _last_error(tail)
            if watch.get("phase"):
                result["error"] += f" (during {watch['phase'][len('deepspeed phase: '):]})"
            result["stderr_tail"] = tail
    finally:
        os.unlink(out_file)
    return result


def _last_error(text):
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Killed" in line:
            return line.strip()
    return lines[-1].strip() if lines else "exited without output"


def drive_bandwidth(path, size):
    """Write then read bytes/s of `size` bytes through memplan.IoFile at `path`, O_DIRECT."""
    import mmap
    import torch
    import memplan
    chunk = min(size, 256 << 20)
    buf = mmap.mmap(-1, chunk)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    tensor.fill_(1)
    fd, name = tempfile.mkstemp(dir=path, prefix="ltram-bw.")
    os.close(fd)
    try:
        f = memplan.IoFile(name, block_size=1 << 20, queue_depth=16)
        start = time.perf_counter()
        for offset in range(0, size, chunk):
            f.write(tensor, offset)
        f.sync()
        write = size / (time.perf_counter() - start)
        start = time.perf_counter()
        for offset in range(0, size, chunk):
            f.read(tensor, offset)
        read = size / (time.perf_counter() - start)
        f.close()
    finally:
        os.unlink(name)
        del tensor
        buf.close()
    return read, write


def uptime_line():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return "load average %.2f" % os.getloadavg()[0]


def choose_shape(args, ram, free):
    """(hidden, layers, vocab) and why: --size, or hidden 2560 and the fewest layers whose AdamW
    states reach --ratio x RAM, fewer where memplan's stores would leave the drive less than
    --min-free."""
    if args.size != "auto":
        hidden, layers = (int(v) for v in args.size.lower().split("x"))
        return (hidden, layers, args.vocab), "given (--size)"
    want = args.ratio * ram
    layers = 1
    while 16 * n_params(HIDDEN, layers, args.vocab) < want:
        layers += 1
    room = free - args.min_free * 2**30
    per_param = DRIVE_BYTES_PER_PARAM[args.state_slots]
    fits = layers
    while fits > 1 and per_param * n_params(HIDDEN, fits, args.vocab) > room:
        fits -= 1
    if fits == layers:
        return (HIDDEN, layers, args.vocab), f"the fewest layers for {args.ratio} x RAM of states"
    need = per_param * n_params(HIDDEN, layers, args.vocab)
    return (HIDDEN, fits, args.vocab), (
        f"{layers} layers would give {args.ratio} x RAM of AdamW states, but memplan's stores "
        f"({per_param} B/parameter with --state-slots {args.state_slots}, "
        f"{need / 2**30:.1f} GiB) "
        f"would leave the drive less than --min-free {args.min_free} GiB of its "
        f"{free / 2**30:.1f} GiB free: the most layers that fit, {fits}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", default="/var/tmp", help="a directory on the drive (default "
                   "/var/tmp); the bench's stores are made under it and removed after")
    p.add_argument("--size", default="auto",
                   help="auto (hidden 2560, layers for --ratio x MemTotal) or HIDDENxLAYERS")
    p.add_argument("--ratio", type=float, default=1.55,
                   help="--size auto: AdamW states (16 B/parameter) over MemTotal")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--slice", default="256x4",
                   help="HIDDENxLAYERS of the reference run (vocabulary 512; default 256x4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per step (batch 1)")
    p.add_argument("--arms", default="reference,compute,memplan,deepspeed",
                   help="parts to run, of reference, compute, memplan, deepspeed")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="memplan's optimizer threads")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of every part (default 1: a shared 2-core machine)")
    p.add_argument("--bw-bytes", type=int, default=1 << 30,
                   help="bytes written and read to measure the drive (default 1 GiB)")
    p.add_argument("--min-free", type=float, default=8.0,
                   help="GiB the drive must keep free with memplan's stores on it (default 8); "
                        "a part that leaves less than half of it is stopped")
    p.add_argument("--state-slots", type=int, choices=(1, 2), default=2,
                   help="memplan's optimizer state slots (offload(..., state_slots=)): 2, its "
                        "default, crash-safe; 1 rewrites the states in place in half the drive "
                        "space and gives up resuming after a crash mid-step (the run of record "
                        "uses 1: the drive cannot hold two copies)")
    p.add_argument("--rss-limit", type=float, default=0.8,
                   help="a part is killed past this fraction of MemTotal of RSS")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per part at most")
    p.add_argument("--loss-tolerance", type=float, default=1e-5)
    p.add_argument("--deepspeed-options", default="{}",
                   help="JSON merged into DeepSpeed's zero_optimization block, e.g. "
                        "'{\"sub_group_size\": 100000000}' (default: DeepSpeed's own)")
    p.add_argument("--ram-bytes", type=int, help=argparse.SUPPRESS)  # tests: another "RAM"
    p.add_argument("--json", help="write the whole report here")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        result = PARTS[args.part](args)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return 0

    ram = args.ram_bytes or mem_total()
    usage = shutil.disk_usage(args.path)
    shape, why = choose_shape(args, ram, usage.free)
    hidden, layers, vocab = shape
    params = n_params(hidden, layers, vocab)
    states = 16 * params
    drive_need = DRIVE_BYTES_PER_PARAM[args.state_slots] * params
    arms = [a for a in args.arms.split(",") if a]
    for arm in arms:
        if arm not in PARTS:
            p.error(f"--arms: unknown part {arm!r} (of {', '.join(PARTS)})")
    if ("memplan" in arms or "deepspeed" in arms) and \
            usage.free - drive_need < args.min_free * 2**30:
        sys.exit(f"larger_than_ram: {params:,} parameters need about {drive_need / 2**30:.1f} GiB "
                 f"on {args.path}, which has {usage.free / 2**30:.1f} GiB free; less than "
                 f"--min-free {args.min_free} GiB would be left")
    report = {"uptime_start": uptime_line(), "mem_total": ram,
              "model": {"hidden": hidden, "layers": layers, "vocab": vocab,
                        "intermediate": intermediate(hidden), "params": params,
                        "seq": args.seq, "batch": 1},
              "size_why": why, "states_bytes": states, "states_over_ram": states / ram,
              "drive_free_before": usage.free, "state_slots": args.state_slots,
              "args": vars(args), "parts": {}}
    print(f"larger than RAM: {report['uptime_start']}", flush=True)
    print(f"model: hidden {hidden}, {layers} layers, MLP {intermediate(hidden)}, vocabulary "
          f"{vocab}: {params:,} parameters; AdamW states {states / 2**30:.1f} GiB = "
          f"{states / ram:.2f} x MemTotal ({ram / 2**30:.1f} GiB); size: {why}", flush=True)
    print(f"memplan's optimizer state slots: {SLOTS_WHY[args.state_slots]}", flush=True)
    limit = args.rss_limit * mem_total()  # the machine's, whatever --ram-bytes says
    if "memplan" in arms:
        read_bw, write_bw = drive_bandwidth(args.path, args.bw_bytes)
        report["drive"] = {"read_bytes_per_s": read_bw, "write_bytes_per_s": write_bw,
                           "bytes": args.bw_bytes,
                           "how": "memplan.IoFile (memplan's NVMe engine), O_DIRECT, 1 MiB "
                                  "blocks, queue depth 16: --bw-bytes written, synced, read back"}
        print(f"drive: read {read_bw / 1e9:.2f} GB/s, write {write_bw / 1e9:.2f} GB/s "
              f"({args.bw_bytes / 2**30:.2f} GiB through memplan.IoFile, O_DIRECT)", flush=True)
    for arm in arms:
        part_shape = shape
        if arm == "reference":
            part_shape = tuple(int(v) for v in args.slice.lower().split("x")) + (SLICE_VOCAB,)
        print(f"{arm}: running", flush=True)
        got = run_part(arm, args, part_shape, limit)
        report["parts"][arm] = got
        if not got["ok"]:
            print(f"{arm}: FAILED ({got['error']})", flush=True)
        else:
            print(f"{arm}: done in {got['wall_s']:.1f} s", flush=True)
        if args.json:  # what is done so far, in case a later part takes longer than one waits
            report["summary"] = summarize(report, ram)
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
    report["uptime_end"] = uptime_line()
    report["summary"] = summarize(report, ram)
    print_summary(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


def summarize(report, ram):
    parts = report["parts"]
    s = {"states_bytes": report["states_bytes"], "states_over_ram": report["states_over_ram"],
         "state_slots": report.get("state_slots", 2)}
    ref = parts.get("reference")
    if ref:
        s["losses"] = ("PASS" if ref["ok"] and ref["result"]["pass"] else "FAIL")
        if ref["ok"]:
            s["max_loss_diff"] = ref["result"]["max_loss_diff"]
    comp = parts.get("compute")
    if comp and comp["ok"]:
        s["compute_s"] = comp["result"]["compute_s"]
    mp = parts.get("memplan")
    if mp and mp["ok"]:
        r = mp["result"]
        steps = r["steps"][1:] or r["steps"]  # the first step runs serial (overlap "auto")
        s["measured_steps"] = [st["step"] for st in steps]
        s["step_s"] = statistics.median(st["s"] for st in steps)
        for key in ("engine_read_bytes", "engine_write_bytes", "proc_read_bytes",
                    "proc_write_bytes", "disk_read_bytes", "disk_write_bytes"):
            if all(key in st for st in steps):
                s[key + "_per_step"] = statistics.median(st[key] for st in steps)
        s["drive_bytes"] = r["drive_bytes"]
        s["drive_bytes_over_ram"] = r["drive_bytes"] / ram
        # What training keeps, once each: fp32 weights, gradients, two moments, and memplan's
        # working copy of the parameters beside the optimizer's master weights (20 B/parameter).
        s["training_bytes_once"] = 20 * r["params"]
        s["training_bytes_once_over_ram"] = 20 * r["params"] / ram
        s["engine_bytes_per_step_over_states"] = (
            (s["engine_read_bytes_per_step"] + s["engine_write_bytes_per_step"]) /
            report["states_bytes"])
        drive = report["drive"]
        s["io_s"] = (s["engine_read_bytes_per_step"] / drive["read_bytes_per_s"] +
                     s["engine_write_bytes_per_step"] / drive["write_bytes_per_s"])
        floor = max(s.get("compute_s", 0.0), s["io_s"])
        s["step_over_floor"] = s["step_s"] / floor
        # A drive that reads and writes at once at full speed each: the stricter floor.
        s["io_overlapped_s"] = max(s["engine_read_bytes_per_step"] / drive["read_bytes_per_s"],
                                   s["engine_write_bytes_per_step"] / drive["write_bytes_per_s"])
        s["step_over_overlapped_floor"] = s["step_s"] / max(s.get("compute_s", 0.0),
                                                            s["io_overlapped_s"])
        s["memplan_vm_hwm"] = r["vm_hwm"]
        s["memplan_peak_rss_watched"] = mp["peak_rss"]
        s["memplan_offload_s"] = r["offload_s"]
    peaks = [p["result"]["vm_hwm"] for p in parts.values() if p["ok"] and "vm_hwm" in p.get(
        "result", {})] + [p["peak_rss"] for p in parts.values()]
    import resource
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    s["children_max_rss"] = children
    s["parent_vm_hwm"] = proc_status()["VmHWM"]
    s["peak_rss"] = max(peaks + [children, s["parent_vm_hwm"]])
    ds = parts.get("deepspeed")
    if ds:
        if ds["ok"] and ds["result"]["steps"]:
            steps = ds["result"]["steps"][1:] or ds["result"]["steps"]
            s["deepspeed_step_s"] = statistics.median(st["s"] for st in steps)
            s["deepspeed_vm_hwm"] = ds["result"]["vm_hwm"]
            if "step_s" in s:
                s["memplan_over_deepspeed"] = s["step_s"] / s["deepspeed_step_s"]
        else:
            s["deepspeed"] = f"did not run: {ds.get('error')} (peak RSS " \
                             f"{ds['peak_rss'] / 2**30:.2f} GiB)"
    # Issue 33's acceptance.
    if "step_s" in s:
        s["acceptance"] = {
            "states (16 B/param) >= 1.5 x RAM": s["states_over_ram"] >= 1.5,
            "memplan's bytes on the drive >= 1.5 x RAM": s["drive_bytes_over_ram"] >= 1.5,
            "peak RSS <= 60% of RAM": s["memplan_vm_hwm"] <= 0.6 * ram,
            "step <= 1.3 x max(compute, I/O)": s["step_over_floor"] <= 1.3,
            "losses": None if "losses" not in s else s["losses"] == "PASS"}
    return s


def print_summary(report):
    s, G = report["summary"], 2**30
    print("\nsummary", flush=True)
    print(f"  states (AdamW, 16 B/param): {s['states_bytes'] / G:.1f} GiB = "
          f"{s['states_over_ram']:.2f} x MemTotal")
    if "losses" in s:
        print(f"  losses (slice, memplan on the drive vs torch in memory): {s['losses']}, max "
              f"|diff| {s.get('max_loss_diff', float('nan')):.3g}")
    if "compute_s" in s:
        print(f"  compute (scaled from 1 and 2 layers in memory): {s['compute_s']:.2f} s/step")
    if "step_s" in s:
        print(f"  memplan (state_slots {s['state_slots']}): offload() "
              f"{s['memplan_offload_s']:.1f} s (stores written: "
              f"{s['drive_bytes'] / G:.1f} GiB on the drive = {s['drive_bytes_over_ram']:.2f} x "
              f"MemTotal; weights, gradients, moments and working copy once: "
              f"{s['training_bytes_once_over_ram']:.2f} x); step {s['step_s']:.2f} s "
              f"(median of steps {s['measured_steps']})")
        print(f"  bytes per step: engine read {s['engine_read_bytes_per_step'] / 1e9:.2f} GB, "
              f"written {s['engine_write_bytes_per_step'] / 1e9:.2f} GB "
              f"({s['engine_bytes_per_step_over_states']:.2f} x the states); /proc/self/io read "
              f"{s.get('proc_read_bytes_per_step', 0) / 1e9:.2f} GB, written "
              f"{s.get('proc_write_bytes_per_step', 0) / 1e9:.2f} GB; /proc/diskstats read "
              f"{s.get('disk_read_bytes_per_step', 0) / 1e9:.2f} GB, written "
              f"{s.get('disk_write_bytes_per_step', 0) / 1e9:.2f} GB")
        print(f"  I/O time at the measured bandwidth {s['io_s']:.2f} s (reads then writes; "
              f"{s['io_overlapped_s']:.2f} s if the drive read and wrote at once, each at full "
              f"speed); step / max(compute, I/O) = {s['step_over_floor']:.2f} "
              f"({s['step_over_overlapped_floor']:.2f} against the overlapped I/O)")
        print(f"  peak RSS: memplan VmHWM {s['memplan_vm_hwm'] / G:.2f} GiB "
              f"({s['memplan_vm_hwm'] / report['mem_total']:.0%} of RAM), all parts "
              f"{s['peak_rss'] / G:.2f} GiB")
    if "deepspeed_step_s" in s:
        print(f"  DeepSpeed ZeRO-Infinity: step {s['deepspeed_step_s']:.2f} s, VmHWM "
              f"{s['deepspeed_vm_hwm'] / G:.2f} GiB; memplan / DeepSpeed "
              f"{s.get('memplan_over_deepspeed', float('nan')):.2f}")
    elif "deepspeed" in s:
        print(f"  DeepSpeed ZeRO-Infinity: {s['deepspeed']}")
    if "acceptance" in s:
        for what, ok in s["acceptance"].items():
            print(f"  {'NOT RUN' if ok is None else 'PASS' if ok else 'FAIL'}: {what}")
    print(f"  {report['uptime_end']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
