#!/usr/bin/env python3
"""memplan's NVMe I/O engine and CPU AdamW beside DeepSpeed's own ops, in one process, interleaved.

    PY=$(bash scripts/python-env.sh --modern)       # PyPI torch 2 + DeepSpeed 0.19 (the peer)
    PYTHONPATH=build/python $PY bench/vs_deepspeed.py --path /var/tmp [--size 1G]
        [--block-size 1M] [--queue-depth 16] [--threads 1,2] [--rounds 3] [--fio]
        [--adam-params 50M] [--adam-threads 2] [--skip-io] [--skip-adam] [--uring-features]
        [--json out.json]

Environment. memplan's extension (build/python/memplan/_native.cpython-311-*.so) is built for
Debian's python3, the Python of the .venv the test suite uses; the modern venv's Python is the same
3.11, and the extension links neither libpython nor torch, so it imports there as it is: build
with `cmake --build build --target memplan_python` and put build/python on PYTHONPATH. DeepSpeed's
`async_io` and `cpu_adam` ops are JIT-built once into build/torch_extensions (bench/deepspeed_peer.py).

I/O: one file per location, of --size bytes, on --path (the real drive) and on /dev/shm (a
memory-backed file; O_DIRECT works there on Linux >= 6.6, so it measures what one CPU thread can
push through the kernel's I/O path, as a RAID-0 of NVMe drives would demand). Both tools use one
buffer, DeepSpeed's `new_cpu_locked_tensor` (page-aligned, mlocked), and the same block size,
queue depth and thread count: DeepSpeed's `aio_handle(block, depth, single_submit=False,
overlap_events=True, intra_op_parallelism=T)` with `sync_pread` / `sync_pwrite` of the whole file
and `memplan.IoFile(threads=T)` with `read` / `write` of the whole file. Writes are timed to the
end of the call for both (neither fsyncs: DeepSpeed's swapper does not). One unmeasured pass of
each comes first. Each round runs every thread count, write then read, each tool back to back in
an order reversed every other time, so drift and the neighbours' load fall on all of them; the
table shows medians over rounds of each figure and of the per-round ratios. With --fio, fio's
io_uring engine runs beside them on the same file and settings (T jobs each on its own slice),
once as fio's defaults and once with its best io_uring options (fixed buffers, registered files,
batched submission and completion); the better of the two is the reference. Note that fio reuses
a ring of depth x block bytes where the other two move the whole file through one buffer.
"DS cores" and "mp cores" are this process's CPU seconds per wall second during the transfer,
the kernel's io_uring workers included: how many cores a tool kept busy. memplan's backend is
`--backend` (auto: libaio on a memory filesystem, io_uring elsewhere; see nvme/backend.cc).

AdamW: --adam-params fp32 parameters with fp32 exp_avg / exp_avg_sq, --adam-threads threads for
both (OMP_NUM_THREADS for DeepSpeed's OpenMP, memplan.CpuAdam(threads=T)). Rows:
  ds fp32 grads       DeepSpeed cpu_adam, fp32 params / grads / states (its kernel alone)
  ds from bf16        DeepSpeed's real ZeRO-Offload path from bf16 gradients: grads converted to
                      fp32 (torch copy_), cpu_adam, the bf16 copy of the params made (copy_)
  ds bf16 params      cpu_adam on bf16 params and grads with fp32 states (no fp32 master weights)
  memplan fp32 grads  memplan's kernel on fp32 grads, no 16-bit copy
  memplan from bf16   memplan's fused kernel: bf16 grads in, fp32 master + m + v updated and the
                      bf16 params written, one pass (the engine's real path)
Numerics: memplan from bf16 against memplan on the same gradients converted to fp32 (bit-exact
expected) and against torch.optim.AdamW (largest difference; torch 2's CPU AdamW uses lerp for
the first moment, so a few ulps are expected here; the test suite holds memplan to torch 1.13's
exact bits).

--uring-features: memplan's io_uring alone on the same file and buffer, each feature turned off
(or, for SQPOLL, on) against the default (fixed buffers, fixed files, batched submission, no
SQPOLL), interleaved as above: the ratio feature-changed / default per location, thread count and
direction says what each feature is worth here.

A benchmark, not a test: figures move with the machine's load, which is printed with them.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_peer as peer  # noqa: E402  (sets DS_ACCELERATOR, TORCH_EXTENSIONS_DIR)


def parse_size(text):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = text[-1] if text and text[-1] in units else ""
    return int(float(text[:len(text) - len(suffix)]) * units[suffix])


def parse_count(text):
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


# ---- I/O ------------------------------------------------------------------------------------------

def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def process_cpu_seconds():
    """CPU time of every thread of this process so far, the kernel's io_uring workers included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_with_cpu(fn):
    """(wall seconds, cores busy meanwhile: this process's CPU seconds / wall seconds)."""
    cpu = process_cpu_seconds()
    seconds = timed(fn)
    return seconds, (process_cpu_seconds() - cpu) / seconds


