"""memplan: memory planning and NVMe offload for training large models.

    import memplan
    memplan.estimate("llama-2-7b", gpus=4)                     # = memplan estimate --format json
    memplan.estimate("llama-2-7b", gpus=8, zero_stage=3, seq_len=4096, checkpointing="full")
    memplan.plan("llama-2-70b", gpu="a100-80", gpus=8, cpu_mem="1TiB", global_batch=64)
    memplan.estimate_module(torch_model, gpus=4)               # a live or meta-device nn.Module

Every function returns the same JSON document (as a dict) that the CLI prints with
``--format json``; bad input raises ValueError with the CLI's message (a model that is not found:
``memplan.NotFoundError``, a ValueError that is also a KeyError). Errors of the operating system
(a missing store file, a full disk, a permission) are OSError with their errno (FileNotFoundError,
PermissionError, ...); a call out of order is RuntimeError. The offload engine is ``memplan.Engine`` (low level) and ``memplan.torch``
(a PyTorch adapter that keeps a module's parameters and optimizer in the engine).
"""

import importlib
import importlib.util as _importlib_util
import json as _json
import sys as _sys

# Note [torch before the extension]
# The extension links the CUDA runtime and NCCL of the machine it was built on, by soname
# (libcudart.so.13, libnccl.so.2). PyPI's torch brings its own copies, often newer, and loads
# them from its wheel; but the dynamic linker hands a soname already in the process to every
# library loaded after it that needs it. So once the extension was loaded, torch got the system's
# NCCL and failed to load (torch 2.15 over the CUDA 13 toolkit's NCCL: "libtorch_cuda.so:
# undefined symbol: ncclCommResume"), while `import torch` first worked. Hence:
#   - the extension is loaded when first used (an entry point below, memplan.IoFile, ...), not
#     by `import memplan`: the wheel's `memplan` command (_cli.py) and memplan.trace never load
#     it, and pay for nothing;
#   - where torch is installed, it is imported just before the extension is loaded, so that its
#     copies are the ones in the process and memplan's calls go to them (the same major versions,
#     whose ABI is stable). Where torch is missing there is nothing to clash with; a torch that
#     fails to import is left for the caller's own `import torch` to report.


class _Missing:
    """Stands for the extension in a source tree where it is not built: memplan.trace (pure
    Python over torch) runs without it, and the rest of the package says what is missing when
    first used."""

    def __init__(self, error):
        self._error = error

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError("memplan's extension (memplan._native) is not built: %s; build it "
                          "(cmake, target memplan_python) or pip install ." % self._error)

    def __call__(self, *args, **kwargs):
        return self.__getattr__("extension")


_extension = None


def _load_extension():
    """The extension module (or a _Missing), loaded once (Note [torch before the extension])."""
    global _extension, _native
    if _extension is None:
        if "torch" not in _sys.modules and _importlib_util.find_spec("torch") is not None:
            try:
                import torch  # noqa: F401
            except Exception:  # noqa: BLE001 - the caller's own `import torch` reports it
                pass
        try:
            _extension = importlib.import_module(__name__ + "._native")
        except ImportError as error:  # a source tree without the built extension
            _extension = _Missing(error)
        _native = _extension
    return _extension


class _Lazy:
    """`_native` until the extension is loaded: the first attribute read loads it."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_load_extension(), name)


_native = _Lazy()

# Low-level pieces of the offload engine, for benchmarks and numeric checks: IoFile reads and
# writes one file through the NVMe I/O engine (backend, block size, queue depth, threads); CpuAdam
# runs the engine's Adam/AdamW kernel over caller arrays; nccl_unique_id() gives a new
# ncclUniqueId (bytes) for an Engine's NCCL collective (NotImplementedError without NCCL).
_FROM_EXTENSION = ("IoFile", "CpuAdam", "nccl_unique_id")


def __getattr__(name):
    if name in _FROM_EXTENSION:
        return getattr(_load_extension(), name)
    if name == "__version__":
        extension = _load_extension()
        return "0+unbuilt" if isinstance(extension, _Missing) else extension.__version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["estimate", "plan", "capacity", "estimate_module", "Engine", "schedule", "IoFile",
           "CpuAdam", "nccl_unique_id", "NotFoundError"]


class NotFoundError(KeyError, ValueError):
    """A model, module or key that memplan cannot find: a ValueError (bad input, as the README
    promises) that is also a KeyError (as memplan raised before), printed without KeyError's
    quotes."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


