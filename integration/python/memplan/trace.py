"""memplan.trace: what one training step of the real code allocates, traced without a GPU.

    python -m memplan.trace --model llama-3.1-8b --layers 4 --micro-batch 2 --seq-len 2048 \\
        --precision bf16-mixed --checkpointing full --gpu a100
    python -m memplan.trace --framework torchtune --model llama-3.1-8b --lora-rank 8 --qlora ...
    python -m memplan.trace grid --out tests/accuracy/trace_grid.json   (memplan.trace_grid)

The framework's own model (built from a config.json on torch's FakeTensorMode: shapes and
dtypes, no memory), its loss, its checkpointing wrapper, LoRA/QLoRA and optimizer run two
training steps (forward, loss, backward, optimizer step, zero_grad) under torch's memory tracker
(torch.distributed._tools.mem_tracker.MemTracker; FSDPMemTracker for FSDP2 over simulated ranks).
Every allocation is rounded as the CUDA caching allocator rounds it, and where the CPU the trace
runs on would save or allocate other tensors than a GPU, the GPU's are used
(memplan.trace_cuda lists each correction and its source). The output (JSON) is the peak
allocated bytes of the step, when it happens (phase, op, module), split into the tracker's
categories (parameters, buffers, gradients, activations, temporaries, optimizer states and the
optimizer step's transients, other), the same per phase, and with ``--saved-tensors`` what
autograd saves per op in one block (op, shape, dtype, bytes; which op made each storage).

The figures are *allocated* bytes (what torch.cuda.max_memory_allocated reports), not reserved
bytes nor nvidia-smi: the caching allocator's reserved-over-allocated and the CUDA context are
not in a trace; memplan's estimator adds them as items of their own.
"""

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
import warnings
import weakref

FORMAT = "memplan-trace/1"
CATEGORIES = ("parameters", "buffers", "gradients", "activations", "temporaries",
              "optimizer_states", "optimizer_transients", "communication", "other")
PHASES = ("forward", "loss", "backward", "optimizer_step")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
FRAMEWORKS = ("transformers", "torchtune", "torchtitan", "litgpt", "llm-foundry")


class TraceError(ValueError):
    """A setup the tracer cannot run, with the field it is about."""


# ---- the setup -----------------------------------------------------------------------------------

