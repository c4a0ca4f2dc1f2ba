"""Machine-sized defaults of memplan.torch.offload() (a private module of memplan.torch; issue 33):
the pinned budget, the optimizer's sub-groups, the parameter staging buffers and the prefetch,
chosen from RLIMIT_MEMLOCK, the memory available, the model's size and, where a ``memplan bench
nvme --format json`` result is at hand, the drive's read bandwidth.

Note [Machine-sized defaults]
memplan.schedule()'s fixed defaults (1 Mi-element sub-groups, two 16 MiB staging buffers, 64 MiB of
prefetch, no pinned cap) are right for no machine in particular: too much pinned memory for a
process with a small RLIMIT_MEMLOCK, one sub-group (no overlap with backward) for a small model, a
prefetch unrelated to the drive. choose_sizes() is a pure function of the facts (so that it is
tested with exact numbers); machine_facts() reads them from this machine. The rules, each stated in
the sentence that goes with its choice:
  - pinned budget: the smallest of RLIMIT_MEMLOCK (when the kernel enforces it: not unlimited, and
    the process lacks CAP_IPC_LOCK, which lifts it) and an eighth of the memory available after
    what the engine keeps in host memory (the model's tensors, tiers in memory); none when neither
    limits it.
  - sub-groups (optimizer on NVMe): about 16 per step, so that the optimizer overlapped with
    backward steps sub-group by sub-group as their gradients complete, each a power of two of
    64 Ki to 4 Mi elements (smaller requests cost per-request overhead, larger ones only pinned
    memory), never more than the states; halved until the optimizer's three buffers take at most
    half the budget.
  - parameter staging (parameters on NVMe): two buffers, each the largest parameter rounded up to a
    power of two (1 MiB to 64 MiB), so that a parameter is read in one request; halved until they
    take at most a quarter of the budget. The gradient staging takes what is left (the engine).
  - prefetch (parameters on NVMe): what the drive reads in 50 ms (enough to read a layer ahead of
    its use), between two staging buffers and 128 MiB; without a bench result, schedule()'s 64 MiB.
Keywords the caller gives are kept as they are; the others are chosen around them (a given
pinned_budget_bytes is the budget the rest must fit).
"""

import errno
import json
import os
import resource

KiB = 1 << 10
MiB = 1 << 20
_PAGE = 4096
_CAP_IPC_LOCK = 14
_SUB_GROUPS_PER_STEP = 16
_MIN_SUB_GROUP = 64 * KiB
_MAX_SUB_GROUP = 4 * MiB
_OPTIMIZER_BUFFERS = 3       # memplan.schedule's optimizer_buffer_count
_PARAM_BUFFERS = 2           # memplan.schedule's param_buffer_count
_PREFETCH_SECONDS = 0.05
_MAX_PREFETCH = 128 * MiB
_DEFAULT_PREFETCH = 64 * MiB  # memplan.schedule's
# The keys choose_sizes() fills; a caller's keyword for any of them is kept.
SIZED_KEYS = ("pinned_budget_bytes", "sub_group_elements", "param_buffer_bytes", "prefetch_bytes")
# Where offload() looks for a bench result when it is not given: in the store path.
BENCH_FILE = "nvme_bench.json"


def _round_up(n, to):
    return (n + to - 1) // to * to


def _floor_pow2(n):
    return 1 << (max(1, int(n)).bit_length() - 1)


def _ceil_pow2(n):
    n = max(1, int(n))
    return 1 << (n - 1).bit_length()


def _mib(n):
    if n >= 1 << 30:
        return f"{n / (1 << 30):.3g} GiB"
    return f"{n / MiB:.4g} MiB" if n >= MiB else f"{n / KiB:.4g} KiB"


def optimizer_slot_bytes(sub_group_elements, states=2, half=False):
    """Pinned bytes of one optimizer buffer (the engine's BufferLayout: header, fp32 master and
    states, the fp32 gradient, the 16-bit working copy), rounded up as the engine rounds."""
    n = sub_group_elements
    return (_round_up(_PAGE + (1 + states) * 4 * n, _PAGE) + _round_up(4 * n, _PAGE) +
            (_round_up(2 * n, _PAGE) if half else 0))