def fio_run(path, size, block, depth, threads, rw, tuned):
    """fio's io_uring engine on `path`: `threads` jobs, each on its own slice. Bytes/s or None."""
    if shutil.which("fio") is None:
        return None
    per = size // threads
    command = ["fio", "--name=vs-deepspeed", f"--filename={path}", f"--size={per}",
               f"--offset_increment={per}", f"--numjobs={threads}", "--group_reporting",
               f"--bs={block}", f"--iodepth={depth}", "--direct=1", "--ioengine=io_uring",
               f"--rw={rw}", "--overwrite=1", "--fallocate=none", "--thread",
               "--output-format=json"]
    if tuned:
        command += ["--fixedbufs=1", "--registerfiles=1", f"--iodepth_batch_submit={depth}",
                    "--iodepth_batch_complete_min=1", "--hipri=0"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"fio failed ({done.returncode}): {done.stderr.strip()[:300]}", file=sys.stderr)
        return None
    job = json.loads(done.stdout)["jobs"][0]
    direction = job["read" if rw == "read" else "write"]
    return float(direction["bw_bytes"]) if direction["io_bytes"] >= per * threads else None


def io_location(args, aio_op, memplan, torch, directory, label):
    size, block, depth = args.size, args.block_size, args.queue_depth
    path = os.path.join(directory, f"memplan-vs-deepspeed.{os.getpid()}.dat")
    rows = []
    handles = {t: aio_op.aio_handle(block, depth, False, True, t) for t in args.threads}
    buffer = handles[args.threads[0]].new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    try:
        # Lay the file out once (not measured), so every measured write overwrites allocated
        # blocks and every read returns data, for both tools.
        buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(1)))
        first = memplan.IoFile(path, backend=args.backend, block_size=block, queue_depth=depth,
                               create=True)
        info = first.info()
        first.write(buffer, 0)
        first.sync()
        first.close()
        files = {}
        for t in args.threads:
            f = memplan.IoFile(path, backend=args.backend, block_size=block, queue_depth=depth,
                               threads=t)
            if args.fixed_buffers:
                f.register_buffers([buffer])
            files[t] = f
        if not info["direct"]:
            print(f"{label}: O_DIRECT refused on {path}; memplan measures buffered I/O there",
                  file=sys.stderr)

        def ds(op, t):
            call = handles[t].sync_pread if op == "read" else handles[t].sync_pwrite
            return lambda: check_ds(call(buffer, path), op)

        def mp(op, t):
            return lambda: (files[t].read if op == "read" else files[t].write)(buffer, 0)

        # One unmeasured pass of each tool, thread count and direction first: the first transfer
        # in a location ran up to 10% slow, whichever tool made it.
        for t in args.threads:
            for op in ("write", "read"):
                ds(op, t)()
                mp(op, t)()

        def fio(tuned):
            return lambda op, t: fio_run(path, size, block, depth, t, op, tuned)

        # Every tool runs back to back for each thread count and direction, in an order reversed
        # every other time, so that the drive's swings (its bandwidth here moved by 20% from one
        # minute to the next) fall on all of them alike.
        tools = [("deepspeed", ds), ("memplan", mp)]
        if args.fio:
            tools += [("fio", fio(False)), ("fio tuned", fio(True))]
        for r in range(args.rounds):
            for t in args.threads:
                order = tools if (r + t) % 2 == 0 else list(reversed(tools))
                for op in ("write", "read"):
                    for tool, make in order:
                        row = {"location": label, "op": op, "threads": t, "tool": tool,
                               "round": r}
                        if tool.startswith("fio"):
                            bw = make(op, t)  # fio reports its own bandwidth
                            if not bw:
                                continue
                            row["bytes_per_s"] = bw
                        else:
                            seconds, cores = timed_with_cpu(make(op, t))
                            row["bytes_per_s"] = size / seconds
                            row["cores_busy"] = cores
                        row["load"] = peer.load_average()
                        rows.append(row)
            print(f"{label}: round {r + 1}/{args.rounds} done (load {peer.load_average():.2f})",
                  file=sys.stderr, flush=True)
        verify(buffer, files[args.threads[-1]], handles[args.threads[-1]], path, torch)
        stats = files[args.threads[-1]].stats()
        for f in files.values():
            f.close()
    finally:
        handles[args.threads[0]].free_cpu_locked_tensor(buffer)
        if os.path.exists(path):
            os.unlink(path)
    return rows, info, stats