# Request keys of `estimate` that are not training-setup settings (integration/requests.h).
_ESTIMATE_KEYS = ("model", "config", "shapes", "name", "model_class", "gpus", "nodes",
                  "buffer_factor", "deepspeed")


def _load_json_arg(value):
    """A dict, or a path to a JSON file, read as the library reads JSON: a key repeated in one
    object is a ValueError naming the file and the key (Python's json module would keep the last
    value, and which one was meant is not clear)."""
    if value is None or isinstance(value, dict):
        return value

    def refuse_repeats(pairs):
        seen = {}
        for key, item in pairs:
            if key in seen:
                raise ValueError(f"{value}: key {key!r} appears twice in one JSON object")
            seen[key] = item
        return seen

    with open(value, "r", encoding="utf-8") as f:
        return _json.load(f, object_pairs_hook=refuse_repeats)


def estimate(model=None, *, config=None, shapes=None, name=None, gpus=1, nodes=1,
             buffer_factor=None, model_class=None, deepspeed=None, **setup):
    """Memory needed to train a model: ``memplan estimate --format json`` as a dict.

    model: a built-in name ("llama-2-7b"), a path (config.json, shape list, safetensors, a model
    directory) or a Hugging Face repo id in the local cache. Or give ``config`` (a config.json
    dict) or ``shapes`` (a tensor-shape list) instead. Training-setup keywords (precision,
    optimizer, zero_stage, offload_optimizer, offload_param, checkpointing, micro_batch, seq_len,
    grad_accum, lora_rank, ... as in the JSON "setup" object) add the itemised memory model;
    ``deepspeed`` (a ds_config dict or path) applies a DeepSpeed config.
    """
    request = {"gpus": gpus, "nodes": nodes}
    for key, value in (("model", model), ("config", _load_json_arg(config) if config else None),
                       ("shapes", shapes), ("name", name), ("buffer_factor", buffer_factor),
                       ("model_class", model_class), ("deepspeed", _load_json_arg(deepspeed))):
        if value is not None:
            request[key] = value
    if setup:
        request["setup"] = setup
    return _json.loads(_native.estimate_json(_json.dumps(request)))


# The training-setup keys (the JSON "setup" object) that plan and capacity take as keywords; the
# keys the plan search chooses (zero_stage, micro_batch, offload_*, checkpointing) stay at the top
# level, where they restrict the search.
_SETUP_KEYWORDS = frozenset((
    "precision", "optimizer", "seq_len", "lora_rank", "lora_targets", "qlora", "lora_dropout",
    "double_quant", "flash_attention", "foreach", "fused_optimizer", "sgd_momentum",
    "sequence_parallel", "autocast", "gradient_as_bucket_view", "framework", "loss",
    "loss_chunks", "checkpoint_every", "torch_compile", "gpu_arch", "torch_version",
    "cuda_context_bytes"))


def _nest_setup(request):
    """The request with its setup keywords moved into "setup" (refusing one given twice)."""
    moved = {k: v for k, v in request.items() if k in _SETUP_KEYWORDS}
    if not moved:
        return request
    rest = {k: v for k, v in request.items() if k not in _SETUP_KEYWORDS}
    setup = dict(rest.get("setup") or {})
    for key, value in moved.items():
        if key in setup:
            raise ValueError(f"memplan: {key!r} is given both as a keyword and in setup")
        setup[key] = value
    rest["setup"] = setup
    return rest


