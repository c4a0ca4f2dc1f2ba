"""A model built on torch's meta device, offloaded without ever being whole in host memory (a
private module of memplan.torch): its parameters' placeholders and their initial values made on
demand, as a mixin class memplan.torch.OffloadedModule inherits (it uses the fields
OffloadedModule.__init__ sets: module, _param_init, _lazy, _replaced, _made)."""

import torch

# Note [A model never materialised]
# A model larger than host memory cannot be built in it: build it on torch's meta device (``with
# torch.device("meta"): model = GPT(...)``, or ``device="meta"`` per layer) and offload() it. Each
# meta parameter is replaced in its module by a CPU placeholder of its shape that holds no memory
# (a zero-stride view), under every name that held it (ties kept), and its initial values are made
# when the engine's start() asks for them, one parameter at a time, and dropped once written to
# the stores (the binding's Note [Initial values made on demand]): the model is never whole in host
# memory, only its largest module is. The values come from ``param_init(name, param)`` when given
# (a float tensor of param's shape; `param` is the meta parameter, `name` its first name), else from
# the owning module's ``reset_parameters()`` run on CPU memory for that module alone (FSDP's
# default for meta modules): the global RNG is then drawn in registration order, not the order the
# module's constructor would have drawn it, so the values are not those of the same model built on
# CPU under the same seed (a param_init that seeds per name gives the same values either way). With
# several ranks the values are not broadcast: param_init (or the seeded RNG) must give every rank
# the same ones. A meta buffer is refused, naming it (the engine holds parameters only: build
# buffers on CPU). close() leaves these parameters on the meta device (their trained values stay in
# the stores under `path`; ``close(materialise=True)`` reads them into memory instead), and
# param_groups may name the meta parameters. A meta parameter without param_init whose module has
# no reset_parameters() is refused at offload().


class _MetaMixin:
    def _replace_meta(self):
        """Note [A model never materialised]: every meta parameter replaced, wherever the module
        holds it, by a placeholder of its shape on CPU without memory; meta buffers refused."""
        for module_name, sub in self.module.named_modules():
            for buffer_name, b in sub._buffers.items():
                if b is not None and b.is_meta:
                    full = f"{module_name}.{buffer_name}" if module_name else buffer_name
                    raise ValueError(
                        f"memplan.torch: buffer {full} is on the meta device; offload() makes "
                        "the initial values of meta parameters only (the engine holds "
                        "parameters): build the module's buffers on CPU")
        for module_name, sub in self.module.named_modules():
            for param_name, p in list(sub._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                full = f"{module_name}.{param_name}" if module_name else param_name
                placeholder = self._replaced.get(id(p))
                if placeholder is None:
                    if self._param_init is None and not callable(
                            getattr(sub, "reset_parameters", None)):
                        raise ValueError(
                            f"memplan.torch: parameter {full} is on the meta device and its "
                            f"module ({type(sub).__name__}) has no reset_parameters(); pass "
                            "param_init=fn(name, param) giving its initial values")
                    placeholder = torch.nn.Parameter(
                        torch.zeros((), dtype=p.dtype).expand(p.shape),
                        requires_grad=p.requires_grad)
                    self._replaced[id(p)] = placeholder
                    self._lazy[id(placeholder)] = (p, sub, param_name, full)
                sub._parameters[param_name] = placeholder

    def _restore_meta(self):
        """The module's meta parameters back in the places of their placeholders (an offload()
        that failed, close())."""
        for sub in self.module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and id(p) in self._lazy:
                    sub._parameters[name] = self._lazy[id(p)][0]

    def _initial_values(self, entry):
        """The initial values of a parameter given on the meta device, made now (Note [A model
        never materialised]): flat float32 CPU values."""
        meta, owner, param_name, full = self._lazy[id(entry.param)]
        values = self._made.pop(full, None)
        if values is None and self._param_init is not None:
            values = self._param_init(full, meta)
            if not isinstance(values, torch.Tensor) or tuple(values.shape) != entry.shape:
                raise ValueError(f"memplan.torch: param_init({full!r}) must give a tensor of "
                                 f"shape {entry.shape}, not "
                                 f"{getattr(values, 'shape', type(values).__name__)}")
        elif values is None:
            values = self._reset_owner(owner, full)
        return values.detach().to("cpu", torch.float32).contiguous().reshape(-1)

    def _reset_owner(self, owner, wanted):
        """`owner.reset_parameters()` on CPU memory for its own meta-given parameters, which get
        their placeholders back after; the values of those not asked for yet are kept for their
        turn (self._made). The values of parameter `wanted`."""
        own = [(n, p) for n, p in owner._parameters.items()
               if p is not None and id(p) in self._lazy]
        saved = [(p, p.data) for _, p in own]
        try:
            for _, p in own:
                p.data = torch.empty(p.shape, dtype=p.dtype)
            with torch.no_grad():
                owner.reset_parameters()
            made = {self._lazy[id(p)][3]: p.data for _, p in own}
        finally:
            for p, data in saved:
                p.data = data
        values = made.pop(wanted)
        self._made.update(made)
        return values