URING_VARIANTS = {
    "default": {},
    "no fixed buffers": {"register": False},
    "no fixed files": {"fixed_files": False},
    "one request per submit": {"submit_batch": 1},
    "sqpoll": {"sqpoll": True},
}


def uring_features(args, memplan, torch, directory, label):
    """memplan's io_uring with each feature toggled, interleaved round by round."""
    import mmap
    size, block, depth = args.size, args.block_size, args.queue_depth
    path = os.path.join(directory, f"memplan-uring-features.{os.getpid()}.dat")
    area = mmap.mmap(-1, size)
    buffer = torch.frombuffer(area, dtype=torch.uint8)
    rows = []
    try:
        buffer.fill_(0x5a)
        first = memplan.IoFile(path, backend="uring", block_size=block, queue_depth=depth,
                               create=True)
        first.write(buffer, 0)
        first.close()
        for r in range(args.rounds):
            for t in args.threads:
                names = list(URING_VARIANTS)
                if (r + t) % 2:
                    names.reverse()
                for name in names:
                    v = URING_VARIANTS[name]
                    f = memplan.IoFile(path, backend="uring", block_size=block, queue_depth=depth,
                                       threads=t, sqpoll=v.get("sqpoll", False),
                                       fixed_files=v.get("fixed_files", True),
                                       submit_batch=v.get("submit_batch", 0))
                    if v.get("register", True):
                        f.register_buffers([buffer])
                    for op in ("write", "read"):
                        call = f.write if op == "write" else f.read
                        seconds = timed(lambda: call(buffer, 0))
                        rows.append({"location": label, "variant": name, "threads": t, "op": op,
                                     "round": r, "bytes_per_s": size / seconds,
                                     "sqpoll_granted": f.info()["sqpoll"]})
                    f.close()
            print(f"{label} io_uring features: round {r + 1}/{args.rounds} done (load "
                  f"{peer.load_average():.2f})", file=sys.stderr, flush=True)
    finally:
        del buffer
        area.close()
        if os.path.exists(path):
            os.unlink(path)
    return rows


def summarize_features(rows, args):
    out = []
    for label in sorted({r["location"] for r in rows}):
        for t in args.threads:
            for op in ("write", "read"):
                base = {r["round"]: r["bytes_per_s"] for r in rows if r["location"] == label and
                        r["threads"] == t and r["op"] == op and r["variant"] == "default"}
                for name in URING_VARIANTS:
                    if name == "default":
                        continue
                    mine = {r["round"]: r["bytes_per_s"] for r in rows if r["location"] == label
                            and r["threads"] == t and r["op"] == op and r["variant"] == name}
                    out.append({"location": label, "threads": t, "op": op, "variant": name,
                                "default_bytes_per_s": peer.median(list(base.values())),
                                "ratio_vs_default": peer.median(
                                    [mine[k] / base[k] for k in mine if k in base])})
    return out


def check_ds(result, op):
    if result is not None and result < 0:
        raise RuntimeError(f"DeepSpeed aio {op} failed ({result})")


def verify(buffer, mp_file, ds_handle, path, torch):
    """What one tool writes, the other reads back (so both moved the real bytes)."""
    pattern = torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(7))
    buffer.copy_(pattern)
    mp_file.write(buffer, 0)
    buffer.zero_()
    check_ds(ds_handle.sync_pread(buffer, path), "read")
    if not torch.equal(buffer, pattern):
        raise RuntimeError("DeepSpeed read back other bytes than memplan wrote")
    buffer.copy_(pattern.flip(0))
    check_ds(ds_handle.sync_pwrite(buffer, path), "write")
    buffer.zero_()
    mp_file.read(buffer, 0)
    if not torch.equal(buffer, pattern.flip(0)):
        raise RuntimeError("memplan read back other bytes than DeepSpeed wrote")


