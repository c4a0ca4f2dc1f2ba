"""memplan.torch: train a torch.nn.Module with its parameters and optimizer in memplan's engine.

    import memplan.torch
    model = GPT(...)
    trainer = memplan.torch.offload(model, path="/mnt/nvme/run1", lr=3e-4, weight_decay=0.1)
    for batch in data:
        loss = model(batch)          # parameters fetched per module, released after
        loss.backward()              # gradients handed to the engine as they are produced
        trainer.step()               # memplan's CPU AdamW over the (NVMe-resident) states

How it works (the ZeRO-3 pattern, on memplan's Engine):
  - Every module that owns parameters directly is one engine "module" (a fetch unit), except
    inside a block (``fetch_units``; by default a Transformers model's ``_no_split_modules``
    class, its decoder layer), which is one unit with every parameter of its sub-tree: one fetch
    per layer instead of one per Linear. ``fetch_units()`` reports the grouping. Its
    parameters are registered with their initial values, then their storage is dropped: the engine
    holds them (GPU, pinned CPU or NVMe, as the schedule says) and ``param.data`` is empty between
    uses.
  - A forward pre-hook fetches the unit and points each ``param.data`` at the engine's working
    copy (no copy: a view of the engine's memory); a forward hook releases it and wraps the
    outputs in an identity autograd function whose backward fetches the unit again before the
    unit's own backward runs.
  - A hook on each parameter's gradient accumulator hands the gradient to the engine as soon as
    it is complete; once all of a unit's gradients are in, the unit is released. Anything still
    fetched is released when the backward pass ends.
  - ``step()`` runs the engine's optimizer step (AdamW by default, matching torch.optim.AdamW).
  - With ``overlap_optimizer=True`` the optimizer runs during backward instead: when a step's first
    gradient reaches the engine, the step's options are given to it (``Engine.prepare_step``), and
    each optimizer sub-group is stepped (states read, updated, written back, new weights written
    to their tier) as soon as its last gradient is in; ``step()`` only finishes what is left. The
    results are the serial ones, bit for bit. The options of a step are those in effect when its
    backward begins: change them before the backward (``set_options(lr=...)``), not in that step's
    ``step()`` call, which then raises ValueError and drops the step (the weights as before it).
    Leave it off when the options are known only after backward (clipping by the global gradient
    norm, skipping fp16 steps whose gradients overflowed): those steps need every gradient first.

Note [Views of parameters]
A view of a parameter saved for backward would keep pointing at the engine memory the parameter
had in forward, which the engine has reused by then: backward would compute with other values,
silently. So during the first step (until its step() returns) every unit's forward runs under a
saved-tensors pack hook that compares each saved tensor's storage with those of the parameters
fetched now; a saved view of one (not the Parameter itself) raises RuntimeError naming the module
and the parameter. Later steps run the same code, so they are not checked again.

Rules (as with DeepSpeed ZeRO-3): a module must use its parameters in its own forward, directly
in operations that save the parameter itself for backward (nn.Embedding, nn.LayerNorm, conv do;
F.linear is replaced, while an engine holds parameters, by a version that does, see _Linear). A
parameter sliced, transposed or reshaped into a view that autograd saves (nn.MultiheadAttention's
packed in_proj_weight, ``x @ self.w.t()``) would be read from memory the engine has since reused:
not supported. A parameter
that gets no gradient in a step (an unused branch, a MoE expert no token reached) is skipped as
torch's optimizers skip a parameter whose grad is None: no weight decay, no moment decay, and its
own step count does not advance (the engine's Note [Skipped parameters]). With several ranks,
every rank must skip the same parameters.

Frozen parameters (``requires_grad=False`` when offload() is called: LoRA's base weights) are held
by the engine like the others, on the schedule's tier (NVMe included), and fetched for forward and
for backward (their module's backward needs them for the input's gradient), but they take no
gradient, have no optimizer state and are never written after offload() (the engine's Note
[Frozen parameters]). A module with frozen parameters is released for backward once its inputs'
gradients are computed (an identity function on its positional inputs), or at the end of the
backward pass when no positional input needs a gradient. Freezing or unfreezing a parameter after
offload() is not seen.

Works on CPU-only PyTorch (1.13 and later; the engine's host runtime, where "device" memory is
host memory) and on CUDA (the engine's CUDA runtime; tensors made through
__cuda_array_interface__).

Across processes (ZeRO-3 over torch.distributed). When torch.distributed is initialised (or a
``process_group`` is given) and has more than one rank, every rank runs its own engine over the
same parameters and holds a 1/world-size shard of each (ZeRO-3): its tiers and its optimizer hold
only that partition, a fetch all-gathers a unit's parameters whole, and each gradient is
reduce-scattered and divided by the world size, so every rank's optimizer sees the mean gradient
over the ranks, as DDP averages. Data-parallel semantics are DDP's: launch one process per rank
(``torchrun --nproc_per_node N train.py``), give each rank its own micro-batch (the global batch is
their union; with equal micro-batches and a mean loss the result is the global batch's mean
gradient), and call forward, backward and step() on every rank in the same order with the same
model (the ranks must produce the same gradients in the same order, as DDP without
find_unused_parameters). The initial values are broadcast from the group's first rank, as DDP
does. With ``path`` each rank keeps its stores under ``<path>/rank<r>/``.

Note [The collective across processes]
The engine's Collective is called from C++, on the thread that called into the engine, while the
binding has released the GIL (every engine call releases it). On CUDA the engine uses its own
NcclCollective: the first rank makes the NCCL unique id and broadcasts it over the process group,
and no Python runs in the collectives at all. On the host runtime (CPU, gloo) the collective is
_ProcessGroupCollective below, called through a C++ Collective in the binding that takes the GIL
back on that same thread for each call (Note [A collective backed by Python] in bindings.cc):
simpler than moving the engine's collectives out to Python around every engine call, and correct
because the engine never calls its Collective from a thread of its own. gloo has no
reduce-scatter, so it is an fp32 all-reduce of the whole buffer of which each rank keeps its slot
(16-bit values summed in fp32 and rounded once, as the engine's thread collective does).

On CUDA, work is ordered with streams, never with waits (offload/engine.h, "Streams"): every
release and every gradient hand-over passes torch's current stream, so the engine does not reuse a
released unit's memory before the kernels launched on it have run (a forward hook runs when the
kernels are launched, not when they finish), and copies a gradient only after the kernels that
write it. Gradients are recorded on the engine's gradient stream and dropped: torch's allocator
reuses their memory once the engine has read it, not at the end of the step. The engine runs on
the module's CUDA device (``device``, else torch's current device).
"""

