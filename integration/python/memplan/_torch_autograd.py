"""memplan.torch's autograd pieces and the torch functions it patches while an engine holds
parameters (a private module of memplan.torch): the identity functions that fetch a unit again for
its backward, F.linear's replacement, clip_grad_norm_ and GradScaler.unscale_ (Note [What
memplan.torch patches]), and the registry of the parameters an engine manages."""

import weakref

import torch


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
