#!/usr/bin/env python3
"""Oracle test: memplan's tensor inventory against the model Hugging Face Transformers builds.

For every config.json given (the estimator's fixtures plus the extra configs beside this script),
and for two model classes (the one memplan picks from `architectures`, and the base class that
AutoModel builds), this script

  1. builds the model with Transformers on PyTorch's meta device (no weights, no real memory: a
     46B-parameter Mixtral builds in a fraction of a second),
  2. runs `memplan inventory --model CONFIG [--model-class base] --format json`, and
  3. asserts that both have the same parameter names and shapes, the same tied aliases (a name that
     shares a Parameter with an earlier one must carry tied_to = the first name, as PyTorch's
     named_parameters() reports it), the same params_total (shared tensors once), the same
     DeepSpeed largest_layer_params (max over model.modules() of the parameters a module holds
     directly, as deepspeed.runtime.zero.stage3's estimators count them), the same
     largest_block_params (the largest element of any nn.ModuleList, counted recursively), and
     that each tensor's `module` is its owning module's path.

It prints one line per (config, class) with PASS/FAIL and, on mismatch, the differences (first 10
of each kind), then a closing line "oracle: N passed, N failed, N skipped", and exits non-zero when
anything failed. A config whose model_type this Transformers does not know is skipped (and said).

Without --memplan it only prints Transformers' inventories (for developing against a new family).

Needs: torch (Debian's python3-torch is enough) and the pinned Transformers in requirements.txt;
scripts/python-env.sh makes such a virtual environment.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import time
from typing import NoReturn

from oracle_common import deepspeed_largest_layer, listed, parameter_table
import oracle_common

MAX_LISTED = 10


def die(message: str) -> NoReturn:
    oracle_common.die("oracle", message)


try:
    import torch
    from torch import nn
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING
except ImportError as error:  # a configured oracle without its environment must fail, not skip
    die(f"cannot import torch/transformers ({error}); run scripts/python-env.sh and point "
        "MEMPLAN_PYTHON at the python it prints")

transformers.logging.set_verbosity_error()  # "sliding window not implemented for eager", ...

META = torch.device("meta")


@contextlib.contextmanager
def meta_device():
    """Every Parameter and buffer registered inside goes to the meta device at once.

    Equivalent to accelerate.init_empty_weights(include_buffers=True) and to torch>=2's
    `with torch.device("meta")`, for torch 1.13. nn.Linear and friends create their weight with
    torch.empty (untouched pages), register it (moved to meta here), then initialise it (a no-op on
    meta), so nothing the size of a weight is ever written. Buffers go to meta too, so that
    rotary caches computed from them (Mixtral: 32 layers x 32768 positions) are never computed.
    """
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def meta_parameter(module, name, param):
        register_parameter(module, name, param)
        param = module._parameters[name]
        if param is not None and param.device != META:
            module._parameters[name] = type(param)(param.to(META), requires_grad=param.requires_grad)

    def meta_buffer(module, name, tensor, persistent=True):
        register_buffer(module, name, tensor, persistent)
        tensor = module._buffers[name]
        if tensor is not None and tensor.device != META:
            module._buffers[name] = tensor.to(META)

    nn.Module.register_parameter = meta_parameter
    nn.Module.register_buffer = meta_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter
        nn.Module.register_buffer = register_buffer


# ---- the Transformers side ----------------------------------------------------------------------

class TorchInventory:
    """What PyTorch says about a model built by Transformers."""

    def __init__(self, model: nn.Module):
        self.class_name = type(model).__name__
        # names in named_parameters(remove_duplicate=False) order; name -> (shape, tied_to or "")
        self.order, self.tensors = parameter_table(model)
        unique = {id(p): p for p in model.parameters()}
        self.params_total = sum(p.numel() for p in unique.values())
        for param in unique.values():
            if param.device != META:
                raise RuntimeError(f"{self.class_name}: a parameter was allocated on {param.device}")

        # DeepSpeed (estimate_zero3_model_states_mem_needs_all_live / model_to_params).
        self.largest_layer_params, self.largest_layer_module = deepspeed_largest_layer(model)

        # Largest repeated block: an element of any nn.ModuleList, its parameters once each.
        self.largest_block_params, self.largest_block = 0, ""
        for prefix, module in model.named_modules():
            if not isinstance(module, nn.ModuleList):
                continue
            for index, block in enumerate(module):
                size = sum(p.numel() for p in {id(p): p for p in block.parameters()}.values())
                if size > self.largest_block_params:
                    self.largest_block_params = size
                    self.largest_block = f"{prefix}.{index}" if prefix else str(index)


def load_config(path: str):
    with open(path, encoding="utf-8") as file:
        data = json.load(file)
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if not model_type:
        return None, "no model_type (not a Hugging Face config.json)"
    if model_type not in CONFIG_MAPPING:
        return None, f"model_type {model_type!r} unknown to transformers {transformers.__version__}"
    config = CONFIG_MAPPING[model_type].from_dict(data)
    return config, ""


def model_class(name):
    """Transformers' model class called `name`, or None."""
    cls = getattr(transformers, name, None) if name else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        return cls
    return None


