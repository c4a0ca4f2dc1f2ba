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
  - By default (``overlap_optimizer="auto"``) the optimizer runs during backward wherever that
    gives the same step: the first step runs after backward, and from the second on the steps
    overlap when the first showed every option known before its backward (a clip_grad_norm_
    after backward is then declared); a loop that decides options after backward (step(lr=...),
    clipping beside other parameters) keeps the step after backward, and the optimizer in host
    memory always steps after backward (Note [The overlapped optimizer by default] in
    _torch_step). ``explain()`` says which and why.
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

This file holds OffloadedModule's core (set-up, fetch and release, close) and offload(); the rest
is in private modules of the package, all reached through memplan.torch: _torch_autograd (the
autograd functions and the torch functions memplan.torch patches), _torch_step (gradients and the
optimizer step, a mixin OffloadedModule inherits), _torch_checkpoint (state dicts, checkpoint
files, consolidate_checkpoint; a mixin too) and _torch_common (what they share).
"""

import logging
import os
import types
import warnings
import weakref

import torch

import memplan

from ._torch_autograd import (_PostBackward, _PreBackward, _is_managed, _manage, _owner_of_param,
                              _unmanage)
from ._torch_checkpoint import _CheckpointMixin, consolidate_checkpoint  # noqa: F401 (public)
from ._torch_common import (_DTYPES, _CudaArray, _ProcessGroupCollective, _engine_group_options,
                            _group_source, _optimizer_kind, _process_group)
from ._torch_sizing import (BENCH_FILE, SIZED_KEYS, check_drive, choose_sizes, count_parameters,
                            explain_drive, machine_facts, read_bandwidth)
from ._torch_sizing import explain as _explain_sizes
from ._torch_meta import _MetaMixin
from ._torch_step import _StepMixin

__all__ = ["offload", "OffloadedModule", "choose_sizes"]

# offload()'s choices (machine-sized defaults, the overlapped optimizer) are logged here, at INFO:
# logging.basicConfig(level=logging.INFO) or logging.getLogger("memplan.torch") shows them.
_log = logging.getLogger("memplan.torch")


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


_live_paths = {}  # realpath of an engine's nvme.path -> weakref to the OffloadedModule holding it


class OffloadedModule(_StepMixin, _CheckpointMixin, _MetaMixin):
    """A torch module whose parameters and optimizer live in memplan's engine.

    Create it with ``memplan.torch.offload(module, ...)``. The module is modified in place (hooks,
    parameter storage); ``close()`` removes the hooks and gives the parameters their trained values
    back as ordinary tensors.
    """

    def __init__(self, module, schedule, *, runtime="auto", optimizer_options=None,
                 gradient_accumulation_steps=1, device=None, process_group=None,
                 fetch_units="auto", resume=False, overlap_optimizer=False, param_groups=None,
                 path=None, sizing=None, param_init=None):
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
        # Note [A model never materialised]: placeholder id -> (meta parameter, module, name).
        self._param_init = param_init
        self._lazy = {}
        self._replaced = {}         # id of a meta parameter -> its placeholder
        self._made = {}             # parameter name -> values a module's reset made, not yet read
        self.group_options = [{}]   # per parameter group: the engine options overriding the above
        self._options_source = None  # or a callable giving them (an OffloadOptimizer's groups)
        # Note [The overlapped optimizer by default]: overlap_optimizer "auto" starts serial
        # ("watching") and overlaps once a step shows every option known before backward.
        # self.overlap_optimizer is whether the coming steps are prepared before backward.
        if overlap_optimizer == "auto":
            optimizer_tier = schedule.get("optimizer", {}).get("tier", "cpu")
            if optimizer_tier != "nvme":
                self._auto = "off"
                self.overlap_reason = (f"off: the optimizer is in host memory (optimizer tier "
                                       f"{optimizer_tier!r}), where the engine steps after "
                                       "backward")
            else:
                self._auto = "watching"
                self.overlap_reason = ("watching: the first step runs after backward; what the "
                                       "loop does between backward and step() decides")
            overlap_optimizer = False
        elif not isinstance(overlap_optimizer, str) and overlap_optimizer in (0, 1):
            self._auto = None
            self.overlap_reason = "given" if overlap_optimizer else "off: given"
        else:
            raise ValueError(f"memplan.torch: overlap_optimizer must be 'auto', True or False, "
                             f"not {overlap_optimizer!r}")
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
        self._watched = None        # "auto" watching: the options a prepared step would have had
        self._auto_clip = None      # "auto": the clipping it declared, (max_norm, norm_type)
        self._auto_next_clip = None  # "auto": a clipping to declare once this step is done
        # The sizes offload() chose from the machine (Note [Machine-sized defaults]), or None.
        self.chosen_schedule = sizing
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
            self._restore_meta()
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
                p = self._replaced.get(id(p), p)  # a meta parameter: its placeholder
                entry = self._by_param.get(id(p))
                if entry is None:
                    if any(p is q for _, q in self.kept) or not p.requires_grad:
                        continue  # frozen: no optimizer state, whichever group lists it
                    raise ValueError(f"memplan.torch: param_groups[{g}] holds a parameter that is "
                                     "not the module's")
                if entry.frozen:
                    continue
                if id(p) in seen:
                    raise ValueError(f"memplan.torch: {entry.name} is in "
                                     f"param_groups[{seen[id(p)]}] and param_groups[{g}]; a "
                                     "parameter is in one group")
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
        self._replace_meta()
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
            if id(entry.param) in self._lazy:
                # Made when start() reads it (Note [A model never materialised]).
                init = (lambda e: lambda: self._initial_values(e))(entry)
            else:
                init = entry.param.detach().to("cpu", torch.float32).contiguous().reshape(-1)
                init = self._broadcast(init)
            entry.id = self.engine.add_parameter(
                entry.name, entry.units[0].name, list(entry.shape) or [1], init,
                [u.name for u in entry.units[1:]], frozen=entry.frozen, group=entry.group,
                dtype=str(entry.dtype))
        # Reads the initial values (with resume, the frozen ones only: the others are the stores').
        try:
            started = self.engine.start()
        finally:
            self._made.clear()
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
        given = [e for e in unit.params if e.id in self._grads_given]
        if given:
            # A second backward over this step's graph (retain_graph): Note [A step that raised].
            # Refused before the fetch: an overlapped step may be writing the unit's new values.
            self._abandon()
            raise RuntimeError(self._twice_message(given[0].name))
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

    def explain(self):
        """What offload() chose and why, one line each: the schedule sizes it chose from the
        machine (chosen_schedule; Note [Machine-sized defaults]) and the overlapped optimizer's
        state (overlap_reason; Note [The overlapped optimizer by default])."""
        if self.chosen_schedule is not None:
            lines = [_explain_sizes(self.chosen_schedule)]
        else:
            lines = ["schedule: given whole (offload(..., schedule=...)), run as it is"]
        lines.append(f"overlap_optimizer = {self.overlap_optimizer}: {self.overlap_reason}")
        drive = getattr(self, "drive", None)
        if drive is not None:
            lines.append(explain_drive(drive))
        return "\n".join(lines)

    def master_weights(self):
        """{name: fp32 CPU tensor} of the engine's master weights (a checkpoint's content)."""
        return self._master_weights(self.params)

    def _master_weights(self, entries):
        self._check_open()
        out = {}
        for entry in entries:
            if entry.frozen:
                t = self._frozen_values(entry)
            else:
                t = torch.empty(entry.numel, dtype=torch.float32)
                self.engine.read_master(entry.id, t)
            out[entry.name] = t.view(entry.shape) if entry.shape else t.view(())
        return out

    # ---- the end ---------------------------------------------------------------------------------

    def close(self, materialise=False):
        """Removes the hooks, gives the parameters their trained values (fp32 master weights in
        the parameters' dtype, on the engine's device) and closes the engine. With world size > 1
        every rank calls it (the weights are gathered). A step in progress is dropped.
        Parameters offload() was given on the meta device go back to the module as those meta
        parameters, their values left in the stores (Note [A model never materialised]); with
        materialise=True they are read into memory too (the module then holds CPU parameters in
        their place)."""
        if self._closed:
            return
        abandon_error = None
        if self._micro > 0 or self._grads_given or self._prepared is not None:
            try:
                self._abandon()
            except OSError as e:  # the engine still closes; the error is raised at the end
                abandon_error = e
        self._final_stats = self.engine.stats()
        restored = [e for e in self.params if materialise or id(e.param) not in self._lazy]
        try:
            weights, error = self._master_weights(restored), None
        except OSError as e:  # the stores failed: the hooks and the engine go anyway
            weights, error = None, e
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        _unmanage(e.param for e in self.params)
        for entry in self.params:
            if weights is not None and entry.name in weights:
                entry.param.data = weights[entry.name].to(self.device, entry.dtype)
            entry.accumulator = None
        if not materialise:
            self._restore_meta()
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
        if abandon_error is not None:
            raise abandon_error

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
            process_group=None, fetch_units="auto", resume=False, overlap_optimizer="auto",
            param_groups=None, max_grad_norm=0.0, norm_type=2.0, momentum=0.9,
            nvme_bench=None, param_init=None, **schedule_options):
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
    --emit-schedule`` writes), which is run as it is. Sizes not given (pinned_budget_bytes,
    sub_group_elements, param_buffer_bytes, prefetch_bytes) are chosen from the machine and the
    model (choose_sizes; Note [Machine-sized defaults] in _torch_sizing): the pinned budget
    within RLIMIT_MEMLOCK (where the kernel enforces it) and an eighth of the memory available,
    about 16 optimizer sub-groups a step, staging buffers that hold the largest parameter, and a
    prefetch of 50 ms of the drive's measured reading; given ones are kept and the rest fit them.
    The result's ``chosen_schedule`` holds the values and one sentence each on why,
    ``explain()`` prints them, and offload() logs them once (logger "memplan.torch", INFO).
    state_slots: 2 (the default) keeps the optimizer's master weights and states twice on the
    drive, so that a crash, an I/O error or an abandoned step leaves the last step whole for
    ``resume``; 1 rewrites them in place, in half the space (about 20 bytes per fp32 parameter
    instead of 32), for a drive too small for two copies: a step interrupted after its first
    write (a crash, an I/O error, an exception in backward once the overlapped optimizer began
    writing, a step dropped by overlap_optimizer "auto") then leaves a store that later steps and
    resume refuse (OSError, DataLoss): restart from a checkpoint; a clipped step runs after
    backward. offload() first checks that the drive under `path` has room for the stores (OSError
    ENOSPC saying what each needs, and what state_slots=1 would); ``explain()`` says what they take.
    durability: "process" (the default) commits each step on the drive without flushing it: a
    process killed anywhere resumes from its last step; after a power loss or a kernel crash,
    ``resume`` gets an older whole step or an OSError (DataLoss), never a mix. "power" flushes the
    drive at every step's commit (fdatasync) so the last step survives those too, at the flush's
    cost per step (memplan.schedule).
    nvme_bench: ``memplan bench nvme --format json`` output (a file path or its dict) whose
    best.read_bytes_per_s sizes the prefetch; by default ``<path>/nvme_bench.json`` when it
    exists.
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
    overlap_optimizer: "auto" (the default): run each step's optimizer during its backward
    wherever that gives the results of the step after backward, bit for bit: with the optimizer
    on NVMe, from the second step on, when the first showed that the loop decides no option after
    backward (clip_grad_norm_(X, p) called after backward is declared as max_grad_norm=X,
    norm_type=p, and later calls return the norm the overlapped step measured); otherwise the
    step after backward. A change found only after a step was overlapped (other clip_grad_norm_
    arguments where either clipping would change the step, step() keywords that change an
    option, a step without the clipping of the earlier ones whose norm it would clip) drops that
    step, raises ValueError naming the call
    and saying to pass overlap_optimizer=False, and the coming steps run after backward. An I/O
    error of an overlapped step surfaces from backward (where the step begins), as OSError.
    True: always overlap (the options of a step are those in effect when its backward begins:
    ``set_options``; a step() that changes them raises and drops the step). False: the step
    runs after backward.
    param_init: for a module built on the meta device (larger than host memory), a callable
    fn(name, param) giving the initial values of meta parameter `name` (a tensor of its shape),
    called one parameter at a time as the engine writes its stores; without it, each meta
    parameter's module runs reset_parameters() on CPU memory for that module alone. The model is
    never whole in host memory (Note [A model never materialised]); close() leaves those
    parameters on the meta device unless close(materialise=True).
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
    if not (overlap_optimizer == "auto" or (not isinstance(overlap_optimizer, str) and
                                            overlap_optimizer in (0, 1))):
        raise ValueError(f"memplan.torch: overlap_optimizer must be 'auto', True or False, not "
                         f"{overlap_optimizer!r}")
    sizing, counts = None, count_parameters(module)
    if schedule is None:
        tier = "nvme" if path is not None else "cpu"
        param_tier, optimizer_tier = param_tier or tier, optimizer_tier or tier
        sizing = _machine_sizes(counts, path, param_tier, optimizer_tier, dtype, process_group,
                                nvme_bench, schedule_options)
        sized = {k: sizing[k] for k in SIZED_KEYS}
        schedule = memplan.schedule(path=path, param_tier=param_tier,
                                    optimizer_tier=optimizer_tier, dtype=dtype,
                                    optimizer="adam", **dict(schedule_options, **sized))
    elif nvme_bench is not None:
        raise ValueError("memplan.torch: nvme_bench sizes offload()'s own schedule; a whole "
                         "schedule given is run as it is")
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
    drive = None if resume else check_drive(counts, schedule,
                                            _process_group(process_group)[2])
    trainer = OffloadedModule(module, schedule, runtime=runtime, optimizer_options=options,
                              gradient_accumulation_steps=gradient_accumulation_steps,
                              device=device, process_group=process_group, fetch_units=fetch_units,
                              resume=resume, overlap_optimizer=overlap_optimizer,
                              param_groups=param_groups, sizing=sizing, param_init=param_init)
    trainer.drive = drive
    _log.info("memplan.torch: offload() chose:\n%s", trainer.explain())
    return trainer


def _machine_sizes(counts, path, param_tier, optimizer_tier, dtype, process_group, nvme_bench,
                   given):
    """choose_sizes() for a module of `counts` (count_parameters) on this machine (Note
    [Machine-sized defaults] in _torch_sizing): the sizes the caller did not give, and why."""
    elements, trainable = counts["elements"], counts["trainable"]
    largest, held = counts["largest"], counts["held"]
    world = _process_group(process_group)[2]
    param_bytes = 4 if dtype == "fp32" else 2
    # What stays in host memory besides the pinned buffers: the module's CPU tensors as given
    # (until the engine holds them), and tiers in memory (a working copy per parameter; master
    # weights, two states and a gradient per trainable element).
    resident = held
    if param_tier == "cpu":
        resident += -(-elements // world) * param_bytes
    if optimizer_tier == "cpu":
        resident += -(-trainable // world) * 16
    rate, source = None, ""
    if nvme_bench is None and path is not None:
        found = os.path.join(str(path), BENCH_FILE)
        if os.path.isfile(found):
            nvme_bench = found
    if nvme_bench is not None:
        rate, source = read_bandwidth(nvme_bench)
    facts = machine_facts()
    chosen = choose_sizes(
        elements=elements, trainable=trainable, largest_param_elements=largest,
        param_dtype_bytes=param_bytes, params_on_nvme=param_tier == "nvme",
        optimizer_on_nvme=optimizer_tier == "nvme", memlock_bytes=facts["memlock_bytes"],
        memlock_note=facts["memlock_note"], available_bytes=facts["available_bytes"],
        resident_bytes=resident, read_bytes_per_s=rate, bench_source=source, world_size=world,
        given={k: given[k] for k in SIZED_KEYS if k in given},
        param_buffer_count=given.get("param_buffer_count", 2),
        optimizer_buffer_count=given.get("optimizer_buffer_count", 3),
        max_live_bytes=given.get("max_live_bytes", 256 << 20))
    chosen["facts"] = dict(facts, elements=elements, trainable=trainable,
                           largest_param_elements=largest, resident_bytes=resident,
                           read_bytes_per_s=rate, world_size=world)
    return chosen