import os
import shutil
import tempfile
import types

import torch

import memplan

__all__ = ["offload", "OffloadedModule"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TYPESTR = {"fp32": "<f4", "bf16": "<i2", "fp16": "<f2"}  # bf16 is viewed back from int16


class _CudaArray:
    """Just enough of __cuda_array_interface__ for torch.as_tensor to wrap engine memory."""

    def __init__(self, pointer, numel, dtype):
        self.__cuda_array_interface__ = {
            "shape": (numel,), "typestr": _TYPESTR[dtype], "data": (pointer, False),
            "version": 2, "strides": None}


class _ProcessGroupCollective:
    """The engine's Collective over a torch.distributed process group, for host memory (Note [The
    collective across processes]). Called by the engine with memoryviews of its host buffers."""

    def __init__(self, group):
        import torch.distributed as dist
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def _tensor(self, view, count, dtype):
        return torch.frombuffer(view, dtype=_DTYPES[dtype], count=count)

    def all_gather(self, send, recv, count, dtype):
        # Bytes: the values are only moved, and gloo gathers uint8 on every version.
        src = torch.frombuffer(send, dtype=torch.uint8)
        dst = torch.frombuffer(recv, dtype=torch.uint8)
        outputs = list(dst.view(self.world_size, -1).unbind(0))
        if src.data_ptr() == outputs[self.rank].data_ptr():
            src = src.clone()  # in place (send is this rank's slot of recv)
        self.dist.all_gather(outputs, src, group=self.group)

    def reduce_scatter(self, send, recv, count, dtype):
        full = self._tensor(send, count * self.world_size, dtype)
        summed = full.to(torch.float32, copy=True)
        self.dist.all_reduce(summed, group=self.group)
        mine = summed[self.rank * count:(self.rank + 1) * count]
        self._tensor(recv, count, dtype).copy_(mine)

    def all_reduce(self, send, recv, count, dtype):
        buffer = self._tensor(send, count, dtype)
        summed = buffer.to(torch.float32, copy=True)
        self.dist.all_reduce(summed, group=self.group)
        buffer.copy_(summed)


def _write_checkpoint(module, state, path):
    """save()'s writing, on one rank (see OffloadedModule.save)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory")
    tmp = tempfile.mkdtemp(prefix=".memplan-save-", dir=parent)
    try:
        if hasattr(module, "save_pretrained"):
            module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        else:
            from safetensors.torch import save_file
            seen = set()
            unique = {}
            for name, t in state.items():  # safetensors stores a shared tensor once
                if id(t) not in seen:
                    seen.add(id(t))
                    unique[name] = t.contiguous()
            save_file(unique, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.isdir(path):
            for name in os.listdir(tmp):
                os.replace(os.path.join(tmp, name), os.path.join(path, name))
            os.rmdir(tmp)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _storage_address(tensor):
    """The address of the storage under `tensor` (shared by all views of it)."""
    if hasattr(tensor, "untyped_storage"):
        return tensor.untyped_storage().data_ptr()
    return tensor.storage().data_ptr()


def _block_types(module, fetch_units):
    """The module classes (names or types) fetched as one unit with their whole sub-tree."""
    if fetch_units == "module":
        return ()
    if fetch_units == "auto":
        # A Transformers model names the blocks it must not split (its decoder layer).
        return tuple(getattr(module, "_no_split_modules", None) or ())
    if isinstance(fetch_units, (str, type)):
        fetch_units = (fetch_units,)
    types_ = tuple(fetch_units)
    if not all(isinstance(t, (str, type)) for t in types_):
        raise ValueError("memplan.torch: fetch_units must be 'auto', 'module', or module classes "
                         "(types or class names)")
    return types_


def _process_group(process_group):
    """(group, rank, world size) of the process group to train over: the one given, else
    torch.distributed's default group when it is initialised; (None, 0, 1) for one process."""
    import torch.distributed as dist
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        process_group = dist.group.WORLD
    elif not (dist.is_available() and dist.is_initialized()):
        raise ValueError("memplan.torch: process_group given but torch.distributed is not "
                         "initialised")
    return process_group, dist.get_rank(process_group), dist.get_world_size(process_group)


def _group_source(group):
    """The global rank of the group's first rank (the source of broadcasts)."""
    import torch.distributed as dist
    if group is None or group is dist.group.WORLD:
        return 0
    try:
        return dist.get_global_rank(group, 0)
    except AttributeError:  # torch < 2.0
        return dist.distributed_c10d._get_global_rank(group, 0)


class _Unit:
    """One fetch unit: a module with parameters of its own, or a block (fetch_units) with every
    parameter of its sub-tree."""

    __slots__ = ("name", "module", "params", "fetched", "pending", "backward_fetches", "frozen")

    def __init__(self, name, module):
        self.name = name
        self.module = module
        self.params = []          # _Param
        self.fetched = 0          # engine fetches not yet released
        self.pending = 0          # gradients still to come in this backward
        self.backward_fetches = 0
        self.frozen = False       # holds a frozen parameter (released after its inputs' backward)


class _Param:
    __slots__ = ("id", "name", "param", "shape", "numel", "units", "views", "accumulator",
                 "frozen")

    def __init__(self, pid, name, param):
        self.id = pid
        self.name = name
        self.param = param
        self.shape = tuple(param.shape)
        self.numel = max(1, param.numel())
        self.units = []           # _Unit using it
        self.views = 0            # units that fetched it (param.data points at the engine)
        self.accumulator = None   # its AccumulateGrad node, kept alive for the hook
        self.frozen = not param.requires_grad  # decided at offload(): held, never stepped


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward fetches the unit before the unit's backward."""

    @staticmethod
    def forward(ctx, owner, unit, *tensors):
        ctx.owner = owner
        ctx.unit = unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._fetch_for_backward(ctx.unit)
        return (None, None) + grads


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done (the
    inputs' gradients are complete), and releases a unit that holds frozen parameters: they
    give no gradient whose arrival could say so."""

    @staticmethod
    def forward(ctx, owner, unit, *tensors):
        ctx.owner = owner
        ctx.unit = unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._release_after_backward(ctx.unit)
        return (None, None) + grads


class _Linear(torch.autograd.Function):
    """F.linear for engine-held weights that saves the Parameter itself for backward.

    torch's own linear saves ``weight.t()``, a view made in forward: it would keep pointing at the
    engine memory the weight had then, which the engine may have reused by the time backward runs.
    The Parameter, saved as itself, points at wherever the backward fetch put it (DeepSpeed ZeRO-3
    wraps linear for the same reason).
    """

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight, bias)
        return _original_linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(weight)
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = flat.t().matmul(input.reshape(-1, input.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(0)
        return grad_input, grad_weight, grad_bias


_original_linear = torch.nn.functional.linear
_managed_weights = set()  # id() of the Parameters that live in an engine


def _linear(input, weight, bias=None):
    # A frozen weight too, when the input needs a gradient: its backward reads the weight.
    if (id(weight) in _managed_weights and torch.is_grad_enabled() and
            (weight.requires_grad or input.requires_grad)):
        return _Linear.apply(input, weight, bias)
    return _original_linear(input, weight, bias)


def _manage(params):
    _managed_weights.update(id(p) for p in params)
    torch.nn.functional.linear = _linear


def _unmanage(params):
    _managed_weights.difference_update(id(p) for p in params)
    if not _managed_weights:
        torch.nn.functional.linear = _original_linear


class OffloadedModule:
    """A torch module whose parameters and optimizer live in memplan's engine.

    Create it with ``memplan.torch.offload(module, ...)``. The module is modified in place (hooks,
    parameter storage); ``close()`` removes the hooks and gives the parameters their trained values
    back as ordinary tensors.
    """

    def __init__(self, module, schedule, *, runtime="auto", optimizer_options=None,
                 gradient_accumulation_steps=1, device=None, process_group=None,
                 fetch_units="auto", resume=False, overlap_optimizer=False):
        if gradient_accumulation_steps < 1:
            raise ValueError("gradient_accumulation_steps must be >= 1")
        self.block_types = _block_types(module, fetch_units)
        self.block_types_given = fetch_units not in ("auto", "module")
        self.group, self.rank, self.world_size = _process_group(process_group)
        self.module = module
        self.schedule = schedule
        self.optimizer_options = dict(optimizer_options or {})
        self.accumulation = int(gradient_accumulation_steps)
        if device is None:
            first = next(module.parameters(), None)
            if first is not None and first.device.type == "cuda":
                device = first.device
        device = torch.device(device) if device is not None else None
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        wants_cuda = device is not None and device.type == "cuda"
        if runtime == "auto" and wants_cuda:
            # Never fall back to the host runtime while torch trains on the GPU (an old driver, a
            # build without CUDA): that must be an error, not a slow, wrong-device run.
            runtime = "cuda"
        collective = None
        if self.world_size > 1:
            collective = self._collective(wants_cuda, runtime)
        self.engine = memplan.Engine(schedule, runtime=runtime,
                                     device=device.index if wants_cuda else None,
                                     collective=collective, resume=resume)
        self.resumed_step = 0  # with resume: the step the engine's stores continue from
        self.dtype_name = self.engine.param_dtype
        self.dtype = _DTYPES[self.dtype_name]
        self.on_cuda = self.engine.runtime.startswith("cuda")
        if self.on_cuda:
            self.device = torch.device("cuda", self.engine.device)
        else:
            self.device = device if device is not None else torch.device("cpu")
        self.units = []
        self.params = []
        self._by_param = {}
        self._hooks = []
        self._micro = 0             # backward passes since the last step
        self._callback_queued = False
        self._grad_sums = {}        # param id -> summed gradient (accumulation)
        self._grads_given = set()
        self.overlap_optimizer = bool(overlap_optimizer)
        self._prepared = None       # the options given to the engine for the step in progress
        self._closed = False
        # Note [Views of parameters]: until the first step ends, every tensor a unit's forward
        # saves for backward is checked; a view of an engine-held parameter is refused.
        self._check_views = True
        self._view_storages = {}    # storage address of a fetched parameter's view -> _Param
        self._view_checks = []      # saved_tensors_hooks contexts entered by pre-hooks
        self._register()

    # ---- set-up ----------------------------------------------------------------------------------

    def _is_block(self, module):
        """Whether `module` is one fetch unit with its whole sub-tree (fetch_units)."""
        if not self.block_types:
            return False
        return any(type(module).__name__ == t if isinstance(t, str) else isinstance(module, t)
                   for t in self.block_types)

    def _collective(self, wants_cuda, runtime):
        """The engine's collective over self.group (Note [The collective across processes])."""
        import torch.distributed as dist
        if wants_cuda or runtime == "cuda":
            unique_id = [memplan.nccl_unique_id() if self.rank == 0 else None]
            dist.broadcast_object_list(unique_id, src=_group_source(self.group), group=self.group)
            return types.SimpleNamespace(rank=self.rank, world_size=self.world_size,
                                         nccl_unique_id=unique_id[0])
        return _ProcessGroupCollective(self.group)

    def _broadcast(self, tensor):
        """The group's first rank's values of `tensor` (a CPU float32 tensor), as DDP starts."""
        import torch.distributed as dist
        if self.world_size == 1:
            return tensor
        if dist.get_backend(self.group) == "nccl":
            moved = tensor.to(self.device)
            dist.broadcast(moved, src=_group_source(self.group), group=self.group)
            return moved.cpu()
        dist.broadcast(tensor, src=_group_source(self.group), group=self.group)
        return tensor

    def _register(self):
        # First every unit and which units use each parameter (a tied parameter is registered
        # once, with the other units as further users), then the engine.
        for module_name, sub in self.module.named_modules():
            if isinstance(sub, torch.nn.MultiheadAttention):
                raise ValueError(
                    f"memplan.torch: {module_name or '<root>'} is an nn.MultiheadAttention: its "
                    "forward slices the packed in_proj_weight into views that autograd saves for "
                    "backward, by when the engine has reused their memory; not supported (use "
                    "separate q/k/v nn.Linear layers and F.scaled_dot_product_attention, as "
                    "Transformers models do)")
        covered = set()  # modules inside a block unit
        for module_name, sub in self.module.named_modules():
            if id(sub) in covered:
                continue
            if self._is_block(sub):
                covered.update(id(m) for m in sub.modules())
                own = list(sub.named_parameters())
            else:
                own = [(n, p) for n, p in sub._parameters.items() if p is not None]
            if not own:
                continue
            unit = _Unit(module_name or "<root>", sub)
            for param_name, p in own:
                full = f"{module_name}.{param_name}" if module_name else param_name
                entry = self._by_param.get(id(p))
                if entry is None:
                    entry = _Param(None, full, p)
                    self._by_param[id(p)] = entry
                    self.params.append(entry)
                unit.params.append(entry)
                unit.frozen = unit.frozen or entry.frozen
                entry.units.append(unit)
            self.units.append(unit)
        if not self.params:
            raise ValueError("memplan.torch: the module has no parameters")
        if self.block_types and self.block_types_given:
            found = {type(u.module).__name__ for u in self.units} | {
                t for u in self.units for t in self.block_types
                if not isinstance(t, str) and isinstance(u.module, t)}
            missing = [t if isinstance(t, str) else t.__name__ for t in self.block_types
                       if (t if isinstance(t, str) else t) not in found]
            if missing:
                raise ValueError(f"memplan.torch: fetch_units names {', '.join(missing)}, but no "
                                 "module with parameters in the model is of that class")
        if all(e.frozen for e in self.params):
            raise ValueError("memplan.torch: every parameter is frozen (requires_grad=False); "
                             "nothing to train")
        for entry in self.params:
            init = entry.param.detach().to("cpu", torch.float32).contiguous().reshape(-1)
            init = self._broadcast(init)
            entry.id = self.engine.add_parameter(
                entry.name, entry.units[0].name, list(entry.shape) or [1], init,
                [u.name for u in entry.units[1:]], frozen=entry.frozen)
        # Reads the initial values (with resume, the frozen ones only: the others are the stores').
        self.resumed_step = self.engine.start()["epoch"]
        _manage(e.param for e in self.params)
        for entry in self.params:
            if entry.frozen:
                continue
            # The gradient accumulator of a leaf: its hooks run once per backward pass, after the
            # gradient is complete (every use summed). Made while the parameter still has its
            # shape, which the accumulator records and checks gradients against; kept alive so
            # that every backward pass uses this one.
            accumulator = entry.param.expand_as(entry.param).grad_fn.next_functions[0][0]
            accumulator.register_hook(self._make_grad_hook(entry))
            entry.accumulator = accumulator
        for entry in self.params:
            entry.param.data = torch.empty(0, dtype=self.dtype, device=self.device)
            entry.param.grad = None
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(self._make_pre_hook(unit)))
            self._hooks.append(unit.module.register_forward_hook(self._make_post_hook(unit)))
    # ---- fetch and release -----------------------------------------------------------------------

    def _view(self, entry):
        if self.on_cuda:
            pointer = self.engine.device_pointer(entry.id)
            t = torch.as_tensor(_CudaArray(pointer, entry.numel, self.dtype_name),
                                device=self.device)
            if self.dtype_name == "bf16":
                t = t.view(torch.bfloat16)
        else:
            t = torch.frombuffer(self.engine.host_view(entry.id, entry.numel), dtype=self.dtype)
        return t.view(entry.shape) if entry.shape else t.view(())

    def _fetch(self, unit):
        self.engine.fetch(unit.name)
        unit.fetched += 1
        for entry in unit.params:
            if entry.views == 0:
                entry.param.data = self._view(entry)
                if self._check_views:
                    self._view_storages[_storage_address(entry.param)] = entry
            entry.views += 1

    def _stream(self):
        """torch's current stream on the engine's device, as the engine takes it (0 on CPU)."""
        if not self.on_cuda:
            return 0
        return torch.cuda.current_stream(self.device).cuda_stream

    def _release(self, unit):
        # The unit's kernels may still be queued: the engine waits for this stream before reusing
        # the memory (no host synchronisation).
        self.engine.release(unit.name, stream=self._stream())
        unit.fetched -= 1
        for entry in unit.params:
            entry.views -= 1
            if entry.views == 0:
                self._view_storages.pop(_storage_address(entry.param), None)
                entry.param.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def _make_pre_hook(self, unit):
        def pre_hook(module, inputs):
            self._fetch(unit)
            if self._check_views and torch.is_grad_enabled():
                check = torch.autograd.graph.saved_tensors_hooks(
                    lambda t: self._check_saved(unit, t), lambda t: t)
                check.__enter__()
                self._view_checks.append(check)
            if unit.frozen and torch.is_grad_enabled():
                return self._wrap_inputs(unit, inputs)
            return None
        return pre_hook

    def _wrap_inputs(self, unit, inputs):
        """A unit with frozen parameters is released when its inputs' gradients are computed
        (_PostBackward); positional tensor inputs only (torch < 2 gives hooks no keywords)."""
        positions = [i for i, t in enumerate(inputs)
                     if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None  # released at the end of the backward pass instead
        wrapped = _PostBackward.apply(self, unit, *[inputs[i] for i in positions])
        items = list(inputs)
        for i, t in zip(positions, wrapped):
            items[i] = t
        return tuple(items)

    def _check_saved(self, unit, tensor):
        """The pack hook of Note [Views of parameters]: refuses a saved view of a parameter."""
        if id(tensor) in _managed_weights or tensor.layout != torch.strided:
            return tensor
        entry = self._view_storages.get(_storage_address(tensor))
        if entry is not None:
            while self._view_checks:
                self._view_checks.pop().__exit__(None, None, None)
            raise RuntimeError(
                f"memplan.torch: {unit.name} ({type(unit.module).__name__}) saves a view of "
                f"parameter {entry.name} for backward (a slice, transpose or reshape of it); the "
                "engine reuses that memory before backward runs, so this is not supported: use "
                "the parameter itself in the operation (as nn.Linear, nn.Embedding and "
                "nn.LayerNorm do)")
        return tensor

    def _release_after_backward(self, unit):
        if unit.backward_fetches > 0:
            unit.backward_fetches -= 1
            self._release(unit)

    def _make_post_hook(self, unit):
        def post_hook(module, inputs, output):
            if self._check_views and torch.is_grad_enabled() and self._view_checks:
                self._view_checks.pop().__exit__(None, None, None)
            wants_grad = torch.is_grad_enabled() and (
                unit.frozen or any(e.param.requires_grad for e in unit.params))
            if wants_grad:
                output, wrapped = self._wrap_outputs(unit, output)
                frozen_only = all(e.frozen for e in unit.params)
                if not wrapped and frozen_only and isinstance(output, (torch.Tensor, tuple, list)):
                    # Nothing of it needs a gradient: backward never comes through this unit.
                    self._release(unit)
                    return output
                if not wrapped:
                    # No tensor to hang the backward fetch on: keep the unit fetched until its
                    # gradients are in (or the backward pass ends).
                    unit.backward_fetches += 1
                    return output
            self._release(unit)
            return output
        return post_hook

    def _wrap_outputs(self, unit, output):
        if isinstance(output, torch.Tensor):
            if not output.requires_grad:
                return output, False
            return _PreBackward.apply(self, unit, output)[0], True
        if isinstance(output, (tuple, list)):
            positions = [i for i, t in enumerate(output)
                         if isinstance(t, torch.Tensor) and t.requires_grad]
            if not positions:
                return output, False
            wrapped = _PreBackward.apply(self, unit, *[output[i] for i in positions])
            items = list(output)
            for i, t in zip(positions, wrapped):
                items[i] = t
            return (type(output)(items) if isinstance(output, tuple) else items), True
        return output, False

    def _fetch_for_backward(self, unit):
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self._fetch(unit)
        unit.backward_fetches += 1
        if unit.pending == 0 and not unit.frozen:
            # Released when its gradients are all in; a unit with frozen parameters is released
            # after its inputs' backward instead (_PostBackward) or at the end of the pass.
            unit.pending = len(unit.params)

    def _make_grad_hook(self, entry):
        def grad_hook(*unused):
            grad = entry.param.grad
            entry.param.grad = None
            if grad is not None:
                self._gradient(entry, grad)
            for unit in entry.units:
                if unit.backward_fetches > 0 and unit.pending > 0:
                    unit.pending -= 1
                    if unit.pending == 0:
                        self._release_backward(unit)
        return grad_hook

    def _release_backward(self, unit):
        while unit.backward_fetches > 0:
            unit.backward_fetches -= 1
            self._release(unit)

    def _end_of_backward(self):
        self._callback_queued = False
        for unit in self.units:
            unit.pending = 0
            self._release_backward(unit)
        self._micro += 1

    # ---- gradients and the step ------------------------------------------------------------------

    def _gradient(self, entry, grad):
        grad = grad.detach()
        if grad.dtype != self.dtype:
            grad = grad.to(self.dtype)
        last = self._micro + 1 >= self.accumulation
        summed = self._grad_sums.pop(entry.id, None)
        if summed is not None:
            grad = summed.add_(grad)
        if not last:
            self._grad_sums[entry.id] = grad.clone() if summed is None else grad
            return
        if entry.id in self._grads_given:
            raise RuntimeError(f"memplan: gradient of {entry.name} produced twice in one step "
                               "(call step() after each backward, or set "
                               "gradient_accumulation_steps)")
        grad = grad.contiguous().reshape(-1)
        self._prepare()
        # The engine's copy waits for torch's stream, where the gradient is being computed.
        self.engine.grad_ready(entry.id, grad, stream=self._stream())
        self._grads_given.add(entry.id)

    def _prepare(self):
        """overlap_optimizer: the step's options to the engine before its first gradient."""
        if self.overlap_optimizer and self._prepared is None:
            self.engine.prepare_step(**self.optimizer_options)
            self._prepared = dict(self.optimizer_options)

    def set_options(self, **options):
        """Overrides optimizer options (lr, grad_scale, ...) for the coming steps. With
        overlap_optimizer a step's options are taken when its backward hands the first gradient
        over: call this before the backward of the first step they are for."""
        self.optimizer_options.update(options)

    def step(self, **options):
        """One optimizer step with the schedule's optimizer; keywords override the options given
        at creation for this and later steps (lr for a schedule, grad_scale for loss scaling).
        With overlap_optimizer the step was prepared with the options in effect when its backward
        began: keywords that change them raise ValueError, and the step is dropped (weights,
        states and step counts as before it; run its forward and backward again)."""
        if self._micro < self.accumulation:
            raise RuntimeError(f"memplan: step() after {self._micro} backward passes; "
                               f"gradient_accumulation_steps is {self.accumulation}")
        self.optimizer_options.update(options)
        if self._prepared is not None and self._prepared != self.optimizer_options:
            changed = sorted(k for k in set(self._prepared) | set(self.optimizer_options)
                             if self._prepared.get(k) != self.optimizer_options.get(k))
            try:
                self.engine.step(**self.optimizer_options)  # refused: the engine drops the step
            except RuntimeError:
                pass
            self._end_step()
            raise ValueError(
                f"memplan.torch: step() changed {', '.join(changed)} after the step's backward "
                "had begun with the old values (overlap_optimizer=True); the step was dropped. "
                "Give new options before the backward: trainer.set_options(...)")
        # Parameters without a gradient in the last micro-batch: their summed gradients of the
        # earlier ones; without any, skipped as torch's optimizers skip a parameter whose grad is
        # None (weights, states and its step count unchanged).
        for entry in self.params:
            if entry.id not in self._grads_given and not entry.frozen:
                grad = self._grad_sums.pop(entry.id, None)
                if grad is None:
                    self.engine.no_gradient(entry.id)
                else:
                    self.engine.grad_ready(entry.id, grad.contiguous().reshape(-1),
                                           stream=self._stream())
        try:
            self.engine.step(**self.optimizer_options)
        finally:
            if self._prepared is not None:
                self._end_step()  # done, or failed and dropped by the engine
        if self._check_views:
            self._check_views = False  # the first step's forward saw every pattern
            self._view_storages.clear()
            while self._view_checks:  # left by a forward that raised
                self._view_checks.pop().__exit__(None, None, None)
        self._end_step()

    def _end_step(self):
        self._grads_given.clear()
        self._grad_sums.clear()
        self._micro = 0
        self._prepared = None

    def zero_grad(self, set_to_none=True):
        """Gradients never stay on the parameters: nothing to do (for optimizer-like use)."""

    # ---- inspection ------------------------------------------------------------------------------

    def stats(self):
        return self.engine.stats()

    def fetch_units(self):
        """The fetch units, in registration order: [{"name", "type", "params", "elements",
        "frozen_params"}]; a block (fetch_units) holds every parameter of its sub-tree."""
        return [{"name": u.name, "type": type(u.module).__name__, "params": len(u.params),
                 "elements": sum(e.numel for e in u.params),
                 "frozen_params": sum(1 for e in u.params if e.frozen)} for u in self.units]

    def master_weights(self):
        """{name: fp32 CPU tensor} of the engine's master weights (a checkpoint's content)."""
        out = {}
        for entry in self.params:
            if entry.frozen:
                t = self._frozen_values(entry)
            else:
                t = torch.empty(entry.numel, dtype=torch.float32)
                self.engine.read_master(entry.id, t)
            out[entry.name] = t.view(entry.shape) if entry.shape else t.view(())
        return out

    def state_dict(self):
        """The module's state_dict() with the engine's values: {name: CPU tensor}, parameters as
        fp32 master weights (frozen ones as held), buffers as they are, under the module's own
        names (a tied parameter under each of its names, one tensor). With world size > 1 this is
        a collective (the shards are gathered): every rank calls it."""
        weights = self.master_weights()
        by_param = {id(e.param): weights[e.name] for e in self.params}
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            out[name] = by_param[id(t)] if id(t) in by_param else t.detach().cpu()
        return out

    def save(self, path):
        """Writes the trained weights as safetensors into the directory `path`: for a
        Transformers model (``save_pretrained``) its own layout (config.json, model.safetensors,
        tied weights once), which ``from_pretrained`` loads; for another module
        ``model.safetensors`` with state_dict() names (tied tensors once). Every rank calls it
        (the weights are gathered from the shards); the first rank writes, into a temporary
        directory beside `path` that is renamed into place, so a failure leaves nothing half
        written. Raises on every rank if the write failed."""
        state = self.state_dict()
        error = None
        if self.rank == 0:
            try:
                _write_checkpoint(self.module, state, path)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = f"{type(e).__name__}: {e}"
        if self.world_size > 1:
            import torch.distributed as dist
            box = [error]
            dist.broadcast_object_list(box, src=_group_source(self.group), group=self.group)
            error = box[0]
        if error is not None:
            raise OSError(f"memplan.torch: writing the checkpoint {path} failed: {error}")

    def _frozen_values(self, entry):
        """A frozen parameter's values (it has no master weights): its working copy, fetched."""
        unit = entry.units[0]
        self._fetch(unit)
        try:
            return self._view(entry).reshape(-1)[:entry.numel].to("cpu", torch.float32,
                                                                  copy=True)
        finally:
            self._release(unit)

    def close(self):
        """Removes the hooks, gives the parameters their trained values (fp32 master weights, in
        the parameters' original device) and closes the engine."""
        if self._closed:
            return
        weights = self.master_weights()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        _unmanage(e.param for e in self.params)
        for entry in self.params:
            entry.param.data = weights[entry.name].to(self.device)
            entry.accumulator = None
        self.engine.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def offload(module, path=None, *, param_tier=None, optimizer_tier=None, lr=1e-3,
            betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, optimizer="adamw", runtime="auto",
            dtype="fp32", gradient_accumulation_steps=1, schedule=None, device=None,
            process_group=None, fetch_units="auto", resume=False, overlap_optimizer=False,
            **schedule_options):
    """Puts `module`'s parameters and its optimizer into memplan's engine.

    path: a directory the engine may create and own (parameters and optimizer states go to NVMe
    there); without it both stay in host memory (param_tier "cpu", optimizer_tier "cpu").
    optimizer: "adamw" (decoupled weight decay, as torch.optim.AdamW) or "adam" (L2 decay, as
    torch.optim.Adam). Other keywords go to memplan.schedule (pinned_budget_bytes,
    sub_group_elements, prefetch_bytes, max_live_bytes, direct, ...); or pass a whole `schedule`
    (a dict, or the path of a Schedule JSON file such as ``memplan plan --emit-schedule`` writes).
    device: the CUDA device to train on ("cuda:1", 1, a torch.device); default: the module's
    parameters' device if they are on CUDA, else torch's current device when runtime is "cuda".
    process_group: the torch.distributed group to train over (ZeRO-3, one shard per rank); None:
    the default group when torch.distributed is initialised with more than one rank, else one
    process. Every rank calls offload() with the same module and arguments.
    fetch_units: which modules are fetched as one unit with their whole sub-tree: "auto" (the
    model's ``_no_split_modules`` classes, a Transformers model's decoder layer; otherwise
    "module"), "module" (every module with parameters of its own is a unit), or a list of module
    classes or class names. ``fetch_units()`` on the result reports the grouping.
    nn.MultiheadAttention is refused (it saves views of its packed weight for backward).
    resume: continue from the engine's last complete step in `path` (the optimizer on NVMe):
    trained parameters and optimizer states come from the stores (the module's values are used
    for frozen parameters only); ``resumed_step`` on the result says which step, so the caller
    skips the data already seen. With several ranks, the last step every rank completed.
    overlap_optimizer: run each step's optimizer during its backward (with the optimizer on NVMe;
    see the module's description): the options of a step are those in effect when its backward
    begins (``set_options``). Off by default: the step runs after backward, as before.
    """
    if optimizer not in ("adamw", "adam"):
        raise ValueError(f"optimizer must be 'adamw' or 'adam', not {optimizer!r}")
    if schedule is None:
        tier = "nvme" if path is not None else "cpu"
        schedule = memplan.schedule(path=path, param_tier=param_tier or tier,
                                    optimizer_tier=optimizer_tier or tier, dtype=dtype,
                                    optimizer="adam", **schedule_options)
    options = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps,
               "weight_decay": weight_decay, "decoupled": optimizer == "adamw"}
    return OffloadedModule(module, schedule, runtime=runtime, optimizer_options=options,
                           gradient_accumulation_steps=gradient_accumulation_steps, device=device,
                           process_group=process_group, fetch_units=fetch_units, resume=resume,
                           overlap_optimizer=overlap_optimizer)