def architecture_class(config):
    """The class named first in config.architectures, or None when absent or unknown."""
    names = getattr(config, "architectures", None) or []
    return model_class(names[0]) if names else None


def base_class(config):
    return MODEL_MAPPING[type(config)]


def build(cls, config) -> TorchInventory:
    with meta_device():
        model = cls(config)
    return TorchInventory(model)


# ---- the memplan side ---------------------------------------------------------------------------

def run_memplan(memplan: str, config_path: str, base: bool):
    # Transformers 4 builds one Linear per MoE expert, as checkpoints hold them.
    command = [memplan, "inventory", "--model", config_path, "--expert-layout", "per-expert",
               "--format", "json"]
    if base:
        command[4:4] = ["--model-class", "base"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"`{' '.join(command)}` could not run: {error}"
    if result.returncode != 0:
        return None, (f"`{' '.join(command)}` exited {result.returncode}: "
                      f"{(result.stderr or result.stdout).strip()[:500]}")
    try:
        document = json.loads(result.stdout)
        model, tensors = document["model"], document["tensors"]
        if not isinstance(model, dict) or not isinstance(tensors, list):
            raise TypeError("'model' must be an object and 'tensors' an array")
    except (ValueError, KeyError, TypeError) as error:
        return None, f"`{' '.join(command)}` printed no inventory JSON ({error}): {result.stdout[:200]!r}"
    return document, ""


# ---- comparison ---------------------------------------------------------------------------------

def compare(torch_side: TorchInventory, document):
    """Differences between memplan's document and PyTorch's truth, as lines of text."""
    problems = []
    model = document["model"]
    if model.get("architecture") != torch_side.class_name:
        problems.append(f"architecture: memplan {model.get('architecture')!r}, "
                        f"transformers builds {torch_side.class_name!r}")

    mine, duplicates, bad = {}, [], []
    for entry in document["tensors"]:
        try:
            name = entry["name"]
            mine_shape = tuple(int(d) for d in entry["shape"])
            tied_to = entry.get("tied_to") or ""
        except (KeyError, TypeError, ValueError):
            bad.append(repr(entry)[:80])
            continue
        if name in mine:
            duplicates.append(name)
        mine[name] = (mine_shape, tied_to, entry.get("module"))
    if bad:
        problems.append(f"malformed tensor entries: {listed(bad)}")
    if duplicates:
        problems.append(f"names listed twice by memplan: {listed(duplicates)}")

    theirs = torch_side.tensors
    missing = [n for n in torch_side.order if n not in mine]
    extra = [n for n in mine if n not in theirs]
    if missing:
        problems.append(f"{len(missing)} names missing in memplan: {listed(missing)}")
    if extra:
        problems.append(f"{len(extra)} names memplan has but transformers does not: {listed(extra)}")

    shapes, ties, modules = [], [], []
    for name in torch_side.order:
        if name not in mine:
            continue
        shape, tied_to = theirs[name]
        m_shape, m_tied, m_module = mine[name]
        if shape != m_shape:
            shapes.append(f"{name}: memplan {list(m_shape)} vs transformers {list(shape)}")
        if tied_to != m_tied:
            ties.append(f"{name}: memplan tied_to {m_tied!r} vs transformers {tied_to!r}")
        owner = name.rpartition(".")[0]
        if m_module is not None and m_module != owner:
            modules.append(f"{name}: memplan module {m_module!r} vs {owner!r}")
    if shapes:
        problems.append(f"{len(shapes)} shape differences: " + "; ".join(shapes[:MAX_LISTED]))
    if ties:
        problems.append(f"{len(ties)} tie differences: " + "; ".join(ties[:MAX_LISTED]))
    if modules:
        problems.append(f"{len(modules)} module-path differences: " + "; ".join(modules[:MAX_LISTED]))

    for key, truth, where in (
            ("params_total", torch_side.params_total, ""),
            ("largest_layer_params", torch_side.largest_layer_params,
             f" (module {torch_side.largest_layer_module or '<root>'!r})"),
            ("largest_block_params", torch_side.largest_block_params,
             f" (block {torch_side.largest_block!r})")):
        value = model.get(key)
        if value != truth:
            problems.append(f"{key}: memplan {value} vs transformers {truth}{where}")
    return problems


# ---- driver -------------------------------------------------------------------------------------

def config_files(models_dir: str, extra_dirs):
    files = []
    if models_dir:
        found = sorted(glob.glob(os.path.join(models_dir, "*.json")))
        if not found:
            die(f"no *.json in --models-dir {models_dir}")
        files += found
    for directory in extra_dirs:
        found = sorted(glob.glob(os.path.join(directory, "*.json")))
        if not found:
            die(f"no *.json in --extra-dir {directory}")
        files += found
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memplan", help="the memplan binary; without it, print Transformers' side only")
    parser.add_argument("--models-dir", help="directory of config.json fixtures (all *.json are tested)")
    parser.add_argument("--extra-dir", action="append", default=[], help="more *.json configs (repeatable)")
    parser.add_argument("--config", action="append", default=[], help="one more config file (repeatable)")
    parser.add_argument("--only", help="test only files whose name contains this text")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every tensor (Transformers' side)")
    args = parser.parse_args()

    files = config_files(args.models_dir, args.extra_dir) + args.config
    if args.only:
        files = [f for f in files if args.only in os.path.basename(f)]
    if not files:
        die("no configs to test (give --models-dir, --extra-dir or --config)")
    if args.memplan and not os.access(args.memplan, os.X_OK):
        die(f"--memplan {args.memplan} is not an executable file")

    print(f"oracle: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{len(files)} configs, memplan {args.memplan or '(none: Transformers side only)'}")
    started = time.monotonic()
    passed = failed = skipped = 0
    for path in files:
        label = os.path.relpath(path)
        try:
            config, why = load_config(path)
        except Exception as error:  # noqa: BLE001 - any config Transformers rejects is a failure
            print(f"FAIL  {label}: transformers cannot read it: {error}")
            failed += 1
            continue
        if config is None:
            print(f"SKIP  {label}: {why}")
            skipped += 1
            continue
        for variant in ("architectures", "base"):
            clock = time.monotonic()
            head = f"{label} [{variant}]"
            document = None
            if args.memplan:
                document, error = run_memplan(args.memplan, path, variant == "base")
                if document is None:
                    print(f"FAIL  {head}: {error}")
                    failed += 1
                    continue
            if variant == "base":
                cls = base_class(config)
            else:
                cls = architecture_class(config)
                if cls is None:
                    # e.g. t5-large's "T5WithLMHeadModel", an alias Transformers dropped: build what
                    # memplan says it builds, as long as Transformers has that class.
                    named = document["model"].get("architecture", "") if document else ""
                    cls = model_class(named)
                    if cls is None:
                        print(f"SKIP  {head}: architectures {getattr(config, 'architectures', None)} "
                              f"names no Transformers class" + (f" and memplan built {named!r}" if named else ""))
                        skipped += 1
                        continue
            try:
                truth = build(cls, config)
            except Exception as error:  # noqa: BLE001
                print(f"FAIL  {head}: transformers cannot build {cls.__name__}: {type(error).__name__}: {error}")
                failed += 1
                continue
            summary = (f"{truth.class_name} tensors={len(truth.order)} params={truth.params_total:,} "
                       f"largest_layer={truth.largest_layer_params:,} largest_block={truth.largest_block_params:,}")
            if document is None:
                print(f"INFO  {head}: {summary}")
                if args.verbose:
                    for name in truth.order:
                        shape, tied_to = truth.tensors[name]
                        print(f"        {name} {list(shape)}" + (f" -> {tied_to}" if tied_to else ""))
                continue
            problems = compare(truth, document)
            seconds = time.monotonic() - clock
            if problems:
                failed += 1
                print(f"FAIL  {head}: {summary} ({seconds:.2f}s)")
                for problem in problems:
                    print(f"        {problem}")
            else:
                passed += 1
                print(f"PASS  {head}: {summary} ({seconds:.2f}s)")
    print(f"oracle: {time.monotonic() - started:.1f}s")
    if args.memplan:
        print(f"oracle: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