def choose_sizes(*, elements, trainable, largest_param_elements, param_dtype_bytes=4,
                 optimizer_states=2, params_on_nvme=True, optimizer_on_nvme=True,
                 memlock_bytes=None, memlock_note="", available_bytes=None, resident_bytes=0,
                 read_bytes_per_s=None, bench_source="", world_size=1, given=None,
                 param_buffer_count=_PARAM_BUFFERS, optimizer_buffer_count=_OPTIMIZER_BUFFERS,
                 max_live_bytes=256 * MiB):
    """The schedule sizes for a model on a machine (Note [Machine-sized defaults]): a dict with
    the four SIZED_KEYS and "reasons", {key: one sentence saying why}. A pure function.

    elements / trainable / largest_param_elements: the model's parameter elements, those that
    train, its largest parameter; param_dtype_bytes: 4 (fp32) or 2 (bf16, fp16);
    optimizer_states: 2 (Adam), 1 (Lion, SGD); memlock_bytes: RLIMIT_MEMLOCK where the kernel
    enforces it, else None (memlock_note: why not); available_bytes: memory available (None:
    unknown); resident_bytes: what the engine and the model keep in host memory besides pinned
    buffers; read_bytes_per_s: the drive's measured read bandwidth (None: no bench result) from
    bench_source; world_size: ranks (each holds 1/world of the states); given: the caller's
    values of SIZED_KEYS, kept; param_buffer_count, optimizer_buffer_count, max_live_bytes: the
    schedule's (memplan.schedule's defaults unless given)."""
    n_param, n_optimizer = int(param_buffer_count), int(optimizer_buffer_count)
    given = {k: v for k, v in (given or {}).items() if k in SIZED_KEYS and v is not None}
    out, reasons = dict(given), {k: "given" for k in given}
    world = max(1, int(world_size))
    partition = max(1, -(-int(trainable) // world))

    # The budget every buffer below must fit. A limit below what the smallest working buffers
    # need is not honoured (offload() must not fail where it ran before): said so.
    half = param_dtype_bytes == 2
    smallest = (n_optimizer * optimizer_slot_bytes(1024, optimizer_states, half)
                if optimizer_on_nvme else 0) + (n_param * 64 * KiB
                                                 if params_on_nvme else 0) + 4 * _PAGE
    caps, notes = [], []
    if memlock_bytes is not None:
        if int(memlock_bytes) >= 2 * smallest:
            caps.append((int(memlock_bytes), f"RLIMIT_MEMLOCK ({_mib(memlock_bytes)})"))
        else:
            notes.append(f"RLIMIT_MEMLOCK ({_mib(memlock_bytes)}) is below what the smallest "
                         f"working buffers need ({_mib(2 * smallest)}), so it is not the "
                         "budget (raise it: ulimit -l)")
    elif memlock_note:
        notes.append(memlock_note)
    if available_bytes is not None:
        spare = max(0, int(available_bytes) - int(resident_bytes))
        caps.append((max(spare // 8 // _PAGE * _PAGE, 2 * smallest),
                     f"an eighth of the {_mib(spare)} of memory available beside the "
                     f"{_mib(resident_bytes)} the model and the engine keep in memory"))
    if "pinned_budget_bytes" in given:
        cap = int(given["pinned_budget_bytes"]) or None
    elif caps:
        cap, why = min(caps)
        out["pinned_budget_bytes"] = cap
        reasons["pinned_budget_bytes"] = "; ".join([why] + notes)
    else:
        cap = None
        out["pinned_budget_bytes"] = 0
        reasons["pinned_budget_bytes"] = "; ".join(
            ["no cap: neither RLIMIT_MEMLOCK nor the memory available limits it"] + notes)

    # The optimizer's sub-groups.
    if "sub_group_elements" not in given:
        if optimizer_on_nvme:
            sub = _floor_pow2(max(1, partition // _SUB_GROUPS_PER_STEP))
            sub = min(max(sub, _MIN_SUB_GROUP), _MAX_SUB_GROUP, _ceil_pow2(partition))
            sub = max(sub, 1024)
            why = (f"about {_SUB_GROUPS_PER_STEP} per step of {partition:,} trainable elements "
                   f"(the overlapped optimizer steps each as its gradients complete), within "
                   f"{_MIN_SUB_GROUP >> 10} Ki..{_MAX_SUB_GROUP >> 20} Mi elements")
            if cap is not None:
                halved = False
                while sub > 1024 and n_optimizer * optimizer_slot_bytes(
                        sub, optimizer_states, half) > cap // 2:
                    sub //= 2
                    halved = True
                if halved:
                    pinned = n_optimizer * optimizer_slot_bytes(sub, optimizer_states, half)
                    why = (f"halved until the optimizer's {n_optimizer} buffers "
                           f"({_mib(pinned)}) take at most half the {_mib(cap)} pinned budget")
            count = -(-partition // sub)
            reasons["sub_group_elements"] = f"{count} sub-groups: {why}"
        else:
            sub = 1 << 20
            reasons["sub_group_elements"] = ("memplan.schedule's default: the optimizer is in "
                                             "host memory, no staging")
        out["sub_group_elements"] = sub

    # The parameter staging buffers.
    if "param_buffer_bytes" not in given:
        if params_on_nvme:
            largest = int(largest_param_elements) * int(param_dtype_bytes)
            buf = min(max(_ceil_pow2(largest), MiB), 64 * MiB)
            why = (f"the largest parameter ({_mib(largest)}) in one read, within 1..64 MiB, "
                   f"{n_param} buffers")
            if cap is not None:
                halved = False
                while buf > 64 * KiB and n_param * buf > cap // 4:
                    buf //= 2
                    halved = True
                if halved:
                    why = (f"halved until the {n_param} staging buffers take at most a "
                           f"quarter of the {_mib(cap)} pinned budget (a larger parameter is "
                           "read in pieces)")
            reasons["param_buffer_bytes"] = why
        else:
            buf = 16 * MiB
            reasons["param_buffer_bytes"] = ("memplan.schedule's default: the parameters are "
                                             "not on NVMe, no staging")
        out["param_buffer_bytes"] = buf

    # The prefetch.
    if "prefetch_bytes" not in given:
        if params_on_nvme and read_bytes_per_s:
            floor = n_param * int(out["param_buffer_bytes"])
            ceiling = max(min(_MAX_PREFETCH, int(max_live_bytes) // 2), 1)
            ahead = _round_up(int(read_bytes_per_s * _PREFETCH_SECONDS), MiB)
            prefetch = min(max(ahead, floor), ceiling)
            reasons["prefetch_bytes"] = (
                f"what the drive reads in {_PREFETCH_SECONDS * 1e3:.0f} ms at "
                f"{read_bytes_per_s / 1e6:.0f} MB/s ({bench_source or 'bench result'}), within "
                f"{_mib(floor)} (the staging buffers)..{_mib(ceiling)} (at most 128 MiB and "
                "half of max_live_bytes)")
        else:
            prefetch = _DEFAULT_PREFETCH
            reasons["prefetch_bytes"] = (
                "memplan.schedule's default: " +
                ("no bench result for the drive (offload(..., nvme_bench=FILE) or "
                 f"<path>/{BENCH_FILE}, from `memplan bench nvme --format json`)"
                 if params_on_nvme else "the parameters are not on NVMe"))
        out["prefetch_bytes"] = prefetch
    out["reasons"] = reasons
    return out


# ---- this machine's facts ---------------------------------------------------------------------


def _has_cap_ipc_lock():
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def _available_bytes():
    """MemAvailable, or less where the process's cgroup (a container) allows less."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * KiB
    except (OSError, ValueError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            current = int(f.read().strip())
        if limit != "max":
            available = min(available, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return available


def machine_facts():
    """{"memlock_bytes" (None: not a limit), "memlock_note", "available_bytes"} of this process."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        memlock, note = None, "RLIMIT_MEMLOCK is unlimited"
    elif _has_cap_ipc_lock():
        memlock, note = None, (f"RLIMIT_MEMLOCK ({_mib(soft)}) does not bind: the process has "
                               "CAP_IPC_LOCK")
    else:
        memlock, note = soft, ""
    return {"memlock_bytes": memlock, "memlock_note": note, "available_bytes": _available_bytes()}


def read_bandwidth(bench):
    """(read bytes/s, source) from `memplan bench nvme --format json` output: a dict or a file
    path. ValueError naming the field when it is not such a result."""
    source = "the nvme_bench dict"
    if not isinstance(bench, dict):
        source = str(bench)
        try:
            with open(bench, "r", encoding="utf-8") as f:
                bench = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"memplan.torch: nvme_bench {source}: not JSON ({e})") from None
    best = bench.get("best") if isinstance(bench, dict) else None
    if not isinstance(best, dict):
        raise ValueError(f"memplan.torch: nvme_bench {source}: no 'best' result (is it `memplan "
                         "bench nvme --format json` output?)")
    rate = best.get("read_bytes_per_s")
    if rate is None:
        raise ValueError(f"memplan.torch: nvme_bench {source}: best.read_bytes_per_s was not "
                         "measured (run the bench with --rw both or read)")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0 or \
            rate == float("inf"):
        raise ValueError(f"memplan.torch: nvme_bench {source}: best.read_bytes_per_s must be a "
                         f"positive number, got {rate!r}")
    return float(rate), source


# The optimizer's states per element, by the schedule's optimizer name (offload::SwapOptimizer).
OPTIMIZER_STATES = {"adam": 2, "adam-amsgrad": 3, "sgd": 1, "lion": 1}
_EXTENT = 64 * KiB  # the engine rounds every store value to this (RequiredStoreBytes)


def drive_bytes(*, elements, trainable, sub_group_elements, param_dtype_bytes=4,
                optimizer_states=2, params_on_nvme=True, optimizer_on_nvme=True, state_slots=2,
                world_size=1):
    """Bytes one rank's NVMe stores take on the drive, as the engine sizes (fallocates) them: a
    dict of "params" (the parameters' working copies: engine_params.cc), "optimizer" (the master
    weights and `optimizer_states` states in `state_slots` slots and the fp32 gradient, per
    sub-group: OptimizerSwapper::RequiredStoreBytes), "states_copy" (one copy of the master weights
    and states: what a second slot adds) and "total". A pure function."""
    world = max(1, int(world_size))
    sub = int(sub_group_elements)
    out = {"params": 0, "optimizer": 0, "states_copy": 0}
    if params_on_nvme:
        partition = -(-int(elements) // world)
        chunks = -(-partition // sub)
        out["params"] = partition * int(param_dtype_bytes) + chunks * _EXTENT + MiB
    if optimizer_on_nvme:
        partition = -(-int(trainable) // world)
        full, tail = divmod(partition, sub)

        def group(n, slots):
            return (slots * _round_up(_PAGE + (1 + optimizer_states) * 4 * n, _EXTENT) +
                    _round_up(4 * n, _EXTENT))

        def store(slots):
            return full * group(sub, slots) + (group(tail, slots) if tail else 0) + MiB
        out["optimizer"] = store(int(state_slots))
        out["states_copy"] = store(2) - store(1)
    out["total"] = out["params"] + out["optimizer"]
    return out


def count_parameters(module):
    """One pass over `module`'s parameters, each counted once however often it is shared: a dict
    of "elements" and "trainable" (floating-point parameters: the only ones the engine holds),
    "largest" (the largest of them, in elements; 1 when none) and "held" (bytes of every
    parameter now in host memory, floating-point or not, until the engine holds them)."""
    seen, counts = set(), {"elements": 0, "trainable": 0, "largest": 1, "held": 0}
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.device.type == "cpu":
            counts["held"] += p.numel() * p.element_size()
        if not p.is_floating_point():
            continue
        counts["elements"] += p.numel()
        counts["trainable"] += p.numel() if p.requires_grad else 0
        counts["largest"] = max(counts["largest"], p.numel())
    return counts


def _drive_facts(counts, schedule, world):
    """What the schedule's NVMe stores take on the drive for a module of `counts`
    (count_parameters; drive_bytes, per rank), with the path, its state_slots and the ranks of
    this node (of `world` ranks in all); None without an NVMe tier."""
    params, optimizer = schedule.get("params", {}), schedule.get("optimizer", {})
    nvme = schedule.get("nvme") or {}
    on = (params.get("tier") == "nvme", optimizer.get("tier") == "nvme")
    if not any(on) or not nvme.get("path"):
        return None
    elements, trainable = counts["elements"], counts["trainable"]
    slots = int(optimizer.get("state_slots", 2))
    need = drive_bytes(
        elements=elements, trainable=trainable,
        sub_group_elements=int(optimizer.get("sub_group_elements", 4 << 20)),
        param_dtype_bytes=4 if params.get("dtype", "bf16") == "fp32" else 2,
        optimizer_states=OPTIMIZER_STATES.get(optimizer.get("name", "adam"), 2),
        params_on_nvme=on[0], optimizer_on_nvme=on[1], state_slots=slots, world_size=world)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if world > 1 else 1
    return dict(need, path=str(nvme["path"]), state_slots=slots, local_ranks=max(1, local),
                durability=optimizer.get("durability", "process") if on[1] else None)


def _free_bytes(path):
    """Free bytes (for this user) of the file system that holds `path` or would: its nearest
    existing ancestor's."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _bytes_words(n):
    """`n` bytes exactly, and in GiB where that says more."""
    return f"{n:,} bytes" + (f" ({n / (1 << 30):.2f} GiB)" if n >= 1 << 30 else "")


def check_drive(counts, schedule, world):
    """The drive facts (for a module of `counts`: count_parameters), with the free bytes under the store path; OSError(ENOSPC) when the
    stores (of every rank of this node) would not fit, saying what each needs and what one
    state slot would."""
    drive = _drive_facts(counts, schedule, world)
    if drive is None:
        return None
    free = drive["free_bytes"] = _free_bytes(drive["path"])
    need = drive["total"] * drive["local_ranks"]
    if need <= free:
        return drive
    ranks = f" for {drive['local_ranks']} ranks" if drive["local_ranks"] > 1 else ""
    slots = drive["state_slots"]
    msg = (f"memplan.torch: the engine's stores need {_bytes_words(need)} on {drive['path']}"
           f"{ranks} (parameters {_bytes_words(drive['params'])}, optimizer "
           f"{_bytes_words(drive['optimizer'])}: master weights and states in {slots} "
           f"slot{'s' if slots > 1 else ''} per sub-group, gradients), and the drive has "
           f"{_bytes_words(free)} free")
    if slots == 2 and drive["states_copy"]:
        one = need - drive["states_copy"] * drive["local_ranks"]
        msg += (f"; with state_slots=1 (the optimizer states rewritten in place: a step "
                f"interrupted after its first write cannot be resumed) they would need "
                f"{_bytes_words(one)}" + ("" if one <= free else ", which does not fit either"))
    raise OSError(errno.ENOSPC, msg)


def explain_drive(drive):
    """explain()'s lines on the drive: what the stores take, and what state_slots gives."""
    line = (f"drive: the stores take {_bytes_words(drive['total'])} at {drive['path']} "
            f"(parameters {_bytes_words(drive['params'])}, optimizer "
            f"{_bytes_words(drive['optimizer'])}); {_bytes_words(drive['free_bytes'])} were "
            "free before offload()")
    if drive["state_slots"] == 1:
        line += ("\nstate_slots = 1: each step rewrites the optimizer's states in place, in half "
                 f"their drive space ({_bytes_words(drive['states_copy'])} less); a step "
                 "interrupted after its first write (a crash, an I/O error, an abandoned step) "
                 "leaves the store unusable, and training restarts from a checkpoint")
    else:
        line += ("\nstate_slots = 2: the optimizer's states are kept twice (a step writes the "
                 "other copy), so a crash mid-step resumes from the last step; state_slots=1 "
                 f"would take {_bytes_words(drive['states_copy'])} less and give that up")
    if drive.get("durability") == "power":
        line += ("\ndurability = power: every step's commit flushes the drive (fdatasync), so "
                 "the last step survives a power loss or a kernel crash too, at the flush's cost "
                 "per step")
    elif drive.get("durability") == "process":
        line += ("\ndurability = process: each step commits without flushing the drive: a "
                 "process killed anywhere resumes from its last step; after a power loss resume "
                 "gets an older whole step or an error (durability=\"power\" flushes every step)")
    return line


def explain(chosen):
    """The choice as lines: "key = value (in words): why"."""
    lines = []
    for key, why in chosen["reasons"].items():
        value = chosen[key]
        words = f" ({_mib(value)})" if key.endswith("_bytes") and value else ""
        lines.append(f"{key} = {value}{words}: {why}")
    return "\n".join(lines)