def summarize_io(rows, args):
    out = []
    locations = []
    for row in rows:
        if row["location"] not in locations:
            locations.append(row["location"])
    for location in locations:
        for t in args.threads:
            for op in ("write", "read"):
                sel = [r for r in rows if r["location"] == location and r["threads"] == t
                       and r["op"] == op]
                by, cores = {}, {}
                for r in sel:
                    by.setdefault(r["tool"], {})[r["round"]] = r["bytes_per_s"]
                    if "cores_busy" in r:
                        cores.setdefault(r["tool"], []).append(r["cores_busy"])
                ratios = [by["memplan"][k] / by["deepspeed"][k] for k in by.get("memplan", {})
                          if k in by.get("deepspeed", {})]
                entry = {"location": location, "threads": t, "op": op,
                         "deepspeed": peer.median(list(by.get("deepspeed", {}).values())),
                         "memplan": peer.median(list(by.get("memplan", {}).values())),
                         "ratio_vs_deepspeed": peer.median(ratios),
                         "deepspeed_cores": peer.median(cores.get("deepspeed", [])),
                         "memplan_cores": peer.median(cores.get("memplan", []))}
                fio_best = [max(by.get("fio", {}).get(k, 0), by.get("fio tuned", {}).get(k, 0))
                            for k in range(args.rounds)]
                fio_best = [v for v in fio_best if v > 0]
                if fio_best:
                    entry["fio_best"] = peer.median(fio_best)
                    entry["ratio_vs_fio"] = peer.median(
                        [by["memplan"][k] / max(by.get("fio", {}).get(k, 0),
                                                 by.get("fio tuned", {}).get(k, 0))
                         for k in by["memplan"]
                         if max(by.get("fio", {}).get(k, 0), by.get("fio tuned", {}).get(k, 0))])
                out.append(entry)
        # memplan's own scaling with threads, per round.
        if len(args.threads) > 1:
            t0, t1 = args.threads[0], args.threads[-1]
            for op in ("write", "read"):
                a = {r["round"]: r["bytes_per_s"] for r in rows if r["location"] == location
                     and r["tool"] == "memplan" and r["op"] == op and r["threads"] == t0}
                b = {r["round"]: r["bytes_per_s"] for r in rows if r["location"] == location
                     and r["tool"] == "memplan" and r["op"] == op and r["threads"] == t1}
                out.append({"location": location, "op": op, "scaling": f"{t1}/{t0} threads",
                            "ratio": peer.median([b[k] / a[k] for k in a if k in b])})
    return out


def print_io(summary):
    print(f"{'location':<10} {'op':<6} {'T':>2} {'DeepSpeed GB/s':>15} {'memplan GB/s':>13} "
          f"{'memplan/DS':>11} {'DS cores':>9} {'mp cores':>9} {'fio best GB/s':>14} "
          f"{'memplan/fio':>12}")
    for e in summary:
        if "scaling" in e:
            continue
        fio = f"{e['fio_best'] / 1e9:>14.2f} {e['ratio_vs_fio']:>12.3f}" if "fio_best" in e else ""
        print(f"{e['location']:<10} {e['op']:<6} {e['threads']:>2} {e['deepspeed'] / 1e9:>15.2f} "
              f"{e['memplan'] / 1e9:>13.2f} {e['ratio_vs_deepspeed']:>11.3f} "
              f"{e['deepspeed_cores']:>9.2f} {e['memplan_cores']:>9.2f} {fio}")
    for e in summary:
        if "scaling" in e:
            print(f"memplan {e['scaling']}, {e['location']} {e['op']}: {e['ratio']:.3f}x "
                  "(median of per-round ratios)")


# ---- AdamW ----------------------------------------------------------------------------------------