def plan(model=None, *, config=None, **request):
    """The fastest plan that fits: ``memplan plan --format json`` as a dict.

    Keywords as the plan request (integration/requests.h): gpu="a100-80" (or cluster={...}),
    gpus, nodes, cpu_mem="1TiB", memlock="unlimited", nvme_path, nvme_capacity, global_batch (or
    global_batch_tokens), setup={...} (the training settings, the same object as estimate's:
    precision, optimizer, seq_len, lora_rank, ...; absent keys take the defaults of Note [Plan
    defaults] in planner/plan_request.h), the what-if keys zero_stage, offload_optimizer,
    offload_param, checkpointing, micro_batch, sharding, and top, and emit=["deepspeed",
    "accelerate", "fsdp", "schedule", "trainer"] to get the configurations of plans[plan_index]
    under "emitted". Setup keywords may also be given as keywords (precision="fp32",
    seq_len=4096, as ``estimate`` takes them): they go into ``setup``.
    """
    request = _nest_setup(request)
    if model is not None:
        request["model"] = model
    if config is not None:
        request["config"] = _load_json_arg(config)
    return _json.loads(_native.plan_json(_json.dumps(request)))


def capacity(model=None, *, config=None, **request):
    """Which GPU type, how many, how long and at what cost: ``memplan capacity --format json`` as
    a dict.

    Keywords as the capacity request (integration/requests.h): gpu=["a100-80", "h100-80"] (or
    "a100-80,h100-80"), gpus="8-512" (or a list of counts), gpus_per_node, price=2.5 or
    {"a100-80": 1.8, "h100-80": 2.9}, tokens="1T" (required), max_days, cluster={...} (a
    capacity cluster document), the node keys cpu_mem, cpu_cores, pcie_gen, inter_node_bw,
    memlock, nvme_path, nvme_capacity, global_batch (or global_batch_tokens), setup={...} (as
    plan's; setup keywords such as seq_len=4096 go into it), gpu_margin, allow_nvme and threads.
    """
    request = _nest_setup(request)
    if model is not None:
        request["model"] = model
    if config is not None:
        request["config"] = _load_json_arg(config)
    return _json.loads(_native.capacity_json(_json.dumps(request)))


def _shape_list(module):
    """The parameters of a torch module as a shape list; a shared Parameter is listed once and
    its other names are recorded as ties (no weights are read: meta tensors work)."""
    tensors = []
    first_name = {}
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for param_name, p in sub._parameters.items():
            if p is None:
                continue
            full = f"{module_name}.{param_name}" if module_name else param_name
            entry = {"name": full, "shape": [int(d) for d in p.shape] or [1],
                     "dtype": str(p.dtype)}
            key = id(p)
            if key in first_name:
                if first_name[key] == full:
                    continue  # the same module reached twice
                if any(t["name"] == full for t in tensors):
                    continue
                entry["tied_to"] = first_name[key]
            else:
                first_name[key] = full
            tensors.append(entry)
    if not tensors:
        raise ValueError("memplan.estimate_module: the module has no parameters")
    return {"tensors": tensors}


def estimate_module(module, *, gpus=1, nodes=1, name=None, buffer_factor=None):
    """``memplan estimate`` for a live or meta-device torch.nn.Module.

    Shared parameters count once (as DeepSpeed counts them); no weights are touched. Returns the
    same document as ``estimate`` (model states: DeepSpeed's ZeRO-2 and ZeRO-3 tables).
    """
    return estimate(shapes=_shape_list(module), name=name or type(module).__name__, gpus=gpus,
                    nodes=nodes, buffer_factor=buffer_factor)


