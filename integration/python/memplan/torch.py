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
    Clipping is one of those options: declare it before backward (``offload(...,
    max_grad_norm=...)``); the engine runs a step that may clip beside backward and runs it again
    after it when the norm says it must clip (the engine's Note [Clipping by the global norm]).

Note [Clipping and loss scaling in memplan.torch]
Gradients never sit on the parameters, so torch's clip_grad_norm_ and GradScaler, which read
``p.grad``, would see none (clip_grad_norm_ returned 0 and clipped nothing). While an engine holds
parameters, torch.nn.utils.clip_grad_norm_ on them is the engine's (Note [What memplan.torch
patches]): the step's pending gradients are given to the engine (_flush_pending), its global norm
(every rank's, torch's p-norm) divided by the loss scale is returned, and the step (``_clip``) is
clipped by torch's coefficient, applied by the engine at step(). Over part of the module's
parameters it raises; beside parameters the engine does not hold, one norm over all and one
coefficient for all (``_coefficient``). A GradScaler's unscale_ on an OffloadOptimizer asks the
engine whether a gradient overflowed (a NaN or inf norm) and records the answer where the
GradScaler looks for it (found_inf_per_device); an overflowed step is dropped there (the scaler
then skips step() and lowers its scale), a finite one steps with grad_scale = the loss scale
(``_loss_scale``). Each is this step's only: _end_step() forgets them.

Note [A step that raised]
torch accumulates a second backward into .grad; the engine takes one gradient per parameter per
step. A gradient hook that raises (a second backward, a sparse gradient) drops the whole step
(_abandon: the engine's AbandonStep, what backward holds fetched released, the step's bookkeeping
forgotten), so that the next step is clean; so does zero_grad() in the middle of a step, as
torch's drops the gradients it would have used. A forward that raises leaves the units it
fetched: the root module's pre-hook counts forwards, and the next one, seeing the count not back
to zero, releases what is left (not what waits for a backward).

Note [What the engine holds]
The engine keeps fp32 master weights. A trainable parameter it cannot represent exactly
(complex, float64, quantised) or whose gradient is sparse (nn.Embedding(sparse=True)) is refused
at offload(), naming it; a frozen integer, bool, quantised or float64 one (a quantised base's
packed codes) is left out of the engine (``kept``): an ordinary tensor of the module, untouched.

Note [A module fixed in structure]
offload() registers the Parameters the module holds then, under every name the module holds
them (``owners``). A Parameter replaced afterwards (``m.w = nn.Parameter(...)``, a head
re-initialised, resize_token_embeddings) would be used by forward and trained by nobody; a
``.data`` assigned would be overwritten at the next fetch. So each fetch checks both and raises,
naming the parameter; new values go through load_state_dict. A submodule replaced or added
(``model[2] = nn.Linear(...)``) brings Parameters no hook of the engine sees: the root's forward
checks for modules not seen at offload() that hold trainable parameters the engine does not
know, and raises, naming the module.

Note [The module's state_dict]
The parameters' storage is empty between uses, so module.state_dict() would hold empty tensors.
A state-dict hook on every fetch unit gives the engine's values instead (world size 1; with
several ranks it raises, since only a collective over the ranks can gather them:
trainer.state_dict() on every rank), and the module's load_state_dict is the OffloadedModule's
while the engine holds the module: the values go into the engine (the optimizer's states kept).

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

import json
import math
import os
import shutil
import tempfile
import types
import warnings
import weakref

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

    __slots__ = ("name", "module", "params", "fetched", "pending", "backward_fetches", "frozen",
                 "local_names")

    def __init__(self, name, module):
        self.name = name
        self.module = module
        self.params = []          # _Param
        self.local_names = []     # (name relative to the unit's module, _Param)
        self.fetched = 0          # engine fetches not yet released
        self.pending = 0          # gradients still to come in this backward
        self.backward_fetches = 0
        self.frozen = False       # holds a frozen parameter (released after its inputs' backward)


class _Param:
    __slots__ = ("id", "name", "param", "shape", "numel", "units", "views", "accumulator",
                 "frozen", "owners", "group", "dtype")

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
        self.owners = []          # (module, name): where the module holds it (tied: several)
        self.group = 0            # its parameter group (param_groups)
        self.dtype = param.dtype  # its dtype at offload(): restored by close()


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


def _autocast_state(device_type):
    """(enabled, dtype) of torch.autocast for `device_type` ("cpu", "cuda"), on torch 1.13 and 2."""
    if device_type not in ("cpu", "cuda"):
        return False, None
    try:
        return (torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type))
    except (TypeError, AttributeError):  # torch < 2.4
        if device_type == "cpu":
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()


class _Linear(torch.autograd.Function):
    """F.linear for engine-held weights that saves the Parameter itself for backward.

    torch's own linear saves ``weight.t()``, a view made in forward: it would keep pointing at the
    engine memory the weight had then, which the engine may have reused by the time backward runs.
    The Parameter, saved as itself, points at wherever the backward fetch put it (DeepSpeed ZeRO-3
    wraps linear for the same reason).

    Mixed precision (torch.autocast, bf16 or fp16): forward runs under the caller's autocast (F.linear
    casts input and weight), and backward under the same autocast state, as torch.amp.custom_fwd /
    custom_bwd arrange it for DeepSpeed's ZeRO-3 linear: the fp32 weight saved is cast as forward
    cast it, so the gradients are those of F.linear under autocast (the weight's returned in its own
    dtype by autograd). The state is recorded per call, for the device of the input, so one Function
    serves CPU and CUDA autocast (the decorators fix one device type).
    """

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.device_type = input.device.type
        ctx.autocast = _autocast_state(ctx.device_type)
        ctx.save_for_backward(input, weight, bias)
        return _original_linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        input, weight, bias = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        if enabled:
            with torch.autocast(ctx.device_type, dtype=dtype):
                return _Linear._backward(ctx, grad, input, weight, bias)
        return _Linear._backward(ctx, grad, input, weight, bias)

    @staticmethod
    def _backward(ctx, grad, input, weight, bias):
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
# id() of the Parameters that live in an engine -> (weakref to it, weakref to its
# OffloadedModule): an id alone may be a dead Parameter's, reused by a new tensor.
_managed_weights = {}


def _owner_of_param(p):
    """The live OffloadedModule holding Parameter `p`, or None."""
    entry = _managed_weights.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def _is_managed(p):
    entry = _managed_weights.get(id(p))
    return entry is not None and entry[0]() is p


def _linear(input, weight, bias=None):
    # A frozen weight too, when the input needs a gradient: its backward reads the weight.
    if (_is_managed(weight) and torch.is_grad_enabled() and
            (weight.requires_grad or input.requires_grad)):
        return _Linear.apply(input, weight, bias)
    return _original_linear(input, weight, bias)


# Note [What memplan.torch patches]
# While an engine holds parameters, three torch functions see them: F.linear (_Linear above),
# torch.nn.utils.clip_grad_norm_ (the gradients are in the engine: their norm is the engine's, and
# the clipping its step's: OffloadedModule.clip_grad_norm_), and GradScaler.unscale_ (the overflow
# check of fp16 loss scaling reads the gradients: for an OffloadOptimizer it is the engine's; see
# _unscale_ below). Each patch handles the engine's parameters and passes everything else to the
# original; all three are restored when the last engine closes.
_original_clip = torch.nn.utils.clip_grad_norm_


def _grad_scaler_classes():
    classes = []
    for module_name in ("torch.amp.grad_scaler", "torch.cuda.amp.grad_scaler"):
        try:
            module = __import__(module_name, fromlist=["GradScaler"])
        except ImportError:
            continue
        cls = getattr(module, "GradScaler", None)
        if cls is not None and "unscale_" in cls.__dict__ and cls not in classes:
            classes.append(cls)
    return classes


_original_unscale = {cls: cls.__dict__["unscale_"] for cls in _grad_scaler_classes()}