def adam_section(args, adam_op, memplan, torch):
    n, t = args.adam_params, args.adam_threads
    torch.set_num_threads(t)
    g = torch.Generator().manual_seed(0)
    p32 = torch.rand(n, generator=g) - 0.5
    g32 = (torch.rand(n, generator=g) - 0.5) * 1e-2
    g16 = g32.to(torch.bfloat16)
    m = torch.zeros(n)
    v = torch.zeros(n)
    h16 = torch.empty(n, dtype=torch.bfloat16)
    p16 = p32.to(torch.bfloat16)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    adam_op.create_adam(0, lr, b1, b2, eps, wd, True, False)
    cpu = memplan.CpuAdam(threads=t)
    fused = supports_fused(cpu, torch)
    steps = {"n": 0}

    def nxt():
        steps["n"] += 1
        return steps["n"]

    variants = {
        "ds fp32 grads": lambda: adam_op.adam_update(0, nxt(), lr, b1, b2, eps, wd, True, p32, g32,
                                                     m, v),
        "ds from bf16": lambda: (g32.copy_(g16),
                                 adam_op.adam_update(0, nxt(), lr, b1, b2, eps, wd, True, p32, g32,
                                                     m, v),
                                 h16.copy_(p32)),
        "ds bf16 params": lambda: adam_op.adam_update(0, nxt(), lr, b1, b2, eps, wd, True, p16,
                                                      g16, m, v),
        "memplan fp32 grads": lambda: cpu.step(nxt(), p32, g32, m, v, lr=lr, beta1=b1, beta2=b2,
                                               eps=eps, weight_decay=wd),
    }
    if fused:
        variants["memplan from bf16"] = lambda: cpu.step(nxt(), p32, g16, m, v, lr=lr, beta1=b1,
                                                         beta2=b2, eps=eps, weight_decay=wd,
                                                         half_params=h16)
    rows = []
    names = list(variants)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else list(reversed(names))
        for name in order:
            variants[name]()  # warm
            times = [timed(variants[name]) for _ in range(args.adam_steps)]
            rows.append({"variant": name, "round": r, "params_per_s": n / peer.median(times),
                         "load": peer.load_average()})
        print(f"adam: round {r + 1}/{args.rounds} done (load {peer.load_average():.2f})",
              file=sys.stderr, flush=True)
    return rows, numerics(cpu, torch) if fused else None, fused


def supports_fused(cpu, torch):
    try:
        x = torch.zeros(64)
        cpu.step(1, x.clone(), torch.zeros(64, dtype=torch.bfloat16), x.clone(), x.clone(),
                 half_params=torch.empty(64, dtype=torch.bfloat16))
        return True
    except (ValueError, TypeError):
        return False


def numerics(cpu, torch):
    """memplan's fused step from bf16 grads against its fp32 path and torch.optim.AdamW."""
    n = 1 << 20
    g = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=g) * 0.02
    grads = [(torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16) for _ in range(3)]
    fused = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    plain = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    half = torch.empty(n, dtype=torch.bfloat16)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01)
    for step, gb in enumerate(grads, start=1):
        cpu.step(step, fused[0], gb, fused[1], fused[2], half_params=half)
        cpu.step(step, plain[0], gb.float(), plain[1], plain[2])
        ref.grad = gb.float()
        opt.step()
    return {"fused_equals_fp32_path": bool(torch.equal(fused[0], plain[0]) and
                                           torch.equal(fused[1], plain[1]) and
                                           torch.equal(fused[2], plain[2])),
            "half_equals_params_rounded": bool(torch.equal(half, fused[0].to(torch.bfloat16))),
            "max_abs_diff_vs_torch": float((fused[0] - ref.detach()).abs().max()),
            "bitwise_equal_fraction_vs_torch": float((fused[0] == ref.detach()).float().mean())}


def summarize_adam(rows, args):
    by = {}
    for r in rows:
        by.setdefault(r["variant"], {})[r["round"]] = r["params_per_s"]
    out = {name: peer.median(list(v.values())) for name, v in by.items()}
    ratios = {}
    for mine in ("memplan from bf16", "memplan fp32 grads"):
        for theirs in ("ds fp32 grads", "ds from bf16", "ds bf16 params"):
            if mine in by and theirs in by:
                ratios[f"{mine} / {theirs}"] = peer.median(
                    [by[mine][k] / by[theirs][k] for k in by[mine] if k in by[theirs]])
    return out, ratios