def schedule(*, path=None, param_tier="nvme", optimizer_tier="nvme", dtype="fp32",
             optimizer="adam", persistence_threshold=0, prefetch_bytes=64 << 20,
             max_live_bytes=256 << 20, param_buffer_bytes=16 << 20, param_buffer_count=2,
             sub_group_elements=1 << 20, optimizer_buffer_count=3, threads=0,
             pinned_budget_bytes=0, direct=True, backend="auto", block_size=1 << 20,
             queue_depth=32, io_threads=1, state_slots=2, durability="process"):
    """A Schedule document (README "Schedule JSON") for the offload engine.

    io_threads: threads each NVMe transfer is split across (nvme.intra_op_parallelism).
    state_slots (optimizer.state_slots): 2 (the default) keeps the optimizer's states twice on
    the drive, so that a crash or a failed step mid-step resumes from the last step; 1 rewrites
    them in place, in half the space, for a drive too small for two copies: a step interrupted
    after its first write then leaves a store that cannot be resumed (training restarts from a
    checkpoint). ValueError for anything else.
    durability (optimizer.durability): what each step's commit on the drive survives. "process"
    (the default): a process killed anywhere (OOM, preemption, a signal) resumes from its last
    step, and no step waits for the drive to flush its write cache; after a power loss or a kernel
    crash ``resume`` gets an older whole step or an error, never a mix. "power": every step's
    commit is flushed (fdatasync), so the last step survives those too, at the flush's cost per
    step (0.3-0.5 s on the development VM's virtio disk)."""
    if durability not in ("process", "power"):
        raise ValueError(f"memplan.schedule: durability must be \"process\" (a step's commit "
                         f"survives the process being killed) or \"power\" (a power loss "
                         f"too: the drive flushed every step), not {durability!r}")
    if isinstance(state_slots, bool) or state_slots not in (1, 2):
        raise ValueError(f"memplan.schedule: state_slots must be 1 (the optimizer states "
                         f"rewritten in place: half the drive space, no resume after a crash "
                         f"mid-step) or 2 (crash-safe), not {state_slots!r}")
    doc = {
        "version": 1,
        "params": {"tier": param_tier, "dtype": dtype,
                   "persistence_threshold": persistence_threshold,
                   "prefetch_bytes": prefetch_bytes, "max_live_bytes": max_live_bytes,
                   "buffer_bytes": param_buffer_bytes, "buffer_count": param_buffer_count},
        "optimizer": {"tier": optimizer_tier, "name": optimizer,
                      "sub_group_elements": sub_group_elements,
                      "buffer_count": optimizer_buffer_count, "threads": threads,
                      "state_slots": int(state_slots), "durability": durability},
        "pinned_budget_bytes": pinned_budget_bytes,
    }
    if path is not None:
        doc["nvme"] = {"path": str(path), "backend": backend, "direct": direct,
                       "block_size": block_size, "queue_depth": queue_depth,
                       "intra_op_parallelism": io_threads}
    return doc


def _step_json(options):
    """Step options as JSON, whose numbers have no infinity: "inf" for max_grad_norm and
    norm_type."""
    options = dict(options)
    for key in ("max_grad_norm", "norm_type"):
        value = options.get(key)
        if isinstance(value, (int, float)) and value == float("inf"):
            options[key] = "inf"
    return _json.dumps(options)