class Setup:
    """One training configuration, in the words memplan's estimator uses (JSON keys as in
    ``memplan estimate --format json``'s "setup" where they exist)."""

    FIELDS = {
        # name: (default, meaning)
        "framework": ("transformers", "whose model, loss, checkpointing and optimizer run"),
        "model": (None, "a memplan built-in name, a config.json path or a config dict"),
        "layers": (None, "override the number of blocks (the rest of the config as given)"),
        "precision": ("bf16-mixed", "fp32 | bf16-mixed (fp32 weights, autocast) | fp16-mixed | "
                                    "bf16 (pure: weights, grads, optimizer in bf16) | fp16"),
        "optimizer": ("adamw", "adamw (torch, foreach as on CUDA) | adamw-fused | "
                               "adamw-forloop | sgd | sgd-momentum | none"),
        "micro_batch": (1, "sequences per step"),
        "seq_len": (2048, "tokens per sequence"),
        "checkpointing": ("none", "none | full | selective | op (torchtitan's op-level SAC)"),
        "checkpoint_every": (1, "checkpoint every k-th block (full/selective)"),
        "loss": ("full", "full (one logits tensor) | chunked (torchtune's "
                         "CEWithChunkedOutputLoss, LitGPT's chunked_cross_entropy) | fused "
                         "(Liger; not traced yet)"),
        "loss_chunks": (8, "number of chunks for loss=chunked"),
        "lora_rank": (0, "LoRA rank (0: full fine-tuning)"),
        "lora_alpha": (None, "LoRA alpha (default 2 x rank)"),
        "lora_targets": (None, "the modules LoRA adapts (the framework's names; default the "
                               "framework's default)"),
        "qlora": (False, "base weights in NF4 (torchtune: torchao's NF4Tensor)"),
        "ranks": (1, "FSDP2 ranks of a fake process group (torchtitan; it shards on one GPU "
                     "too)"),
        "attention": ("sdpa", "sdpa | eager (Transformers' attn_implementation)"),
        "gpu": ("a100", "the GPU whose kernels decide attention backend and workspaces"),
        "dropout": (None, "override the config's dropout probabilities (None: as configured)"),
        "compile": (False, "torch.compile (not traced: refused)"),
    }

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(self.FIELDS)
        if unknown:
            raise TraceError("unknown setup field(s): %s" % ", ".join(sorted(unknown)))
        for name, (default, _) in self.FIELDS.items():
            setattr(self, name, kwargs.get(name, default))
        self.validate()

    def validate(self):
        if self.framework not in FRAMEWORKS:
            raise TraceError("framework: %r is not one of %s" % (self.framework,
                                                                 ", ".join(FRAMEWORKS)))
        if self.model is None:
            raise TraceError("model: required (a built-in name, a config.json path or dict)")
        if self.precision not in PRECISIONS:
            raise TraceError("precision: %r is not one of %s" % (self.precision,
                                                                 ", ".join(PRECISIONS)))
        for name in ("micro_batch", "seq_len", "loss_chunks", "ranks", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or \
                    value > (1 << 24):
                raise TraceError("%s: must be an integer in [1, 2^24], got %r" % (name, value))
        if self.layers is not None and (not isinstance(self.layers, int) or self.layers < 1 or
                                        self.layers > 4096):
            raise TraceError("layers: must be an integer in [1, 4096], got %r" % (self.layers,))
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0 or self.lora_rank > 65536:
            raise TraceError("lora_rank: must be an integer in [0, 65536], got %r" %
                             (self.lora_rank,))
        if self.qlora and not self.lora_rank:
            raise TraceError("qlora: needs lora_rank > 0")
        if self.checkpointing not in ("none", "full", "selective", "op"):
            raise TraceError("checkpointing: %r is not one of none, full, selective, op" %
                             (self.checkpointing,))
        if self.loss not in ("full", "chunked", "fused"):
            raise TraceError("loss: %r is not one of full, chunked, fused" % (self.loss,))
        if self.attention not in ("sdpa", "eager"):
            raise TraceError("attention: %r is not one of sdpa, eager" % (self.attention,))
        if self.compile:
            raise TraceError("compile: torch.compile changes what is saved and is not traced")
        if self.dropout is not None and not (0.0 <= float(self.dropout) < 1.0):
            raise TraceError("dropout: must be in [0, 1), got %r" % (self.dropout,))
        if self.ranks > 1 and self.framework != "torchtitan":
            raise TraceError("ranks: FSDP2 over simulated ranks is traced for torchtitan only")
        from . import trace_cuda
        try:
            trace_cuda.parse_gpu(self.gpu)
        except ValueError as error:
            raise TraceError("gpu: %s" % error)

    def to_json(self):
        out = {}
        for name in self.FIELDS:
            value = getattr(self, name)
            if name == "model" and isinstance(value, dict):
                value = value.get("_name_or_path") or value.get("model_type") or "config"
            out[name] = value
        return out


# ---- model configs -------------------------------------------------------------------------------

def _source_dirs():
    here = os.path.dirname(os.path.abspath(__file__))
    dirs = []
    extra = os.environ.get("MEMPLAN_MODELS_DIR")
    if extra:
        dirs.extend(extra.split(os.pathsep))
    for root in (os.environ.get("MEMPLAN_SOURCE_DIR"), os.path.join(here, "..", "..", "..")):
        if root:
            dirs.append(os.path.join(root, "estimator", "models"))
            dirs.append(os.path.join(root, "tests", "accuracy", "trace_models"))
            dirs.append(os.path.join(root, "tests", "oracle", "modern_configs"))
    return [os.path.normpath(d) for d in dirs if os.path.isdir(d)]


def load_config(model):
    """(name, config dict) for a built-in name, a config.json path or a dict."""
    if isinstance(model, dict):
        return model.get("_name_or_path", "config"), copy.deepcopy(model)
    path = model
    if not os.path.isfile(path):
        if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
            path = os.path.join(path, "config.json")
        else:
            for d in _source_dirs():
                candidate = os.path.join(d, model + ".json")
                if os.path.isfile(candidate):
                    path = candidate
                    break
            else:
                raise TraceError("model: %r is neither a file nor a known model (looked in %s; "
                                 "set MEMPLAN_MODELS_DIR)" % (model, ", ".join(_source_dirs())))
    try:
        with open(path, "r", encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise TraceError("model: cannot read %s: %s" % (path, error))
    if not isinstance(config, dict):
        raise TraceError("model: %s is not a JSON object" % path)
    name = os.path.splitext(os.path.basename(path))[0]
    if name == "config":
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return name, config


# ---- the tracker ---------------------------------------------------------------------------------

_CATEGORY_OF = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients",
                "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer",
                "Other": "other",
                # FSDPMemTracker's (torchtitan): a rank's shard and the gathered copies are its
                # parameters, both kinds of gradient its gradients; the all-gather output and
                # the reduce-scatter input are communication buffers.
                "Sharded Param": "parameters", "Unsharded Param": "parameters",
                "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
                "All Gather": "communication", "Reduce Scatter": "communication",
                "OptState": "optimizer", "Inputs": "other"}


def _make_tracker_class(base):
    """A MemTracker (or FSDPMemTracker) subclass that also records, per step and phase, the peak,
    the categories at that moment and the op and module running then."""

    class Tracker(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.step = 0
            self.phase = "setup"
            self.records = {}
            self._func = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._func = func
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            total = sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values())
            key = (self.step, self.phase)
            record = self.records.get(key)
            if record is None or total > record["peak_bytes"]:
                parents = [p for p in self._mod_tracker.parents if p != "Global"]
                self.records[key] = {
                    "peak_bytes": total,
                    "snapshot": _flatten_snapshot(self._curr_mem_snap),
                    "op": str(self._func) if self._func is not None else None,
                    # The deepest module; parents is a set, so ties (two blocks' modules at
                    # once, in backward) go to the first by name, not to hash order.
                    "module": min(parents, key=lambda p: (-len(p), p)) if parents else None,
                }

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # MemTracker hooks every parameter's gradient; a frozen one (LoRA's base weights)
            # cannot take a hook, and has no gradient to track.
            frozen = [p for p in module.parameters() if not p.requires_grad]
            for p in frozen:
                self._param_to_grad_hook_handles.setdefault(p, (_NoHandle(), _NoHandle()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def current_bytes(self):
            return sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values())

        def current(self):
            return _flatten_snapshot(self._curr_mem_snap)

    return Tracker


class _NoHandle:
    def remove(self):
        pass


def _flatten_snapshot(snap):
    out = {}
    for dev_snap in snap.values():
        for key, value in dev_snap.items():
            name = _CATEGORY_OF.get(getattr(key, "value", key), None)
            if key == "Total" or name is None:
                continue
            out[name] = out.get(name, 0) + value
    return out


@contextlib.contextmanager
def _cuda_rounding():
    """MemTracker rounds a storage to 512 bytes only on CUDA devices; the trace runs on CPU fake
    tensors, so every storage is rounded as the CUDA caching allocator rounds it."""
    from torch.distributed._tools import mem_tracker
    from . import trace_cuda
    original = mem_tracker._WeakRefInfo._calculate_mem_consumed

    def rounded(self):
        return trace_cuda.round_allocation(self.size * self.element_size)

    mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    try:
        yield
    finally:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = original


# ---- what autograd saves -------------------------------------------------------------------------

class _Packed:
    __slots__ = ("key", "tensor")

    def __init__(self, key, tensor):
        self.key = key
        self.tensor = tensor


def _storage_key(t):
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a subclass without one storage
        return id(t)


class SavedTensorRecorder:
    """Records every tensor autograd saves during a forward (pack hook), which module and block
    was running, and which op made its storage (a dispatch mode below autograd); after the
    forward, ``resolve(loss)`` walks the graph and names the autograd node and field each saved
    tensor belongs to. Use on a model without activation checkpointing (a checkpoint's own hooks
    replace these inside its region)."""

    def __init__(self, model, blocks):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        self.model = model
        self.block_of = {}
        for index, block in enumerate(blocks):
            for m in block.modules():
                self.block_of.setdefault(id(m), index)
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack = []
        self.saved = {}
        self.made = weakref.WeakKeyDictionary() if False else {}
        self._made_refs = []
        self.params = {_storage_key(p) for p in model.parameters()}
        self.params |= {_storage_key(b) for b in model.buffers()}
        recorder = self

        class Provenance(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                where = recorder.where()
                for t in _tensors(out):
                    key = _storage_key(t)
                    if key not in recorder.made:
                        recorder.made[key] = (str(func), where[0], where[1])
                        recorder._made_refs.append(t)
                return out

        self._provenance = Provenance
        self._hooks = []
        self._torch = torch

    def where(self):
        for m in reversed(self.stack):
            if id(m) in self.block_of:
                return self.names.get(id(m)), self.block_of[id(m)]
        return (self.names.get(id(self.stack[-1])) if self.stack else None), None

    @contextlib.contextmanager
    def recording(self):
        torch = self._torch

        def pre(module, args):
            self.stack.append(module)

        def post(module, args, output):
            if self.stack and self.stack[-1] is module:
                self.stack.pop()

        for m in self.model.modules():
            self._hooks.append(m.register_forward_pre_hook(pre))
            self._hooks.append(m.register_forward_hook(post))

        def pack(t):
            key = len(self.saved)
            module, block = self.where()
            self.saved[key] = {"tensor": t, "module": module, "block": block}
            return _Packed(key, t)

        def unpack(p):
            if self._resolving is not None and p.key in self.saved:
                self.saved[p.key].setdefault("nodes", []).append(self._resolving)
            return p.tensor

        self._resolving = None
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack), self._provenance():
                yield self
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def resolve(self, root):
        """Name the node and field of each saved tensor by walking the graph from ``root``."""
        seen = set()
        todo = [root.grad_fn] if root.grad_fn is not None else []
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            for attr in dir(node):
                if attr.startswith("_saved_"):
                    self._resolving = (node.name(), attr[len("_saved_"):])
                    try:
                        getattr(node, attr)
                    except Exception:  # noqa: BLE001 - fields freed or not unpackable
                        pass
                    self._resolving = None
            for next_node, _ in node.next_functions:
                if next_node is not None:
                    todo.append(next_node)

    def listing(self, block):
        """The saved tensors of one block (and, with block=None, outside every block)."""
        from . import trace_cuda
        rows = []
        storages = {}
        for key in sorted(self.saved):
            entry = self.saved[key]
            if entry["block"] != block:
                continue
            t = entry["tensor"]
            skey = _storage_key(t)
            nbytes = t.untyped_storage().nbytes()
            index = storages.setdefault(skey, len(storages))
            made = self.made.get(skey)
            nodes = entry.get("nodes") or [(None, None)]
            rows.append({
                "node": nodes[0][0], "field": nodes[0][1], "module": entry["module"],
                "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                "bytes": trace_cuda.round_allocation(nbytes), "storage": index,
                "parameter": skey in self.params,
                "made_by": made[0] if made else None,
                "made_in": made[1] if made else None,
                "made_in_block": made[2] if made else None,
            })
        unique = {}
        for row in rows:
            if not row["parameter"]:
                unique[row["storage"]] = row["bytes"]
        return rows, sum(unique.values())


def _tensors(value):
    import torch
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


# ---- running a step ------------------------------------------------------------------------------

class Target:
    """What a framework adapter hands the tracer: the model, its optimizer, the blocks, the head
    (the loss phase starts after its forward), a function running forward + loss, the context
    the framework runs the forward in (autocast), and facts for the record."""

    def __init__(self, model, optimizer, blocks, head, forward_loss, autocast=None, info=None,
                 tracker_class=None, zero_grad=None, step=None, backward=None, inputs=()):
        self.model = model
        self.optimizer = optimizer
        self.blocks = blocks
        self.head = head
        self.forward_loss = forward_loss
        self.autocast = autocast or contextlib.nullcontext
        self.info = info or {}
        self.tracker_class = tracker_class
        self.zero_grad = zero_grad
        self.step = step
        self.backward = backward
        # The batch on the GPU (token ids, labels): tracked as "other".
        self.inputs = list(inputs)
        # Called with the tracker once it exists (an adapter whose code needs it).
        self.on_tracker = None


@contextlib.contextmanager
def _swappable_fakes(fake_mode):
    """torch.utils.swap_tensors (Module.to() on fake parameters, torchtune's FrozenNF4Linear)
    refuses a tensor with a weak reference; the fake mode's converter memo holds one to fakes it
    made from real tensors. The memo entries of the two tensors are dropped first (a later
    conversion of the same real tensor makes a new fake)."""
    import torch
    original = torch.utils.swap_tensors
    memo = fake_mode.fake_tensor_converter.meta_converter.tensor_memo

    def swap_tensors(t1, t2):
        for key, value in list(memo.items()):
            if value is t1 or value is t2:
                del memo[key]
        return original(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def _build_target(setup, fake_mode, listing=False):
    with _swappable_fakes(fake_mode):
        return _build_target_unguarded(setup, fake_mode, listing)


def _build_target_unguarded(setup, fake_mode, listing=False):
    if setup.framework == "transformers":
        from . import trace_transformers as adapter
    else:
        from . import trace_frameworks as adapter_module
        adapter = adapter_module.adapter(setup.framework)
    return adapter.build(setup, fake_mode, listing=listing)


def run(setup, saved_tensors=False, listing_block=0):
    """Trace ``setup`` (a Setup or a dict of its fields); returns the trace as a dict."""
    if isinstance(setup, dict):
        setup = Setup(**setup)
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from . import trace_cuda

    started = time.time()
    _, arch = trace_cuda.parse_gpu(setup.gpu)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        target = _build_target(setup, fake_mode)
        result = trace_target(target, arch)
        result["versions"] = _versions(setup.framework)
        result["setup"] = setup.to_json()
        if saved_tensors:
            result["saved_tensors"] = _listing(setup, fake_mode, arch, listing_block)
    result["trace_seconds"] = round(time.time() - started, 2)
    return result


# Note [The tracker's hooks keep a leaf alive]
# The tracker's module tracker (torch/distributed/_tools/mod_tracker.py) hooks each module's
# forward inputs with register_multi_grad_hook (torch/autograd/graph.py). In its "all" mode the
# hook's closure holds the inputs' grad_fns; for a leaf input that is the leaf's AccumulateGrad,
# which holds the leaf. Hooked on that same leaf, the closure and the leaf keep each other alive
# through C++ (the autograd node), where Python's collector cannot see the cycle. A non-parameter
# leaf that requires grad is what PEFT and Transformers' gradient checkpointing make of the
# embeddings' output (enable_input_require_grads: `output.requires_grad_(True)` on a frozen
# embedding's output): under the tracker that tensor (tokens x hidden) and its .grad outlived
# every step, which the same code without the tracker does not (the grid's LoRA + checkpointing
# points carried both into the next step). The hooks serve one backward pass: they are removed
# when it ends, which frees such a leaf as training without the tracker does.
#
# Note [The tracker's hooks hold gradients]
# In its "all" mode, register_multi_grad_hook also keeps each input's gradient (in the hook's
# buffer) until the last of the module's inputs has its gradient, so that it can hand them all to
# the hook. The module tracker's hook uses none of them. For a module of one input that is
# nothing; for torchtune's CEWithChunkedOutputLoss, whose inputs are the logits' chunks, it kept
# every chunk's logits gradient (bf16, tokens / chunks x vocabulary) alive until the output
# projection's last chunk had run its backward, where the same code without the tracker frees
# each after its chunk's projection (checked with weak references to the gradients' storages).
# The tracer registers the module tracker's "all" hooks without the buffer: each input's hook
# counts, and the last one calls the tracker's hook with no gradients.
def _multi_grad_hook_counting(tensors, fn):
    import threading
    import torch
    from torch.autograd.graph import _MultiHandle, _get_grad_fn_or_grad_acc
    grad_fns = [_get_grad_fn_or_grad_acc(t) for t in tensors]
    n = len(tensors)  # the closure must not hold the tensors: they would outlive their use
    lock = threading.Lock()
    counts = {}

    def hook(_grad):
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in counts:
                # As torch does: the inputs whose gradient this backward computes.
                counts[task] = [0, sum(map(torch._C._will_engine_execute_node, grad_fns))]
            entry = counts[task]
            entry[0] += 1
            last = entry[0] == entry[1]
            if last:
                del counts[task]
        if last:
            fn([None] * n)

    return _MultiHandle(tuple(t.register_hook(hook) for t in tensors))


class _ModuleHooksPerPass:
    """While entered, the multi-grad hooks the module tracker registers are collected (Note [The
    tracker's hooks hold gradients]), and end_pass() removes those of the pass that ended."""

    def __init__(self):
        self._handles = []
        self._module = None
        self._original = None

    def __enter__(self):
        from torch.distributed._tools import mod_tracker
        self._module = mod_tracker
        self._original = original = mod_tracker.register_multi_grad_hook
        handles = self._handles

        def register(tensors, fn, *args, **kwargs):
            mode = kwargs.get("mode", "all")  # keyword-only in torch
            if mode == "all":
                handle = _multi_grad_hook_counting(tensors, fn)
            else:
                handle = original(tensors, fn, *args, **kwargs)
            handles.append(handle)
            return handle
        mod_tracker.register_multi_grad_hook = register
        return self

    def end_pass(self):
        while self._handles:
            self._handles.pop().remove()

    def __exit__(self, *exc):
        self._module.register_multi_grad_hook = self._original
        self.end_pass()
        return False


def trace_target(target, arch=(8, 0)):
    """Two training steps of ``target`` (built inside an active FakeTensorMode) under the
    tracker, with the CUDA corrections of memplan.trace_cuda for a GPU of compute capability
    ``arch``; returns the figures (peak, phases, step_start, workspaces, sdpa_backends)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from . import trace_cuda
    semantics = trace_cuda.CudaSemantics(arch)
    model = target.model
    tracker_class = _make_tracker_class(target.tracker_class or MemTracker)
    tracker = tracker_class() if target.tracker_class is None else \
        tracker_class(model, target.optimizer)
    if target.on_tracker is not None:
        target.on_tracker(tracker)
    workspace = torch.empty(trace_cuda.cublas_workspace_bytes(arch), dtype=torch.uint8)
    rounding = _cuda_rounding()
    rounding.__enter__()
    if hasattr(tracker, "track_inputs"):
        # FSDPMemTracker tracks the model and optimizer itself (its track_external does
        # nothing); the workspace and the batch are its "Inputs", here "other".
        tracker.track_inputs((workspace, *target.inputs))
    else:
        tracker.track_external(model, target.optimizer, workspace, *target.inputs)
    # The loss phase starts when the output head's forward ends (Transformers computes its loss
    # inside the model's forward) or else when the model's forward returns.
    handles = []

    def forward_done(module, args, output):
        if tracker.phase == "forward":
            tracker.phase = "loss"
    for module in (target.head, model):
        if module is not None:
            handles.append(module.register_forward_hook(forward_done))
    state_bytes = 0
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(rounding.__exit__, None, None, None)
            hooks = stack.enter_context(_ModuleHooksPerPass())
            stack.enter_context(tracker)
            stack.enter_context(semantics)
            for step in (1, 2):
                tracker.step = step
                tracker.phase = "forward"
                with target.autocast():
                    loss = target.forward_loss()
                tracker.phase = "backward"
                if target.backward is not None:
                    target.backward(loss)
                else:
                    loss.backward()
                del loss
                hooks.end_pass()  # Note [The tracker's hooks keep a leaf alive]
                tracker.phase = "optimizer_step"
                if target.step is not None:
                    target.step()
                elif target.optimizer is not None:
                    target.optimizer.step()
                tracker.phase = "zero_grad"
                if target.zero_grad is not None:
                    target.zero_grad()
                elif target.optimizer is not None:
                    target.optimizer.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                if step == 1:
                    tracker.phase = "between"
                    tracker.reset_mod_stats()
                    _untrack_host_steps(tracker, target.optimizer)
                    state_bytes = _optimizer_state_bytes(target.optimizer)
                    start = tracker.current()
                    start_total = tracker.current_bytes()
    finally:
        for h in handles:
            h.remove()
    return _report(target, tracker, state_bytes, start, start_total, semantics.sdpa,
                   semantics.kernels, arch)


def _untrack_host_steps(tracker, optimizer):
    """torch's Adam/AdamW/SGD keep each parameter's ``step`` counter on the CPU unless fused or
    capturable (torch/optim/adam.py, _init_group); on fake CPU tensors they are counted with the
    GPU's memory, so they are taken out of the tracker after the first step made them."""
    import torch
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0:
                st = step.untyped_storage()
                winfo, _ = tracker._WINFO.get(st, (None, None))
                if winfo is not None and winfo.mem_consumed > 0:
                    tracker._update_snap(_mem_update_type("DEL"), winfo)
                    winfo.mem_consumed = 0
                    winfo.size = st.size()


def _mem_update_type(name):
    from torch.distributed._tools import mem_tracker
    return getattr(mem_tracker._UpdateType, name)


def _optimizer_state_bytes(optimizer):
    import torch
    from . import trace_cuda
    if optimizer is None:
        return 0
    seen = {}
    host_steps = not all(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step" and host_steps and isinstance(value, torch.Tensor) and \
                    value.dim() == 0:
                continue  # on the CPU (_untrack_host_steps)
            if isinstance(value, torch.Tensor):
                seen[_storage_key(value)] = trace_cuda.round_allocation(
                    value.untyped_storage().nbytes())
    return sum(seen.values())


def _categories(snapshot, state_bytes, sharded=False):
    # "communication" exists only where FSDP2 runs (torchtitan); other traces keep their shape.
    out = {name: 0 for name in CATEGORIES if sharded or name != "communication"}
    for name, value in snapshot.items():
        if name == "optimizer":
            states = min(value, state_bytes)
            out["optimizer_states"] += states
            out["optimizer_transients"] += value - states
        else:
            out[name] += value
    return out


def _report(target, tracker, state_bytes, start, start_total, sdpa, kernels, arch):
    from . import trace_cuda
    phases = {}
    peak = None
    sharded = target.tracker_class is not None
    for (step, phase), record in sorted(tracker.records.items(), key=lambda kv: kv[0]):
        if phase not in PHASES:
            continue
        entry = {
            "peak_bytes": record["peak_bytes"],
            "categories": _categories(record["snapshot"], state_bytes if step == 2 else 0,
                                      sharded),
            "op": record["op"], "module": record["module"],
        }
        if step != 2:
            continue
        phases[phase] = entry
        # The steady state: the second step (the first makes the optimizer states lazily, and
        # on a GPU its peak is never above the second's).
        if peak is None or record["peak_bytes"] > peak["bytes"]:
            peak = {"bytes": record["peak_bytes"], "step": step, "phase": phase,
                    "op": record["op"], "module": record["module"],
                    "categories": entry["categories"]}
    workspaces = {"cublas": trace_cuda.cublas_workspace_bytes(arch)}
    for kind, nbytes in kernels.workspaces.items():
        workspaces[kind + "_attention_backward"] = nbytes
    result = {
        "format": FORMAT,
        "model": target.info,
        "gpu_arch": "sm%d%d" % arch,
        "sdpa_backends": dict(sorted(sdpa.backends.items())),
        "peak": peak,
        "phases": phases,
        "step_start": {"bytes": start_total,
                       "categories": _categories(start, state_bytes, sharded)},
        "workspaces": workspaces,
    }
    return result


def _listing(setup, fake_mode, arch, block):
    """What autograd saves, from a forward of the same setup without checkpointing."""
    import torch
    from . import trace_cuda
    plain = Setup(**dict(setup.to_json(), model=setup.model, checkpointing="none"))
    with fake_mode:
        target = _build_target(plain, fake_mode, listing=True)
        block = min(block, max(len(target.blocks) - 1, 0))
        recorder = SavedTensorRecorder(target.model, target.blocks)
        with trace_cuda.CudaSemantics(arch), recorder.recording():
            with target.autocast():
                loss = target.forward_loss()
        recorder.resolve(loss)
        rows, block_bytes = recorder.listing(block)
        outside, outside_bytes = recorder.listing(None)
        del loss
    return {"block": block, "block_saved_bytes": block_bytes, "ops": rows,
            "outside_blocks": outside, "outside_saved_bytes": outside_bytes,
            "note": "saved by autograd in one forward without checkpointing; bytes rounded as "
                    "the caching allocator rounds; storage numbers tensors that share memory; "
                    "block_saved_bytes counts each non-parameter storage once"}


def _versions(framework):
    import torch
    out = {"torch": torch.__version__.split("+")[0]}
    names = {"transformers": ["transformers", "peft"], "torchtune": ["torchtune", "torchao"],
             "torchtitan": ["torchtitan"], "litgpt": ["litgpt"],
             "llm-foundry": ["llmfoundry", "transformers"]}.get(framework, [])
    for name in names:
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "unknown")
        except Exception:  # noqa: BLE001 - optional
            pass
    return out


# ---- the command line ----------------------------------------------------------------------------

def _parse_bool(text):
    return str(text).lower() in ("1", "true", "yes", "on")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "grid":
        from . import trace_grid
        return trace_grid.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m memplan.trace",
        description="Trace one training step of the real framework code on fake tensors (no "
                    "GPU) and print the peak allocated bytes per category and phase as the CUDA "
                    "caching allocator counts them (JSON). `python -m memplan.trace grid --help` "
                    "regenerates the checked-in grid.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Figures are allocated bytes (torch.cuda.max_memory_allocated), not reserved "
               "bytes or nvidia-smi. See docs/trace.md.")
    for name, (default, meaning) in Setup.FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if name == "model":
            parser.add_argument(flag, required=True, help=meaning)
        elif name in ("qlora", "compile"):
            parser.add_argument(flag, action="store_true", help=meaning)
        elif isinstance(default, int) and not isinstance(default, bool):
            parser.add_argument(flag, type=int, default=default,
                                help="%s (default %s)" % (meaning, default))
        elif name in ("layers", "lora_alpha"):
            parser.add_argument(flag, type=int, default=default, help=meaning)
        elif name == "dropout":
            parser.add_argument(flag, type=float, default=default, help=meaning)
        elif name == "lora_targets":
            parser.add_argument(flag, default=None,
                                help=meaning + " (comma-separated)")
        else:
            parser.add_argument(flag, default=default, help="%s (default %s)" % (meaning,
                                                                                  default))
    parser.add_argument("--saved-tensors", action="store_true",
                        help="also list what autograd saves per op in one block")
    parser.add_argument("--block", type=int, default=0,
                        help="the block --saved-tensors lists (default 0)")
    parser.add_argument("-o", "--output", help="write the JSON here (atomically) instead of "
                                               "stdout")
    parser.add_argument("--format", choices=("json", "text"), default="json")
    args = parser.parse_args(argv)
    fields = {}
    for name in Setup.FIELDS:
        value = getattr(args, name)
        if name == "lora_targets" and value:
            value = [v.strip() for v in value.split(",") if v.strip()]
        fields[name] = value
    try:
        setup = Setup(**fields)
        result = run(setup, saved_tensors=args.saved_tensors, listing_block=args.block)
    except TraceError as error:
        sys.stderr.write("memplan.trace: error: %s\n" % error)
        return 2
    text = json.dumps(result, indent=1) + "\n" if args.format == "json" else format_text(result)
    if args.output:
        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def write_atomic(path, text):
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, ".%s.tmp.%d" % (os.path.basename(path), os.getpid()))
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _gib(n):
    return "%.3f GiB" % (n / 2**30)


def format_text(result):
    lines = []
    s = result["setup"]
    lines.append("%s %s, %s layers, %d x %d, %s, %s, checkpointing %s, loss %s%s" % (
        s["framework"], result["model"].get("name", s["model"]), result["model"].get("layers"),
        s["micro_batch"], s["seq_len"], s["precision"], s["optimizer"], s["checkpointing"],
        s["loss"], ", LoRA r=%d%s" % (s["lora_rank"], " QLoRA" if s["qlora"] else "")
        if s["lora_rank"] else ""))
    peak = result["peak"]
    lines.append("peak allocated %s (%d bytes) in %s (step %d), at %s in %s" % (
        _gib(peak["bytes"]), peak["bytes"], peak["phase"], peak["step"], peak["op"],
        peak["module"]))
    header = "  %-22s" % "category" + "".join("%16s" % p for p in PHASES)
    lines.append(header)
    for cat in [c for c in CATEGORIES if c in peak["categories"]]:
        row = "  %-22s" % cat
        for phase in PHASES:
            value = result["phases"].get(phase, {}).get("categories", {}).get(cat, 0)
            row += "%16s" % ("%.3f" % (value / 2**30))
        lines.append(row)
    row = "  %-22s" % "total (GiB)"
    for phase in PHASES:
        row += "%16s" % ("%.3f" % (result["phases"].get(phase, {}).get("peak_bytes", 0) /
                                   2**30))
    lines.append(row)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # Run the package's module, not this __main__ copy, so the adapters' TraceError (imported
    # from memplan.trace) is the one main() catches.
    from memplan.trace import main as _main
    sys.exit(_main())