# ---- main -----------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", default="/var/tmp", help="a directory on the real drive")
    p.add_argument("--shm", default="/dev/shm", help="a memory-backed directory ('' to skip)")
    p.add_argument("--size", type=parse_size, default=1 << 30)
    p.add_argument("--block-size", type=parse_size, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=16)
    p.add_argument("--threads", default="1,2", help="thread counts (intra_op_parallelism)")
    p.add_argument("--backend", default="auto", help="memplan's backend: auto, uring, aio, posix")
    p.add_argument("--no-fixed-buffers", dest="fixed_buffers", action="store_false",
                   help="do not register the buffer with memplan's io_uring rings")
    p.add_argument("--fio", action="store_true", help="also run fio's io_uring on the same file")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--adam-params", type=parse_count, default=50_000_000)
    p.add_argument("--adam-threads", type=int, default=2)
    p.add_argument("--adam-steps", type=int, default=5, help="timed steps per variant per round")
    p.add_argument("--skip-io", action="store_true")
    p.add_argument("--skip-adam", action="store_true")
    p.add_argument("--uring-features", action="store_true",
                   help="also measure each of memplan's io_uring features on and off")
    p.add_argument("--json", help="write every measurement and the summary here")
    args = p.parse_args(argv)
    args.threads = [int(x) for x in args.threads.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", str(args.adam_threads))

    import torch
    import memplan

    report = {"versions": peer.versions(), "uptime_start": peer.uptime_line(), "args": {
        k: v for k, v in vars(args).items() if k != "json"}}
    print("memplan vs DeepSpeed:", report["versions"], "|", report["uptime_start"])
    if not args.skip_io:
        aio_op = peer.load_op("async_io")
        rows = []
        report["io_info"] = {}
        for directory, label in ((args.path, "drive"), (args.shm, "shm")):
            if not directory:
                continue
            got, info, stats = io_location(args, aio_op, memplan, torch, directory, label)
            rows += got
            report["io_info"][label] = {"file": info, "memplan_stats": stats}
            print(f"{label}: {directory}: memplan {info['backend']} x{info['backends']}, "
                  f"direct={info['direct']}, fixed buffers="
                  f"{args.fixed_buffers and info['registered_buffers']}; "
                  f"registered ops {stats['registered_ops']}")
        report["io_rows"] = rows
        report["io_summary"] = summarize_io(rows, args)
        print(f"\nI/O: {args.size >> 20} MiB, block {args.block_size >> 10} KiB, queue depth "
              f"{args.queue_depth}, O_DIRECT, median of {args.rounds} interleaved rounds")
        print_io(report["io_summary"])
    if args.uring_features:
        rows = []
        for directory, label in ((args.path, "drive"), (args.shm, "shm")):
            if directory:
                rows += uring_features(args, memplan, torch, directory, label)
        report["uring_feature_rows"] = rows
        report["uring_features"] = summarize_features(rows, args)
        print(f"\nmemplan io_uring features (ratio to the default: fixed buffers, fixed files, "
              f"batched submission, no SQPOLL; median of {args.rounds} rounds)")
        print(f"{'location':<10} {'T':>2} {'op':<6} {'variant':<24} {'default GB/s':>13} "
              f"{'ratio':>7}")
        for e in report["uring_features"]:
            print(f"{e['location']:<10} {e['threads']:>2} {e['op']:<6} {e['variant']:<24} "
                  f"{e['default_bytes_per_s'] / 1e9:>13.2f} {e['ratio_vs_default']:>7.3f}")
    if not args.skip_adam:
        adam_op = peer.load_op("cpu_adam")
        rows, checks, fused = adam_section(args, adam_op, memplan, torch)
        medians, ratios = summarize_adam(rows, args)
        report.update(adam_rows=rows, adam_medians=medians, adam_ratios=ratios,
                      adam_numerics=checks)
        print(f"\nAdamW: {args.adam_params:,} params, {args.adam_threads} threads, median of "
              f"{args.rounds} rounds x {args.adam_steps} steps")
        for name, value in medians.items():
            print(f"  {name:<20} {value / 1e9:6.3f} G params/s")
        for name, value in ratios.items():
            print(f"  {name:<44} {value:6.3f}x")
        if not fused:
            print("  (memplan's fused 16-bit-gradient kernel is not in this build)")
        if checks:
            print("  numerics:", json.dumps(checks))
    report["uptime_end"] = peer.uptime_line()
    print("\n" + report["uptime_end"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