def _owner_of(optimizer):
    """The OffloadedModule behind an optimizer (an OffloadOptimizer, or Accelerate's wrapper of
    one), or None."""
    seen = 0
    while optimizer is not None and seen < 4:
        offloaded = getattr(optimizer, "_memplan_offloaded", None)
        if offloaded is not None:
            return offloaded
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def _unscale_(scaler, optimizer):
    owner = _owner_of(optimizer)
    if owner is None:
        for cls in type(scaler).__mro__:
            if cls in _original_unscale:
                return _original_unscale[cls](scaler, optimizer)
    if not scaler._enabled:
        return None
    scaler._check_scale_growth_tracker("unscale_")
    state = scaler._per_optimizer_states[id(optimizer)]
    stage = state["stage"]
    if stage.name == "UNSCALED":
        raise RuntimeError("unscale_() has already been called on this optimizer since the last "
                           "update().")
    if stage.name == "STEPPED":
        raise RuntimeError("unscale_() is being called after step().")
    found_inf = owner._unscale(float(scaler._scale.double().item()), scaler)
    device = scaler._scale.device
    state["found_inf_per_device"] = {
        device: torch.full((), 1.0 if found_inf else 0.0, dtype=torch.float32, device=device)}
    state["stage"] = type(stage)["UNSCALED"]
    return None


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_ over parameters some of which an engine holds (Note [What
    memplan.torch patches])."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    owners = {}
    others = []
    for p in parameters:
        owner = _owner_of_param(p)
        if owner is None:
            others.append(p)
        else:
            owners.setdefault(id(owner), (owner, []))[1].append(p)
    if not owners:
        extra = {} if foreach is None else {"foreach": foreach}  # torch 1.13 has no foreach
        return _original_clip(others, max_norm, norm_type=norm_type,
                              error_if_nonfinite=error_if_nonfinite, **extra)
    others = [p for p in others if p.grad is not None]
    if len(owners) == 1 and not others:
        owner, given = next(iter(owners.values()))
        owner._check_clip_parameters(given)
        return owner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
    # Engine parameters beside others: one global norm over all, one coefficient for all.
    norm_type = float(norm_type)
    norms = []
    for owner, given in owners.values():
        owner._check_clip_parameters(given)
        norms.append(owner.gradient_norm(norm_type))
    if others:
        norms.append(float(_original_clip(others, float("inf"), norm_type=norm_type)))
    norms = torch.tensor(norms, dtype=torch.float32)
    total = torch.linalg.vector_norm(norms, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in others:
        p.grad.detach().mul_(coefficient.to(p.grad.device))
    for owner, _ in owners.values():
        owner._clip_by(float(coefficient))
    return total


def _manage(owner, params):
    ref = weakref.ref(owner)
    _managed_weights.update((id(p), (weakref.ref(p), ref)) for p in params)
    torch.nn.functional.linear = _linear
    torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_
    for cls in _original_unscale:
        cls.unscale_ = _unscale_


def _unmanage(params):
    for p in params:
        if _is_managed(p):
            del _managed_weights[id(p)]
    # Entries of Parameters or owners that died without close() (a test that raised, a module
    # dropped): nothing will use them.
    for key in [k for k, (p, o) in _managed_weights.items() if p() is None or o() is None]:
        del _managed_weights[key]
    if not _managed_weights:
        torch.nn.functional.linear = _original_linear
        torch.nn.utils.clip_grad_norm_ = _original_clip
        torch.nn.utils.clip_grad.clip_grad_norm_ = _original_clip
        for cls, original in _original_unscale.items():
            cls.unscale_ = original


_live_paths = {}  # realpath of an engine's nvme.path -> weakref to the OffloadedModule holding it

# torch.optim's param_group keys memplan's step takes, by the schedule's optimizer: torch key ->
# the engine's key (betas split in two).
_GROUP_KEYS = {
    "adam": {"lr": "lr", "weight_decay": "weight_decay", "eps": "eps", "betas": None},
    "lion": {"lr": "lr", "weight_decay": "weight_decay", "betas": None},
    "sgd": {"lr": "lr", "weight_decay": "weight_decay", "momentum": "momentum",
            "dampening": "dampening", "nesterov": "nesterov"},
}
# Keys torch.optim and LR schedulers put in param groups that change nothing here at these values.
_GROUP_IGNORED = {"initial_lr": None, "name": None, "foreach": None, "fused": None,
                  "capturable": False, "differentiable": False, "maximize": False,
                  "amsgrad": False, "decoupled_weight_decay": None, "params": None}


def _optimizer_kind(schedule):
    name = schedule.get("optimizer", {}).get("name", "adam")
    return "adam" if name in ("adam", "adam-amsgrad") else name


def _engine_group_options(group, kind, where):
    """The engine's options of one torch.optim param group (its keys other than "params")."""
    out = {}
    for key, value in group.items():
        if key in _GROUP_KEYS.get(kind, {}):
            if key == "betas":
                betas = tuple(float(b) for b in value)
                if len(betas) != 2:
                    raise ValueError(f"memplan.torch: {where}: betas must be two numbers")
                out["beta1"], out["beta2"] = betas
            elif key == "nesterov":
                out[key] = bool(value)
            else:
                out[_GROUP_KEYS[kind][key]] = float(value)
        elif key in _GROUP_IGNORED:
            default = _GROUP_IGNORED[key]
            if default is not None and bool(value) != default:
                raise ValueError(f"memplan.torch: {where}: {key}={value!r} is not supported by "
                                 f"memplan's {kind} (only {default!r})")
        else:
            raise ValueError(f"memplan.torch: {where}: unknown option {key!r} for memplan's {kind} "
                             f"(it takes {', '.join(sorted(_GROUP_KEYS.get(kind, {})))})")
    return out


def _torch_group_options(options, kind):
    """The torch.optim spelling of the engine's options of a group (for param_groups)."""
    out = {}
    for key, value in options.items():
        if key in ("beta1", "beta2"):
            out["betas"] = (options.get("beta1", 0.9), options.get("beta2", 0.999))
        elif key in _GROUP_KEYS.get(kind, {}) or key == "eps":
            out[key] = value
    return out


_STATE_NAMES = {"adam": ["exp_avg", "exp_avg_sq"], "adam-amsgrad": ["exp_avg", "exp_avg_sq",
                                                                    "max_exp_avg_sq"],
                "lion": ["exp_avg"], "sgd": ["momentum_buffer"]}


def _write_safetensors(path, items, metadata):
    """Writes a safetensors file from `items` [(name, numel, produce)], each produce() giving its
    float32 values, one at a time (so a rank's optimizer state never sits in memory whole), into a
    temporary file renamed into place."""
    import struct
    header = {"__metadata__": metadata}
    offset = 0
    for name, numel, _ in items:
        header[name] = {"dtype": "F32", "shape": [int(numel)],
                        "data_offsets": [offset, offset + 4 * int(numel)]}
        offset += 4 * int(numel)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name, numel, produce in items:
                values = produce().detach().to("cpu", torch.float32).contiguous().reshape(-1)
                if values.numel() != numel:
                    raise ValueError(f"memplan.torch: {name}: {values.numel()} values for {numel}")
                f.write(values.numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class OffloadedModule:
    """A torch module whose parameters and optimizer live in memplan's engine.

    Create it with ``memplan.torch.offload(module, ...)``. The module is modified in place (hooks,
    parameter storage); ``close()`` removes the hooks and gives the parameters their trained values
    back as ordinary tensors.
    """

    def __init__(self, module, schedule, *, runtime="auto", optimizer_options=None,
                 gradient_accumulation_steps=1, device=None, process_group=None,
                 fetch_units="auto", resume=False, overlap_optimizer=False, param_groups=None,
                 path=None):
        if gradient_accumulation_steps < 1:
            raise ValueError("gradient_accumulation_steps must be >= 1")
        for p in module.parameters():
            if _owner_of_param(p) is not None:
                raise ValueError("memplan.torch: the module is offloaded already (its parameters "
                                 "are in another engine); close() that OffloadedModule first")
        self._closed = False
        self.block_types = _block_types(module, fetch_units)
        self.block_types_given = fetch_units not in ("auto", "module")
        self.group, self.rank, self.world_size = _process_group(process_group)
        self.module = module
        self.schedule = schedule
        self.optimizer_kind = _optimizer_kind(schedule)
        self.optimizer_name = schedule.get("optimizer", {}).get("name", "adam")
        self.optimizer_options = dict(optimizer_options or {})
        self.accumulation = int(gradient_accumulation_steps)
        self._groups_given = param_groups
        self.group_options = [{}]   # per parameter group: the engine options overriding the above
        self._options_source = None  # or a callable giving them (an OffloadOptimizer's groups)
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
        self._path_key = _take_path(schedule, self)
        collective = None
        if self.world_size > 1:
            collective = self._collective(wants_cuda, runtime)
        self.engine = memplan.Engine(schedule, runtime=runtime,
                                     device=device.index if wants_cuda else None,
                                     collective=collective, resume=resume)
        self.resumed_step = 0  # with resume: the step the engine's stores continue from
        self.recovery = {}     # with resume: what the engine found ({"torn", "notes"})
        self.dtype_name = self.engine.param_dtype
        self.dtype = _DTYPES[self.dtype_name]
        self.on_cuda = self.engine.runtime.startswith("cuda")
        if self.on_cuda:
            self.device = torch.device("cuda", self.engine.device)
        else:
            self.device = device if device is not None else torch.device("cpu")
        self.units = []
        self.params = []
        self.kept = []              # (name, Parameter) of parameters the engine does not hold
        self._by_param = {}
        self._hooks = []
        self._micro = 0             # backward passes since the last step
        self._callback_queued = False
        self._grad_sums = {}        # param id -> summed gradient (accumulation)
        self._grads_given = set()
        self.overlap_optimizer = bool(overlap_optimizer)
        self._prepared = None       # the options given to the engine for the step in progress
        # Note [Clipping and loss scaling in memplan.torch]: this step's clipping (from
        # clip_grad_norm_), loss scale (from a GradScaler's unscale_) and a coefficient computed
        # outside (clipping beside other parameters), reset by every step.
        self._clip = None           # (max_norm, norm_type)
        self._loss_scale = None
        self._coefficient = None
        self._overflow_norm = None  # the norm of a step a GradScaler skipped (dropped at unscale_)
        self.grad_scaler = None     # a torch GradScaler whose scale the step's gradients carry
        self.last_grad_norm = None  # the last norm clip_grad_norm_ measured
        self._final_stats = None
        self._forward_depth = 0     # root forwards running (Note [A step that raised])
        self._in_state_dict = False
        # Note [Views of parameters]: until the first step ends, every tensor a unit's forward
        # saves for backward is checked; a view of an engine-held parameter is refused.
        self._check_views = True
        self._view_storages = {}    # storage address of a fetched parameter's view -> _Param
        self._view_checks = []      # saved_tensors_hooks contexts entered by pre-hooks
        try:
            self._register()
        except BaseException:
            self._release_path()
            self.engine.close()
            raise
        self._closed = False

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

    def _gather(self, shard, numel):
        """Every rank's `shard` (a CPU float32 tensor of the same size on each) back to back, the
        first `numel` elements: a parameter's whole values from its shards (a collective)."""
        import torch.distributed as dist
        if self.world_size == 1:
            return shard[:numel]
        on = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        mine = shard.to(on)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat(parts)[:numel].cpu()

    @staticmethod
    def _refusal(name, p, module):
        """Why the engine cannot hold parameter `name` (None when it can): Note [What the engine
        holds]."""
        if p.layout != torch.strided or getattr(p, "is_sparse", False):
            return f"{name} is a sparse parameter ({p.layout}); not supported"
        if (isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                and getattr(module, "sparse", False) and p.requires_grad):
            return (f"{name} belongs to an nn.{type(module).__name__}(sparse=True), whose "
                    "gradients are sparse; not supported (use sparse=False)")
        if getattr(p, "is_quantized", False) or not (p.is_floating_point() or p.is_complex()):
            return None if not p.requires_grad else f"{name} is a trainable {p.dtype} parameter"
        if p.is_complex():
            return (f"{name} is a complex parameter ({p.dtype}); the engine keeps real fp32 master "
                    "weights, which would drop its imaginary part")
        if p.dtype == torch.float64 and p.requires_grad:
            return (f"{name} is a float64 parameter; the engine keeps fp32 master weights, which "
                    "would round it (convert the model with .float(), or freeze it)")
        return None

    @staticmethod
    def _kept_outside(p):
        """A frozen parameter the engine cannot represent exactly (integer, bool, quantised or
        float64 values: quantised bases' packed codes) stays an ordinary tensor of the module."""
        return not p.requires_grad and (getattr(p, "is_quantized", False) or
                                         not p.is_floating_point() or p.dtype == torch.float64)

    def _assign_groups(self):
        """The engine group of every trainable parameter from param_groups (torch.optim's form:
        dicts with "params" and options): each trainable parameter in exactly one group."""
        groups = self._groups_given
        trainable = {id(e.param): e for e in self.params if not e.frozen}
        for e in self.params:
            e.group = 0
        if groups is None:
            return
        if isinstance(groups, dict) or not groups:
            raise ValueError("memplan.torch: param_groups must be a list of dicts with \"params\" "
                             "(as torch.optim takes them)")
        options = []
        seen = {}
        for g, group in enumerate(groups):
            if not isinstance(group, dict) or "params" not in group:
                raise ValueError(f"memplan.torch: param_groups[{g}] must be a dict with \"params\"")
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for p in params:
                entry = self._by_param.get(id(p))
                if entry is None:
                    if any(p is q for _, q in self.kept) or not p.requires_grad:
                        continue  # frozen: no optimizer state, whichever group lists it
                    raise ValueError(f"memplan.torch: param_groups[{g}] holds a parameter that is "
                                     "not the module's")
                if entry.frozen:
                    continue
                if id(p) in seen:
                    raise ValueError(f"memplan.torch: {entry.name} is in param_groups[{seen[id(p)]}]"
                                     f" and param_groups[{g}]; a parameter is in one group")
                seen[id(p)] = g
                entry.group = g
            options.append(_engine_group_options(group, self.optimizer_kind,
                                                 f"param_groups[{g}]"))
        missing = [e.name for i, e in trainable.items() if i not in seen]
        if missing:
            raise ValueError(f"memplan.torch: {missing[0]} is trainable but in no param group "
                             f"({len(missing)} such); add it to one, or freeze it "
                             "(requires_grad=False) before offload()")
        self.group_options = options

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
            for param_name, p in sub._parameters.items():
                if p is None:
                    continue
                full = f"{module_name}.{param_name}" if module_name else param_name
                why = self._refusal(full, p, sub)
                if why is not None:
                    raise ValueError(f"memplan.torch: {why}")
        kept = set()
        covered = set()  # modules inside a block unit
        for module_name, sub in self.module.named_modules():
            if id(sub) in covered:
                continue
            if self._is_block(sub):
                covered.update(id(m) for m in sub.modules())
                own = list(sub.named_parameters())
            else:
                own = [(n, p) for n, p in sub._parameters.items() if p is not None]
            unit = _Unit(module_name or "<root>", sub)
            for param_name, p in own:
                full = f"{module_name}.{param_name}" if module_name else param_name
                if self._kept_outside(p):
                    if id(p) not in kept:
                        kept.add(id(p))
                        self.kept.append((full, p))
                    continue
                entry = self._by_param.get(id(p))
                if entry is None:
                    entry = _Param(None, full, p)
                    self._by_param[id(p)] = entry
                    self.params.append(entry)
                unit.params.append(entry)
                unit.local_names.append((param_name, entry))
                unit.frozen = unit.frozen or entry.frozen
                entry.units.append(unit)
            if unit.params:
                self.units.append(unit)
        # Every module that owns one of them, under which name (Note [A module fixed in structure]).
        for sub in self.module.modules():
            for param_name, p in sub._parameters.items():
                entry = self._by_param.get(id(p)) if p is not None else None
                if entry is not None and (sub, param_name) not in entry.owners:
                    entry.owners.append((sub, param_name))
        if not self.params:
            raise ValueError("memplan.torch: the module has no parameters the engine can hold")
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
        self._assign_groups()
        for entry in self.params:
            init = entry.param.detach().to("cpu", torch.float32).contiguous().reshape(-1)
            init = self._broadcast(init)
            entry.id = self.engine.add_parameter(
                entry.name, entry.units[0].name, list(entry.shape) or [1], init,
                [u.name for u in entry.units[1:]], frozen=entry.frozen, group=entry.group,
                dtype=str(entry.dtype))
        # Reads the initial values (with resume, the frozen ones only: the others are the stores').
        started = self.engine.start()
        self.resumed_step = started["epoch"]
        self.recovery = {"torn": started.get("torn", False), "notes": started.get("notes", [])}
        for note in self.recovery["notes"]:
            if "older memplan" in note:
                warnings.warn(f"memplan.torch: {note}", stacklevel=4)
        _manage(self, (e.param for e in self.params))
        for entry in self.params:
            if entry.frozen:
                continue
            # The gradient accumulator of a leaf: its hooks run once per backward pass, after the
            # gradient is complete (every use summed). Made while the parameter still has its
            # shape, which the accumulator records and checks gradients against; kept alive so
            # that every backward pass uses this one. And made with the working dtype and device
            # the parameter has from now on: torch drops a leaf's accumulator when `.data` changes
            # dtype or device, so one made on the fp32 parameter would never see a bf16 gradient
            # (the hook silent, the parameter skipped every step). A zero-stride view has the
            # shape without the memory.
            entry.param.data = torch.zeros((), dtype=self.dtype, device=self.device).expand(
                entry.param.shape)
            accumulator = entry.param.expand_as(entry.param).grad_fn.next_functions[0][0]
            accumulator.register_hook(self._make_grad_hook(entry))
            entry.accumulator = accumulator
        for entry in self.params:
            entry.param.data = torch.empty(0, dtype=self.dtype, device=self.device)
            entry.param.grad = None
        # Note [A module fixed in structure]: the modules and kept parameters at offload(),
        # held so their ids stay theirs (for the message of _check_modules).
        self._modules_at_offload = list(self.module.modules())
        self._module_ids = {id(m) for m in self._modules_at_offload}
        self._kept_ids = {id(p) for _, p in self.kept}
        self._owned = {(id(owner), name) for e in self.params for owner, name in e.owners}
        # Note [A step that raised]: the root's forward is counted, so that the next one knows
        # whether the last ended.
        self._hooks.append(self.module.register_forward_pre_hook(self._root_pre_hook))
        self._hooks.append(self.module.register_forward_hook(self._root_post_hook))
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(self._make_pre_hook(unit)))
            self._hooks.append(unit.module.register_forward_hook(self._make_post_hook(unit)))
            self._hooks.append(unit.module._register_state_dict_hook(
                self._make_state_dict_hook(unit)))
        # The module's load_state_dict loads into the engine (Note [The module's state_dict]).
        self.module.load_state_dict = self._module_load_state_dict

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

    def _check_open(self):
        if self._closed:
            raise RuntimeError("memplan.torch: this OffloadedModule is closed (its module holds "
                               "its weights again); offload() the module anew to train it")

    def _check_structure(self, unit):
        """Note [A module fixed in structure]: a parameter replaced, or its .data assigned, after
        offload() would be trained by nobody; refused at its next fetch."""
        for entry in unit.params:
            for owner, name in entry.owners:
                if owner._parameters.get(name) is not entry.param:
                    raise RuntimeError(
                        f"memplan.torch: parameter {entry.name} was replaced after offload() "
                        f"({type(owner).__name__}.{name} is another Parameter now); the engine "
                        "trains the one it registered. Replace or resize parameters before "
                        "offload(), or close() and offload() again")
            if entry.views == 0 and entry.param.data.numel() != 0:
                raise RuntimeError(
                    f"memplan.torch: {entry.name}.data was assigned after offload() (shape "
                    f"{tuple(entry.param.data.shape)}); the engine holds its values: load new ones "
                    "with trainer.load_state_dict(...), or close() and offload() again")

    def _fetch(self, unit):
        self._check_open()
        self._check_structure(unit)
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

    def _root_pre_hook(self, module, inputs):
        # Note [A step that raised]: a root forward still counted here never ended: it raised.
        if self._forward_depth > 0 and not self._callback_queued:
            self._end_raised_forward()
        if self._forward_depth == 0:
            self._check_modules()
        self._forward_depth += 1

    def _check_modules(self):
        """Note [A module fixed in structure]: a submodule replaced or added after offload()
        (``model[2] = nn.Linear(...)``, a new head), or a Parameter added to a module, brings a
        trainable Parameter the engine does not hold, which forward would use and nobody would
        train; refused at the root's next forward (a dictionary lookup per parameter). A frozen
        one is let be: nothing would have trained it."""
        for name, sub in self.module.named_modules():
            for param_name, p in sub._parameters.items():
                if (p is None or not p.requires_grad or id(p) in self._by_param
                        or id(p) in self._kept_ids or (id(sub), param_name) in self._owned):
                    continue  # (a registered name holding another Parameter: _check_structure)
                full = f"{name}.{param_name}" if name else param_name
                what = (f"parameter {full} was added or replaced"
                        if id(sub) in self._module_ids else
                        f"module {name or '<root>'} ({type(sub).__name__}) was replaced or added")
                raise RuntimeError(
                    f"memplan.torch: {what} after offload(); {full} is not the engine's, so "
                    "forward would use it and no step would train it. Change the module's "
                    "structure before offload(), or close() and offload() again")

    def _root_post_hook(self, module, inputs, output):
        self._forward_depth = max(0, self._forward_depth - 1)

    def _end_raised_forward(self):
        """Releases what a forward that raised left fetched (not what waits for a backward)."""
        self._forward_depth = 0
        while self._view_checks:
            self._view_checks.pop().__exit__(None, None, None)
        for unit in self.units:
            while unit.fetched > unit.backward_fetches:
                self._release(unit)

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
        if _is_managed(tensor) or tensor.layout != torch.strided:
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
                try:
                    self._gradient(entry, grad)
                except Exception:
                    # Note [A step that raised]: the step is dropped whole, so the next is clean.
                    self._abandon()
                    raise
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
        if grad.layout != torch.strided:
            raise RuntimeError(f"memplan.torch: the gradient of {entry.name} is sparse "
                               f"({grad.layout}); not supported")
        self._overflow_norm = None  # a new step's backward: an overflow dropped the last one
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
                               "(a second backward before step(): call step() after each "
                               "backward, or set gradient_accumulation_steps); the step was "
                               "dropped, run its forward and backward again")
        grad = grad.contiguous().reshape(-1)
        self._prepare()
        # The engine's copy waits for torch's stream, where the gradient is being computed.
        self.engine.grad_ready(entry.id, grad, stream=self._stream())
        self._grads_given.add(entry.id)

    def _step_options(self, preparing=False):
        """The engine's options of the coming step: the optimizer's (set_options, step keywords),
        each group's, this step's clipping and loss scale (Note [Clipping and loss scaling in
        memplan.torch]). `preparing`: before backward, when the loss scale is the GradScaler's."""
        options = dict(self.optimizer_options)
        if self._options_source is not None:  # an OffloadOptimizer's param_groups, as they are now
            self.group_options = self._options_source()
        if any(self.group_options):
            options["groups"] = [dict(g) for g in self.group_options]
        if self._clip is not None:
            options["max_grad_norm"], options["norm_type"] = self._clip
        scale = self._loss_scale
        if (scale is None and preparing and self.grad_scaler is not None and
                self.grad_scaler.is_enabled()):
            scale = float(self.grad_scaler.get_scale())
        if scale is not None:
            options["grad_scale"] = scale * float(options.get("grad_scale", 1.0))
        if self._coefficient is not None and self._coefficient != 1.0:
            options["grad_scale"] = float(options.get("grad_scale", 1.0)) / self._coefficient
        return options

    def _prepare(self):
        """overlap_optimizer: the step's options to the engine before its first gradient."""
        if self.overlap_optimizer and self._prepared is None:
            options = self._step_options(preparing=True)
            self.engine.prepare_step(**options)
            self._prepared = options

    def _flush_pending(self):
        """Gives the engine what this step's backward left in Python: the summed gradients of
        parameters without one in the last micro-batch, and "no gradient" for those without any
        (skipped as torch's optimizers skip a parameter whose grad is None)."""
        if self._micro < self.accumulation:
            raise RuntimeError(f"memplan: step() after {self._micro} backward passes; "
                               f"gradient_accumulation_steps is {self.accumulation}")
        self._prepare()
        for entry in self.params:
            if entry.id not in self._grads_given and not entry.frozen:
                grad = self._grad_sums.pop(entry.id, None)
                if grad is None:
                    self.engine.no_gradient(entry.id)
                else:
                    self.engine.grad_ready(entry.id, grad.contiguous().reshape(-1),
                                           stream=self._stream())
                self._grads_given.add(entry.id)

    def set_options(self, **options):
        """Overrides optimizer options (lr, grad_scale, max_grad_norm, norm_type, ...) for the
        coming steps; ``groups=[{...}, ...]`` replaces the per-group options (one dict per
        parameter group, torch.optim's keys: lr, weight_decay, betas, eps). With
        overlap_optimizer a step's options are taken when its backward hands the first gradient
        over: call this before the backward of the first step they are for."""
        self._check_open()
        if "groups" in options:
            groups = options.pop("groups")
            if len(groups) != len(self.group_options):
                raise ValueError(f"memplan.torch: {len(groups)} groups given; the parameters are "
                                 f"in {len(self.group_options)}")
            self.group_options = [_engine_group_options(dict(g), self.optimizer_kind,
                                                        f"groups[{i}]")
                                  for i, g in enumerate(groups)]
        if options.get("max_grad_norm") == 0:
            options.pop("max_grad_norm")
            self.optimizer_options.pop("max_grad_norm", None)
        self.optimizer_options.update(options)

    def gradient_norm(self, norm_type=2.0):
        """The global norm of this step's gradients (after the step's last backward, every rank
        calling it: a collective), divided by the loss scale a GradScaler's unscale_ reported."""
        self._check_open()
        if self._overflow_norm is not None:
            return self._overflow_norm
        self._flush_pending()
        return self.engine.gradient_norm(float(norm_type), self._loss_scale or 1.0)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ over the module's parameters (what the patched
        torch.nn.utils.clip_grad_norm_ calls for them): returns the gradients' global norm (over
        every rank; a collective) as a float32 tensor, and clips this step's gradients by
        min(1, max_norm / (norm + 1e-6)) in its step(), as torch would have clipped them. After
        the step's last backward, before step(). max_norm inf: the norm only, nothing clipped.
        With overlap_optimizer, clipping must be declared before backward
        (``offload(..., max_grad_norm=...)`` or ``set_options(max_grad_norm=...)``)."""
        norm = self.gradient_norm(norm_type)
        self.last_grad_norm = norm
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        if self._overflow_norm is None and float(max_norm) != float("inf"):
            self._clip = (float(max_norm), float(norm_type))
            if self._prepared is not None:
                declared = (self._prepared.get("max_grad_norm"), self._prepared.get("norm_type", 2))
                if declared[0] is None or (float(declared[0]), float(declared[1])) != self._clip:
                    self._abandon()
                    raise ValueError(
                        f"memplan.torch: clip_grad_norm_({max_norm}, norm_type={norm_type}) after "
                        "a backward that ran the optimizer beside it (overlap_optimizer=True) "
                        f"without that clipping declared (max_grad_norm={declared[0]}); the step "
                        "was dropped. Declare it before backward: offload(..., max_grad_norm=...) "
                        "or trainer.set_options(max_grad_norm=...)")
        return torch.tensor(norm, dtype=torch.float32)

    def _check_clip_parameters(self, given):
        """clip_grad_norm_ on this module's parameters must name all of them that train (the
        engine's norm is over all)."""
        ids = {id(p) for p in given}
        left_out = [e.name for e in self.params if not e.frozen and id(e.param) not in ids]
        if left_out:
            raise ValueError(
                f"memplan.torch: clip_grad_norm_ over part of an offloaded module's parameters "
                f"({left_out[0]} and {len(left_out) - 1} more left out); the engine clips all of "
                "them together: pass model.parameters()")

    def _clip_by(self, coefficient):
        """Clipping beside parameters the engine does not hold: this step's coefficient, computed
        over all of them."""
        if self._prepared is not None and coefficient != 1.0:
            self._abandon()
            raise ValueError("memplan.torch: clip_grad_norm_ over engine and other parameters "
                             "together needs the optimizer after backward (overlap_optimizer="
                             "False); the step was dropped")
        self._coefficient = float(coefficient)

    def _unscale(self, scale, scaler):
        """A GradScaler's unscale_ (Note [What memplan.torch patches]): this step's gradients carry
        loss scale `scale`; returns whether one of them overflowed (inf or NaN), in which case the
        step is dropped now (the scaler skips step() and lowers its scale)."""
        self._check_open()
        if self.grad_scaler is None:
            self.grad_scaler = scaler  # its scale is known before the next backward
        self._flush_pending()
        norm = self.engine.gradient_norm(2.0, scale)
        self._loss_scale = scale
        if math.isfinite(norm):
            return False
        self._abandon()
        self._overflow_norm = norm
        return True

    def use_grad_scaler(self, scaler):
        """The torch GradScaler whose scale the coming steps' losses are multiplied by: with
        overlap_optimizer, the engine is then given that scale before backward (without it the
        first step's scale is learnt only at unscale_)."""
        self.grad_scaler = scaler

    def _abandon(self):
        """Drops the step in progress (Note [A step that raised]): the engine's gradients and
        prepared work, what backward still holds fetched, this step's bookkeeping."""
        while self._view_checks:
            self._view_checks.pop().__exit__(None, None, None)
        for unit in self.units:
            unit.pending = 0
            self._release_backward(unit)
        self._callback_queued = False
        if not self._closed:
            self.engine.abandon_step()
        self._end_step()

    def step(self, **options):
        """One optimizer step with the schedule's optimizer; keywords override the options given
        at creation for this and later steps (lr for a schedule, grad_scale for loss scaling).
        This step's clip_grad_norm_ and a GradScaler's loss scale apply too. With
        overlap_optimizer the step was prepared with the options in effect when its backward
        began: keywords that change them raise ValueError, and the step is dropped (weights,
        states and step counts as before it; run its forward and backward again)."""
        self._check_open()
        if self._overflow_norm is not None:
            # A GradScaler found an overflow at unscale_: the step was dropped there.
            self._end_step()
            return
        self._flush_pending()
        self.optimizer_options.update(options)
        step_options = self._step_options()
        if self._prepared is not None and self._prepared != step_options:
            changed = sorted(k for k in set(self._prepared) | set(step_options)
                             if self._prepared.get(k) != step_options.get(k))
            try:
                self.engine.step(**step_options)  # refused: the engine drops the step
            except RuntimeError:
                pass
            self._end_step()
            raise ValueError(
                f"memplan.torch: step() changed {', '.join(changed)} after the step's backward "
                "had begun with the old values (overlap_optimizer=True); the step was dropped. "
                "Give new options before the backward: trainer.set_options(...)")
        try:
            self.engine.step(**step_options)
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
        self._clip = None
        self._loss_scale = None
        self._coefficient = None
        self._overflow_norm = None

    def zero_grad(self, set_to_none=True):
        """Gradients never stay on the parameters; a step in progress (gradients given since the
        last step) is dropped, as torch's zero_grad drops the gradients it would have used."""
        if self._closed:
            return
        if self._micro > 0 or self._grads_given or self._grad_sums or self._prepared is not None:
            self._abandon()

    # ---- inspection ------------------------------------------------------------------------------

    def stats(self):
        """The engine's statistics (after close(): those it had when it closed)."""
        if self._closed:
            return self._final_stats
        return self.engine.stats()

    def fetch_units(self):
        """The fetch units, in registration order: [{"name", "type", "params", "elements",
        "frozen_params"}]; a block (fetch_units) holds every parameter of its sub-tree."""
        return [{"name": u.name, "type": type(u.module).__name__, "params": len(u.params),
                 "elements": sum(e.numel for e in u.params),
                 "frozen_params": sum(1 for e in u.params if e.frozen)} for u in self.units]

    def master_weights(self):
        """{name: fp32 CPU tensor} of the engine's master weights (a checkpoint's content)."""
        self._check_open()
        out = {}
        for entry in self.params:
            if entry.frozen:
                t = self._frozen_values(entry)
            else:
                t = torch.empty(entry.numel, dtype=torch.float32)
                self.engine.read_master(entry.id, t)
            out[entry.name] = t.view(entry.shape) if entry.shape else t.view(())
        return out

    def state_dict(self, dtype=None):
        """The module's state_dict() with the engine's values: {name: CPU tensor}, parameters as
        fp32 master weights (frozen ones as held; `dtype`: cast to it, e.g. torch.bfloat16 for a
        16-bit export), buffers and parameters the engine does not hold as they are, under the
        module's own names (a tied parameter under each of its names, one tensor). With world
        size > 1 this is a collective (the shards are gathered): every rank calls it."""
        weights = self.master_weights()
        if dtype is not None:
            weights = {n: t.to(dtype) for n, t in weights.items()}
        by_param = {id(e.param): weights[e.name] for e in self.params}
        out = {}
        self._in_state_dict = True
        try:
            own = self.module.state_dict(keep_vars=True)
        finally:
            self._in_state_dict = False
        for name, t in own.items():
            out[name] = by_param[id(t)] if id(t) in by_param else t.detach().cpu()
        return out

    def save(self, path, dtype=None):
        """Writes the trained weights as safetensors into the directory `path`: for a
        Transformers model (``save_pretrained``) its own layout (config.json, model.safetensors,
        tied weights once), which ``from_pretrained`` loads; for another module
        ``model.safetensors`` with state_dict() names (tied tensors once). `dtype`
        (torch.bfloat16, torch.float16): a 16-bit export; default the fp32 master weights. Every
        rank calls it (the weights are gathered from the shards); the first rank writes, into a
        temporary directory beside `path` that is renamed into place, so a failure leaves nothing
        half written. Raises OSError on every rank if the write failed."""
        self._check_open()
        state = self.state_dict(dtype=dtype)
        error = None
        if self.rank == 0:
            try:
                _write_checkpoint(self.module, state, path)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = (type(e).__name__, str(e), getattr(e, "errno", None))
        if self.world_size > 1:
            import torch.distributed as dist
            box = [error]
            dist.broadcast_object_list(box, src=_group_source(self.group), group=self.group)
            error = box[0]
        if error is not None:
            name, text, errno = error
            raise OSError(errno, f"memplan.torch: writing the checkpoint {path} failed: "
                                 f"{name}: {text}")

    def _frozen_values(self, entry):
        """A frozen parameter's values (it has no master weights): its working copy, fetched."""
        unit = entry.units[0]
        self._fetch(unit)
        try:
            return self._view(entry).reshape(-1)[:entry.numel].to("cpu", torch.float32,
                                                                  copy=True)
        finally:
            self._release(unit)

    # ---- the module's state_dict and load_state_dict ---------------------------------------------

    def _make_state_dict_hook(self, unit):
        """Note [The module's state_dict]: module.state_dict() gives the engine's values of the
        unit's parameters (world size 1), or raises (their shards are on other ranks too)."""
        def hook(module, state_dict, prefix, local_metadata):
            if self._in_state_dict or self._closed:
                return None
            if self.world_size > 1:
                raise RuntimeError(
                    "memplan.torch: the module's parameters are sharded over "
                    f"{self.world_size} ranks, so its own state_dict() would hold none of them; "
                    "call trainer.state_dict() on every rank (a collective), or trainer.save(dir)")
            for local, entry in unit.local_names:
                key = prefix + local
                if key not in state_dict:
                    continue
                if entry.frozen:
                    values = self._frozen_values(entry)
                else:
                    values = torch.empty(entry.numel, dtype=torch.float32)
                    self.engine.read_master(entry.id, values)
                values = values.view(entry.shape) if entry.shape else values.view(())
                state_dict[key] = values.to(entry.dtype)
            return None
        return hook

    def _module_load_state_dict(self, state_dict, strict=True, assign=False):
        """The module's own load_state_dict, while the engine holds its parameters."""
        if assign:
            raise ValueError("memplan.torch: load_state_dict(assign=True) would replace the "
                             "engine's parameters; load values instead (assign=False)")
        return self.load_state_dict(state_dict, strict=strict)

    def load_state_dict(self, state_dict, strict=True):
        """Loads weights into the running engine, as module.load_state_dict would into the module
        (the module's own load_state_dict comes here while the engine holds it): parameters become
        the engine's master weights (frozen ones its values; the optimizer's states are kept, as
        torch keeps an optimizer's), buffers and parameters the engine does not hold are copied.
        Between steps. With world size > 1 every rank calls it with the same state_dict (a
        collective). Returns torch's (missing_keys, unexpected_keys); strict raises on either, and
        a shape mismatch raises always, before anything is loaded."""
        self._check_open()
        self._in_state_dict = True
        try:
            own = self.module.state_dict(keep_vars=True)
        finally:
            self._in_state_dict = False
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        errors = []
        values = {}   # entry id -> CPU float32 tensor, flattened
        copies = []   # (tensor of the module, value)
        for name, t in own.items():
            if name not in state_dict:
                continue
            value = state_dict[name]
            if not isinstance(value, torch.Tensor):
                errors.append(f"{name}: not a tensor ({type(value).__name__})")
                continue
            entry = self._by_param.get(id(t))
            shape = entry.shape if entry is not None else tuple(t.shape)
            if tuple(value.shape) != shape:
                errors.append(f"size mismatch for {name}: copying a param with shape "
                              f"{tuple(value.shape)}, the shape in the current model is "
                              f"{torch.Size(shape)}")
                continue
            if entry is not None:
                values.setdefault(entry.id, value.detach().to("cpu", torch.float32).reshape(-1))
            else:
                copies.append((t, value))
        if strict and (missing or unexpected):
            if missing:
                errors.append("Missing key(s) in state_dict: " + ", ".join(
                    f'"{k}"' for k in missing))
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: " + ", ".join(
                    f'"{k}"' for k in unexpected))
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.module).__name__}:"
                               "\n\t" + "\n\t".join(errors))
        # Parameters not given keep their values: the engine replaces all of them at once, so
        # their current ones are read first (this rank's shard; a frozen one's whole values).
        shards = {}
        for entry in self.params:
            if entry.id in values:
                continue
            if entry.frozen:
                values[entry.id] = self._frozen_values(entry)
            else:
                _, size, _ = self.engine.shard(entry.id)
                current = torch.empty(size, dtype=torch.float32)
                self.engine.read_state(entry.id, 0, current)
                shards[entry.id] = current
        if len(shards) < len(self.params):
            def fill(param, array, first, count):
                if param in shards:
                    return shards[param][first:first + count]
                begin = self.engine.shard(param)[0] + first
                return values[param][begin:begin + count].contiguous()

            arrays = [True] + [False] * self.engine.optimizer_states
            self.engine.load_state(fill, arrays)
        with torch.no_grad():
            for t, value in copies:
                t.copy_(value)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ---- the optimizer's state: torch's form and checkpoint files --------------------------------

    def param_group_entries(self):
        """The trainable parameters of each group, in registration order: the order of an
        OffloadOptimizer's param_groups and of optimizer_state_dict()'s indices."""
        groups = [[] for _ in self.group_options]
        for entry in self.params:
            if not entry.frozen:
                groups[entry.group].append(entry)
        return groups

    def group_param_options(self, g):
        """Group g's options in torch.optim's spelling (lr, weight_decay, betas, eps, ...)."""
        options = dict(self.optimizer_options)
        options.update(self.group_options[g])
        return _torch_group_options(
            {k: v for k, v in options.items() if k not in ("grad_scale", "max_grad_norm",
                                                           "norm_type", "decoupled")},
            self.optimizer_kind)

    def _state_names(self):
        return _STATE_NAMES.get(self.optimizer_name, _STATE_NAMES["adam"])

    def optimizer_state_dict(self):
        """The optimizer's state as torch.optim's state_dict() has it ({"state": {index: {"step",
        "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}, indices in param_group_entries()
        order; Lion "exp_avg", SGD "momentum_buffer"), whole tensors on the CPU: what a
        torch.optim.AdamW over the same parameters would hold. Between steps; with world size > 1 a
        collective (each shard gathered). For a model whose states do not fit in memory, write
        them with save_checkpoint() instead."""
        self._check_open()
        names = self._state_names()
        state, groups, index = {}, [], 0
        for g, entries in enumerate(self.param_group_entries()):
            ids = []
            for entry in entries:
                _, size, numel = self.engine.shard(entry.id)
                steps = self.engine.param_step(entry.id)
                item = {"step": torch.tensor(float(steps))}
                for k, name in enumerate(names, start=1):
                    shard = torch.empty(size, dtype=torch.float32)
                    self.engine.read_state(entry.id, k, shard)
                    whole = self._gather(shard, numel)
                    item[name] = whole.view(entry.shape) if entry.shape else whole.view(())
                if steps > 0:  # torch keeps no state for a parameter never stepped
                    state[index] = item
                ids.append(index)
                index += 1
            groups.append(dict(self.group_param_options(g), params=ids))
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state_dict):
        """Loads an optimizer state in torch.optim's form (optimizer_state_dict()'s, or a
        torch.optim.AdamW's over the same parameters in the same groups) into the running engine:
        the states, each parameter's step count and the groups' options. Between steps; with world
        size > 1 every rank calls it with the same dict. Raises ValueError, before loading
        anything, when the groups or shapes differ."""
        self._check_open()
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise ValueError("memplan.torch: an optimizer state_dict has \"state\" and "
                             "\"param_groups\"")
        groups = state_dict["param_groups"]
        mine = self.param_group_entries()
        if len(groups) != len(mine):
            raise ValueError(f"memplan.torch: the optimizer state has {len(groups)} parameter "
                             f"groups; this optimizer has {len(mine)}")
        names = self._state_names()
        saved = state_dict.get("state", {})
        by_entry = {}
        for g, (group, entries) in enumerate(zip(groups, mine)):
            if len(group["params"]) != len(entries):
                raise ValueError(f"memplan.torch: group {g} of the optimizer state has "
                                 f"{len(group['params'])} parameters; this optimizer's has "
                                 f"{len(entries)}")
            for index, entry in zip(group["params"], entries):
                item = saved.get(index, saved.get(str(index)))
                if item is not None:
                    for name in names:
                        value = item.get(name)
                        if value is None or tuple(value.shape) != entry.shape:
                            raise ValueError(
                                f"memplan.torch: the optimizer state of {entry.name} has "
                                f"{name} {None if value is None else tuple(value.shape)}; the "
                                f"parameter is {entry.shape}")
                by_entry[entry.id] = item
        options = [_engine_group_options({k: v for k, v in group.items() if k != "params"},
                                         self.optimizer_kind, f"param_groups[{g}]")
                   for g, group in enumerate(groups)]
        steps = [0] * len(self.params)
        for entry in self.params:
            item = by_entry.get(entry.id)
            if item is not None:
                steps[entry.id] = int(float(item["step"]))
        flat = {}

        def fill(param, array, first, count):
            item = by_entry.get(param)
            if item is None:
                return torch.zeros(count, dtype=torch.float32)
            key = (param, array)
            if key not in flat:
                flat[key] = item[names[array - 1]].detach().to("cpu", torch.float32).reshape(-1)
            begin = self.engine.shard(param)[0] + first
            return flat[key][begin:begin + count].contiguous()

        self.engine.load_state(fill, [False] + [True] * len(names), steps)
        self.group_options = [dict(o) for o in options]
        # The groups now carry every option; the defaults they override stay for reference.

    def save_checkpoint(self, directory):
        """Writes the optimizer's whole state (master weights, states, step counts, the groups'
        options) into `directory`, streamed parameter by parameter into one safetensors file per
        rank (``rank<r>-of-<N>.safetensors``: this rank's shard of each parameter's arrays) and
        ``memplan-checkpoint.json``, as DeepSpeed writes its own files: load_checkpoint() reads it
        back with any number of ranks, consolidate_checkpoint() gives the whole weights. Every rank
        calls it, between steps; the directory is created. Raises OSError on every rank if a
        rank's write failed, leaving no partial file of its own."""
        self._check_open()
        names = ["master"] + self._state_names()
        error = None
        try:
            os.makedirs(directory, exist_ok=True)
            items, params = [], {}
            for entry in self.params:
                if entry.frozen:
                    continue
                first, size, numel = self.engine.shard(entry.id)
                real = max(0, min(size, numel - first))
                for k, name in enumerate(names):
                    def produce(param=entry.id, array=k, size=size, real=real):
                        shard = torch.empty(size, dtype=torch.float32)
                        self.engine.read_state(param, array, shard)
                        return shard[:real]
                    items.append((f"{entry.name}.{name}", real, produce))
                params[entry.name] = {"shape": list(entry.shape), "numel": numel, "first": first,
                                      "size": real, "step": self.engine.param_step(entry.id),
                                      "group": entry.group, "dtype": str(entry.dtype)}
            meta = {"format": "memplan-optimizer-checkpoint", "version": 1, "rank": self.rank,
                    "world_size": self.world_size, "optimizer": self.optimizer_name,
                    "arrays": names, "params": params, "groups": self.group_options,
                    "options": {k: v for k, v in self.optimizer_options.items()
                                if isinstance(v, (int, float, bool, str))}}
            _write_safetensors(os.path.join(directory,
                                            f"rank{self.rank}-of-{self.world_size}.safetensors"),
                               items, {"memplan": json.dumps(meta)})
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = (type(e).__name__, str(e), getattr(e, "errno", None))
        error = self._first_error(error)
        if error is None and self.rank == 0:
            try:
                manifest = {"format": "memplan-optimizer-checkpoint", "version": 1,
                            "world_size": self.world_size, "optimizer": self.optimizer_name,
                            "arrays": names, "groups": self.group_options}
                tmp = os.path.join(directory, f".memplan-checkpoint.json.{os.getpid()}")
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(manifest, f)
                os.replace(tmp, os.path.join(directory, "memplan-checkpoint.json"))
            except OSError as e:
                error = (type(e).__name__, str(e), e.errno)
        error = self._first_error(error, source=True)
        if error is not None:
            name, text, errno = error
            raise OSError(errno, f"memplan.torch: writing the optimizer checkpoint {directory} "
                                 f"failed: {name}: {text}")

    def _first_error(self, error, source=False):
        """With world size > 1, the first rank's error (or the first rank's only, `source`), on
        every rank."""
        if self.world_size == 1:
            return error
        import torch.distributed as dist
        if source:
            box = [error]
            dist.broadcast_object_list(box, src=_group_source(self.group), group=self.group)
            return box[0]
        errors = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        return next((e for e in errors if e is not None), None)

    def load_checkpoint(self, directory):
        """Loads what save_checkpoint() wrote (with any number of ranks) into the running engine:
        master weights, optimizer states, step counts, the groups' options. Every rank calls it,
        between steps. Raises ValueError naming the first difference when the checkpoint is of
        other parameters (names, shapes) or another optimizer, FileNotFoundError when a file is
        missing; nothing is loaded then."""
        self._check_open()
        files = _CheckpointFiles(directory)
        try:
            names = ["master"] + self._state_names()
            if files.optimizer != self.optimizer_name or files.arrays != names:
                raise ValueError(f"memplan.torch: {directory} holds a {files.optimizer} "
                                 f"checkpoint ({', '.join(files.arrays)}); this engine runs "
                                 f"{self.optimizer_name}")
            steps = [0] * len(self.params)
            for entry in self.params:
                if entry.frozen:
                    continue
                meta = files.params.get(entry.name)
                if meta is None:
                    raise ValueError(f"memplan.torch: {directory} has no {entry.name}")
                if tuple(meta["shape"]) != entry.shape:
                    raise ValueError(f"memplan.torch: {entry.name} is {tuple(meta['shape'])} in "
                                     f"{directory}; the model's is {entry.shape}")
                steps[entry.id] = int(meta["step"])
            extra = sorted(set(files.params) - {e.name for e in self.params if not e.frozen})
            if extra:
                raise ValueError(f"memplan.torch: {directory} holds {extra[0]}, which this model "
                                 "does not train")
            by_id = {e.id: e for e in self.params}

            def fill(param, array, first, count):
                begin = self.engine.shard(param)[0] + first
                return files.read(by_id[param].name, names[array], begin, count)

            self.engine.load_state(fill, [True] * len(names), steps)
            if len(files.groups) == len(self.group_options):
                self.group_options = [dict(g) for g in files.groups]
        finally:
            files.close()

    # ---- the end ---------------------------------------------------------------------------------

    def close(self):
        """Removes the hooks, gives the parameters their trained values (fp32 master weights in
        the parameters' dtype, on the engine's device) and closes the engine. With world size > 1
        every rank calls it (the weights are gathered). A step in progress is dropped."""
        if self._closed:
            return
        if self._micro > 0 or self._grads_given or self._prepared is not None:
            self._abandon()
        self._final_stats = self.engine.stats()
        try:
            weights, error = self.master_weights(), None
        except OSError as e:  # the stores failed: the hooks and the engine go anyway
            weights, error = None, e
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        _unmanage(e.param for e in self.params)
        for entry in self.params:
            if weights is not None:
                entry.param.data = weights[entry.name].to(self.device, entry.dtype)
            entry.accumulator = None
        if self.module.__dict__.get("load_state_dict") == self._module_load_state_dict:
            del self.module.__dict__["load_state_dict"]
        try:
            self.engine.close()
        except OSError:
            if error is None:
                raise
        finally:
            self._closed = True
            self._release_path()
        if error is not None:
            raise OSError(error.errno, f"memplan.torch: close(): the trained weights could not be "
                                       f"read back ({error}); the module's parameters are "
                                       "empty") from error

    def _release_path(self):
        if self._path_key is not None:
            held = _live_paths.get(self._path_key)
            if held is not None and held() in (None, self):
                del _live_paths[self._path_key]
            self._path_key = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _CheckpointFiles:
    """The files save_checkpoint() wrote, read lazily (safetensors slices)."""

    def __init__(self, directory):
        path = os.path.join(directory, "memplan-checkpoint.json")
        try:
            manifest = memplan._load_json_arg(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                2, f"memplan.torch: {directory} holds no memplan optimizer checkpoint "
                   "(memplan-checkpoint.json; OffloadedModule.save_checkpoint writes it)", path)
        except json.JSONDecodeError as e:
            raise ValueError(f"memplan.torch: {path}: not JSON ({e})") from None
        if manifest.get("format") != "memplan-optimizer-checkpoint" or manifest.get("version") != 1:
            raise ValueError(f"memplan.torch: {path}: not a memplan optimizer checkpoint of "
                             "version 1")
        self.directory = directory
        self.world_size = int(manifest["world_size"])
        self.optimizer = manifest["optimizer"]
        self.arrays = list(manifest["arrays"])
        self.groups = manifest.get("groups", [])
        self.params = {}   # name -> {"shape", "numel", "step", "group", "pieces": [(rank, first,
        self._open = {}    # size)]}; rank -> safe_open handle
        from safetensors import safe_open
        self._safe_open = safe_open
        for rank in range(self.world_size):
            meta = json.loads(self._file(rank).metadata()["memplan"])
            for name, p in meta["params"].items():
                item = self.params.setdefault(name, dict(p, pieces=[]))
                item["pieces"].append((rank, int(p["first"]), int(p["size"])))

    def _file(self, rank):
        if rank not in self._open:
            path = os.path.join(self.directory, f"rank{rank}-of-{self.world_size}.safetensors")
            if not os.path.exists(path):
                raise FileNotFoundError(2, f"memplan.torch: the optimizer checkpoint lacks {path}",
                                        path)
            self._open[rank] = self._safe_open(path, framework="pt")
        return self._open[rank]

    def read(self, name, array, begin, count):
        """Elements [begin, begin + count) of the flattened `array` of parameter `name`."""
        parts = []
        end = begin + count
        for rank, first, size in self.params[name]["pieces"]:
            a, b = max(begin, first), min(end, first + size)
            if a < b:
                parts.append(self._file(rank).get_slice(f"{name}.{array}")[a - first:b - first])
        values = torch.cat(parts) if len(parts) > 1 else parts[0]
        if values.numel() != count:
            raise ValueError(f"memplan.torch: {self.directory}: {name}.{array} holds "
                             f"{values.numel()} of elements [{begin}, {end})")
        return values.to(torch.float32).contiguous()

    def close(self):
        self._open.clear()