class Engine:
    """The offload engine (offload/engine.h) over a Schedule dict: register parameters, start,
    then per step fetch / release modules, hand gradients over, and step.

    Tensors (torch, CPU or CUDA) and buffer-protocol objects are passed without copies.


    Streams: ``release`` and ``grad_ready`` take the CUDA stream the caller queued its work on
    (``torch.cuda.current_stream().cuda_stream``; 0, the default, is the legacy default stream):
    the engine orders its copies after that work instead of waiting for it. A CUDA gradient is read
    later, on ``gradient_stream``; ``grad_ready`` records the tensor there (``record_stream``), so
    the caller may drop it at once.
    """

    def __init__(self, schedule, *, runtime="auto", resume=False, device=None, collective=None):
        """schedule: a Schedule dict, or the path of its JSON file.
        device: the CUDA device ordinal (None: the calling thread's current device).

        collective: None (one process), or the ranks' collective (ZeRO-3 across processes): an
        object with ``rank``, ``world_size`` and either ``nccl_unique_id`` (bytes from
        ``nccl_unique_id()`` on rank 0, shared by every rank: NCCL on the CUDA runtime) or
        ``all_gather``, ``reduce_scatter`` and ``all_reduce(send, recv, count, dtype)`` over
        memoryviews of host memory (the host runtime; memplan.torch's over torch.distributed).
        Every rank then makes the same engine calls in the same order."""
        if not isinstance(schedule, dict):  # a path: `memplan plan --emit-schedule s.json`
            schedule = _load_json_arg(str(schedule))
        self._native = _native.Engine(_json.dumps(schedule), _json.dumps(
            {"runtime": runtime, "resume": resume, "device": device}), collective)

    def add_parameter(self, name, module, shape, init=None, also_used_by=(), frozen=False,
                      group=0, dtype=""):
        """init: the initial values, a float32 host tensor or buffer of the shape's element
        count (read during start()); None: zeros; or a callable returning such values, called
        when start() first needs them and dropped once read, so that only one parameter's values
        exist at a time (Note [Initial values made on demand] in bindings.cc: a model larger
        than host memory); what it raises fails start() with ValueError naming the parameter.
        frozen: held and fetched like the others, never given a gradient nor stepped nor
        written after start() (LoRA's base weights); read_master refuses it.
        group: its parameter group (0 .. 1023): step(groups=[...]) gives each group options of its
        own (torch.optim's param_groups). dtype: the trainer's dtype of it ("torch.float32"),
        recorded with the stores so that a resume onto another is refused."""
        return self._native.add_parameter(name, module, [int(d) for d in shape], init,
                                          list(also_used_by), frozen, int(group), str(dtype))

    def start(self):
        """Creates the stores (or reopens them with resume): {"epoch": the step the optimizer is
        at, "torn": whether a step after it was begun and not committed, "notes": what recovery
        found}."""
        return self._native.start()

    def fetch(self, module):
        self._native.fetch(module)

    def release(self, module, stream=0):
        self._native.release(module, stream)

    def device_pointer(self, param):
        return self._native.device_pointer(param)

    def host_view(self, param, numel):
        return self._native.host_view(param, numel)

    def grad_ready(self, param, grad, dtype="", stream=0):
        self._native.grad_ready(param, grad, dtype, stream)

    def no_gradient(self, param):
        """`param` has no gradient this step (torch: grad None): step() skips it, its weights,
        states and step count unchanged."""
        self._native.no_gradient(param)

    def step(self, **options):
        """One optimizer step. Options: the optimizer's (lr, weight_decay, betas as beta1 /
        beta2, eps, grad_scale, ...), groups=[{...}, ...] (per parameter group, overriding those),
        max_grad_norm (clip by the global norm; float("inf"): measure only), norm_type (1, 2,
        inf), skip_nonfinite (skip a step whose gradients overflowed)."""
        self._native.step(_step_json(options))

    def prepare_step(self, **options):
        """The options of the coming step(), before its first gradient: the optimizer then runs
        during backward, each sub-group as soon as its gradients are in (the optimizer on NVMe).
        step() must then be given the same options."""
        self._native.prepare_step(_step_json(options))

    def gradient_norm(self, norm_type=2.0, grad_scale=1.0):
        """The global norm of this step's gradients (every one given) divided by grad_scale, over
        every rank (a collective), as torch.nn.utils.clip_grad_norm_ computes it."""
        return self._native.gradient_norm(float(norm_type), float(grad_scale))

    def abandon_step(self):
        """Drops the step in progress (its gradients; a prepared step's work), so that the next
        step starts clean."""
        self._native.abandon_step()

    def shard(self, param):
        """(first, size, numel): this rank's shard of the parameter, elements [first, first +
        size) of it flattened (past numel: padding)."""
        return self._native.shard(param)

    @property
    def optimizer_states(self):
        """State arrays besides the master weights (Adam 2: exp_avg, exp_avg_sq)."""
        return self._native.optimizer_states

    def read_state(self, param, array, out):
        """This rank's shard of array `array` (0 master weights, 1.. states) into `out` (float32,
        the shard's size), between steps."""
        self._native.read_state(param, array, out)

    def param_step(self, param):
        return self._native.param_step(param)

    def load_state(self, fill, arrays, steps=()):
        """Replaces, between steps, the arrays flagged in `arrays` of every parameter from
        ``fill(param, array, first, count)`` (float32 values of this rank's shard), and the step
        counts when `steps` (one per parameter) is given."""
        self._native.load_state(fill, [bool(a) for a in arrays], [int(t) for t in steps])

    def read_master(self, param, out):
        self._native.read_master(param, out)

    def stats(self):
        return _json.loads(self._native.stats_json())

    @property
    def param_dtype(self):
        return self._native.param_dtype

    @property
    def runtime(self):
        return self._native.runtime

    @property
    def device(self):
        """The CUDA device ordinal the engine runs on; -1 for the host runtime."""
        return self._native.device

    @property
    def gradient_stream(self):
        """The CUDA stream gradients are copied on (0 for the host runtime)."""
        return self._native.gradient_stream

    def close(self):
        self._native.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
