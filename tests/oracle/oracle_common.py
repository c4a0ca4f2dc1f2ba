"""What both oracle scripts read off a PyTorch model: its parameters as named_parameters lists
them, tied aliases included, and DeepSpeed's largest layer. Works on torch 1.13 and 2.x."""

from __future__ import annotations

import sys
from typing import NoReturn


def die(tool: str, message: str) -> NoReturn:
    """Reports a usage or environment error (exit 2: not a test failure)."""
    print(f"{tool}: error: {message}", file=sys.stderr)
    sys.exit(2)


def listed(items, limit=10):
    """The first `limit` items, comma-separated, and how many more there are."""
    items = list(items)
    text = ", ".join(items[:limit])
    return text + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def parameter_table(model):
    """(order, tensors): every parameter name in named_parameters(remove_duplicate=False) order,
    and name -> (shape, tied_to), tied_to being the first name of the same Parameter ("" for that
    first name itself)."""
    order, tensors, canonical = [], {}, {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module._parameters.items():
            if param is None:
                continue
            name = f"{prefix}.{leaf}" if prefix else leaf
            if name in tensors:
                continue
            first = canonical.setdefault(id(param), name)
            tensors[name] = (tuple(param.shape), "" if first == name else first)
            order.append(name)
    return order, tensors


def deepspeed_largest_layer(model):
    """(params, module name): the most parameters one module holds directly, as DeepSpeed's
    estimate_zero3_model_states_mem_needs_all_live counts them (first module on ties)."""
    largest, where = 0, ""
    names = {id(m): n for n, m in model.named_modules()}
    for module in model.modules():
        held = sum(p.numel() for p in module.parameters(recurse=False))
        if held > largest:
            largest, where = held, names[id(module)]
    return largest, where