def consolidate_checkpoint(directory, output=None, dtype=torch.float32):
    """The whole fp32 master weights of an optimizer checkpoint (OffloadedModule.save_checkpoint,
    written by any number of ranks), as {name: tensor} in `dtype` (torch.bfloat16 for a 16-bit
    export), like DeepSpeed's zero_to_fp32; with `output`, also written there as
    model.safetensors. Names are the registered ones (a tied parameter once, under its first
    name). Needs no GPU and no engine."""
    files = _CheckpointFiles(directory)
    try:
        state = {}
        for name, meta in files.params.items():
            values = files.read(name, "master", 0, int(meta["numel"]))
            state[name] = values.view(tuple(meta["shape"])).to(dtype)
    finally:
        files.close()
    if output is not None:
        from safetensors.torch import save_file
        os.makedirs(output, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    return state


def _take_path(schedule, owner):
    """The key of the NVMe path the schedule's engine will use, registered for it. One that an
    earlier OffloadedModule of this process still holds is handed over: that one is closed when it
    is between steps (a notebook's, a hyper-parameter loop's previous trainer), refused when it
    is mid-step."""
    nvme = schedule.get("nvme") or {}
    tiers = (schedule.get("params", {}).get("tier"), schedule.get("optimizer", {}).get("tier"))
    if not nvme.get("path") or "nvme" not in tiers:
        return None
    key = _close_holder(nvme["path"])
    _live_paths[key] = weakref.ref(owner)
    return key


def _close_holder(path):
    """Closes the OffloadedModule of this process that still holds `path`, if it is between steps
    (RuntimeError if mid-step); returns the path's key."""
    key = os.path.realpath(path)
    held = _live_paths.get(key)
    other = held() if held is not None else None
    if other is not None and not other._closed:
        if other._micro > 0 or other._grads_given or other._prepared is not None:
            raise RuntimeError(f"memplan.torch: {path} is in use by another OffloadedModule of "
                               "this process, in the middle of a step; close() it, or use "
                               "another path")
        warnings.warn(f"memplan.torch: {path} was held by an earlier OffloadedModule of this "
                      "process; it is closed now (its module has its trained weights back)",
                      stacklevel=4)
        other.close()
    return key


def offload(module, path=None, *, param_tier=None, optimizer_tier=None, lr=1e-3,
            betas=None, eps=1e-8, weight_decay=0.01, optimizer="adamw", runtime="auto",
            dtype="fp32", gradient_accumulation_steps=1, schedule=None, device=None,
            process_group=None, fetch_units="auto", resume=False, overlap_optimizer=False,
            param_groups=None, max_grad_norm=0.0, norm_type=2.0, momentum=0.9,
            **schedule_options):
    """Puts `module`'s parameters and its optimizer into memplan's engine.

    path: a directory the engine may create and own, its missing parents included (parameters
    and optimizer states go to NVMe there); without it both stay in host memory (param_tier
    "cpu", optimizer_tier "cpu").
    optimizer: "adamw" (decoupled weight decay, as torch.optim.AdamW) or "adam" (L2 decay, as
    torch.optim.Adam); betas default (0.9, 0.999). With a `schedule` whose optimizer is "lion"
    (``memplan plan --optimizer lion``), the step is Lion's: lr, betas (default (0.9, 0.99)) and
    weight_decay apply, eps and `optimizer` do not; one whose optimizer is "sgd" steps SGD with
    momentum (lr, momentum, weight_decay). Other keywords go to memplan.schedule
    (pinned_budget_bytes, sub_group_elements, prefetch_bytes, max_live_bytes, direct, ...); or
    pass a whole `schedule` (a dict, or the path of a Schedule JSON file such as ``memplan plan
    --emit-schedule`` writes), which is run as it is.
    param_groups: parameter groups as torch.optim takes them, [{"params": [...], "lr": ...,
    "weight_decay": ..., "betas": ..., "eps": ...}, ...] (keys left out take the keywords above):
    every trainable parameter in exactly one group; each group's options reach every step
    (``set_options(groups=...)``, an OffloadOptimizer's param_groups). The Hugging Face Trainer's
    default puts biases and norms in a group without weight decay.
    max_grad_norm: clip every step's gradients by their global norm, as
    torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm, norm_type) would (0: off). Clipping
    can also be asked for per step, by calling torch.nn.utils.clip_grad_norm_ on the module's
    parameters (or trainer.clip_grad_norm_) after backward; with overlap_optimizer it must be
    declared here (or with set_options) so that the step beside backward knows of it.
    device: the CUDA device to train on ("cuda:1", 1, a torch.device); default: the module's
    parameters' device if they are on CUDA, else torch's current device when runtime is "cuda".
    process_group: the torch.distributed group to train over (ZeRO-3, one shard per rank); None:
    the default group when torch.distributed is initialised with more than one rank, else one
    process. Every rank calls offload() with the same module and arguments.
    fetch_units: which modules are fetched as one unit with their whole sub-tree: "auto" (the
    model's ``_no_split_modules`` classes, a Transformers model's decoder layer; otherwise
    "module"), "module" (every module with parameters of its own is a unit), or a list of module
    classes or class names. ``fetch_units()`` on the result reports the grouping.
    nn.MultiheadAttention is refused (it saves views of its packed weight for backward), and so
    are sparse parameters and gradients (nn.Embedding(sparse=True)), trainable complex, quantised
    and float64 parameters (the engine keeps fp32 master weights); frozen integer, bool,
    quantised and float64 parameters (a quantised base's packed codes) stay ordinary tensors of
    the module, untouched.
    resume: continue from the engine's last complete step in `path` (the optimizer on NVMe):
    trained parameters and optimizer states come from the stores (the module's values are used
    for frozen parameters only); ``resumed_step`` on the result says which step, so the caller
    skips the data already seen. With several ranks, the last step every rank completed. A store
    written for another model (parameter names, order, shapes, dtypes, frozen set) is refused,
    naming the first difference.
    overlap_optimizer: run each step's optimizer during its backward (with the optimizer on NVMe;
    see the module's description): the options of a step are those in effect when its backward
    begins (``set_options``). Off by default: the step runs after backward, as before.
    """
    if optimizer not in ("adamw", "adam"):
        raise ValueError(f"optimizer must be 'adamw' or 'adam', not {optimizer!r}")
    if path is not None and not str(path):
        raise ValueError("memplan.torch: path is empty; give the directory for the NVMe stores, "
                         "or None to keep parameters and optimizer in host memory")
    if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm >= 0):
        raise ValueError(f"memplan.torch: max_grad_norm must be a number >= 0 (0: no clipping), "
                         f"not {max_grad_norm!r}")
    if float(norm_type) not in (1.0, 2.0, float("inf")):
        raise ValueError(f"memplan.torch: norm_type must be 1, 2 or inf, not {norm_type!r}")
    if schedule is None:
        tier = "nvme" if path is not None else "cpu"
        schedule = memplan.schedule(path=path, param_tier=param_tier or tier,
                                    optimizer_tier=optimizer_tier or tier, dtype=dtype,
                                    optimizer="adam", **schedule_options)
    elif not isinstance(schedule, dict):  # a path: `memplan plan --emit-schedule s.json`
        # Read as the library reads JSON: a repeated key is refused, naming it (issue 30 L5).
        schedule = memplan._load_json_arg(schedule)
    # The step options follow the schedule's optimizer: a plan for Lion emits "lion".
    name = schedule.get("optimizer", {}).get("name", "adam")
    if name == "lion":
        betas = betas or (0.9, 0.99)
        options = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay}
    elif name == "sgd":
        if betas is not None:
            raise ValueError("memplan.torch: the schedule's optimizer is sgd, which has no betas "
                             "(it takes lr, momentum, weight_decay)")
        options = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    elif name in ("adam", "adam-amsgrad"):
        betas = betas or (0.9, 0.999)
        options = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps,
                   "weight_decay": weight_decay, "decoupled": optimizer == "adamw"}
    else:
        raise ValueError(f"memplan.torch: the schedule's optimizer is {name!r}; memplan's engine "
                         "runs adam, adam-amsgrad, sgd or lion")
    if max_grad_norm:
        options["max_grad_norm"] = float(max_grad_norm)
        options["norm_type"] = float(norm_type)
    return OffloadedModule(module, schedule, runtime=runtime, optimizer_options=options,
                           gradient_accumulation_steps=gradient_accumulation_steps, device=device,
                           process_group=process_group, fetch_units=fetch_units, resume=resume,
                           overlap_optimizer=overlap_optimizer, param_groups=param_groups)
