"""memplan.torch's pieces its other modules share (a private module of memplan.torch, which
imports what it uses from here): the dtype tables, engine memory as a torch tensor, the engine's
collectives over a torch.distributed process group, and torch.optim param groups' options as the
engine's."""

import torch


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
