#!/usr/bin/env python3
"""Modern oracle: memplan's inventories against the models today's Transformers builds.

Runs in the modern environment (scripts/python-env.sh --modern: PyPI torch 2.x, Transformers 5,
Accelerate 1.x), which knows the families Transformers 4.47 lacks. For every config.json in the
given directories (real-shaped configs of the published models, written by hand from their Hub
pages, and the built-in ones) and for each class to test (the one `architectures` names, the base
class AutoModel builds, and, for the first config of each family, every task head Transformers
gives it with a 3-label id2label), it

  1. builds the model with `cls(config)` under `torch.device("meta")` (no memory, fp32),
  2. runs `memplan inventory --model <config> --format json` on the same config (a head class is
     requested by writing `architectures` into a copy of the config),
  3. compares the class built; every parameter's name, shape and order as
     named_parameters(remove_duplicate=False) yields them, with tied aliases (tied_to = the first
     name); every buffer's name and shape; params_total (tied once); DeepSpeed's largest layer
     (the most parameters one module holds directly, as its ZeRO-3 estimators count); and
     Accelerate's accelerate.utils.calculate_maximum_sizes: total size and largest layer (its
     `_no_split_modules` rule), which `accelerate estimate-memory` prints.

Families whose names follow checkpoints and Transformers 4 rather than Transformers 5 (NAMES_4X)
are compared on everything but names and order; the 4.47 oracle (oracle_test.py) checks their
names. One process builds every model (a few seconds of import, then a fraction of a second per
model). Prints PASS/FAIL per (config, class) and a closing count; exits 1 on any failure, 2 on a
usage error.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import NoReturn

from oracle_common import deepspeed_largest_layer, listed, parameter_table
import oracle_common


def die(message: str) -> NoReturn:
    oracle_common.die("modern-oracle", message)


try:
    import torch
    import transformers
    from accelerate.utils import calculate_maximum_sizes
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING
except ImportError as error:  # a configured oracle without its environment must fail, not skip
    die(f"cannot import torch/transformers/accelerate ({error}); run scripts/python-env.sh "
        "--modern and point MEMPLAN_MODERN_PYTHON at the python it prints")

transformers.logging.set_verbosity_error()

# Where memplan deliberately follows the published checkpoints and Transformers 4 (whose names the
# 4.47 oracle checks) and Transformers 5 renamed: GPT-NeoX's head is `embed_out` there.
NAMES_4X = {"gpt_neox": "head named embed_out as in checkpoints (5.x: lm_head)"}
# Configs whose very structure Transformers 5 changed on purpose; memplan keeps the checkpoint's.
SKIP = {
    "t5-v1_1-base.json": "Transformers 5 ties lm_head from a config, the checkpoint is untied",
}
TWO_LABELS = {"DistilBertForQuestionAnswering"}  # raises unless num_labels == 2
HEAD_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


class Truth:
    """What PyTorch, DeepSpeed's counting and Accelerate say about the model Transformers builds."""

    def __init__(self, model):
        self.class_name = type(model).__name__
        self.order, self.tensors = parameter_table(model)
        self.buffers = {n: tuple(b.shape) for n, b in model.named_buffers()}
        self.params_total = sum(p.numel() for p in model.parameters())
        self.largest_layer_params, _ = deepspeed_largest_layer(model)
        total, (largest, names) = calculate_maximum_sizes(model)
        self.accelerate_total, self.accelerate_largest = int(total), int(largest)
        self.accelerate_largest_names = names


def run_memplan(memplan, path):
    command = [memplan, "inventory", "--model", path, "--format", "json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if result.returncode != 0:
        return None, f"exit {result.returncode}: {(result.stderr or result.stdout).strip()[:400]}"
    return json.loads(result.stdout), ""


def compare(truth, doc, names):
    problems = []
    model = doc["model"]
    if model["architecture"] != truth.class_name:
        problems.append(f"class: memplan {model['architecture']!r}, transformers {truth.class_name!r}")
    mine = {t["name"]: (tuple(t["shape"]), t["tied_to"]) for t in doc["tensors"]}
    if names:
        order = [t["name"] for t in doc["tensors"]]
        missing = [n for n in truth.order if n not in mine]
        extra = [n for n in order if n not in truth.tensors]
        if missing:
            problems.append(f"{len(missing)} missing: {listed(missing)}")
        if extra:
            problems.append(f"{len(extra)} extra: {listed(extra)}")
        if not missing and not extra and order != truth.order:
            first = next(i for i, (a, b) in enumerate(zip(order, truth.order)) if a != b)
            problems.append(f"order differs at {first}: memplan {order[first]!r}, "
                            f"transformers {truth.order[first]!r}")
        bad = [f"{n}: {list(mine[n][0])} vs {list(s)}" for n, (s, _) in truth.tensors.items()
               if n in mine and mine[n][0] != s]
        if bad:
            problems.append(f"{len(bad)} shapes: {listed(bad)}")
        ties = [f"{n}: {mine[n][1]!r} vs {t!r}" for n, (_, t) in truth.tensors.items()
                if n in mine and mine[n][1] != t]
        if ties:
            problems.append(f"{len(ties)} ties: {listed(ties)}")
        buffers = {b["name"]: tuple(b["shape"]) for b in doc.get("buffers", [])}
        if buffers != truth.buffers:
            diff = sorted(set(buffers.items()) ^ set(truth.buffers.items()))
            problems.append(f"buffers differ: {listed(str(d) for d in diff)}")
    for key, value in (("params_total", truth.params_total),
                       ("largest_layer_params", truth.largest_layer_params),
                       ("accelerate_total_bytes", truth.accelerate_total),
                       ("accelerate_largest_layer_bytes", truth.accelerate_largest)):
        if model.get(key) != value:
            where = f" ({listed(truth.accelerate_largest_names, 3)})" if "largest_layer_b" in key else ""
            problems.append(f"{key}: memplan {model.get(key)} vs {value}{where}")
    return problems


def head_classes(config):
    """The task-head classes Transformers has for this config's family: <stem>For...Classification."""
    base = MODEL_MAPPING[type(config)].__name__
    stem = base[: -len("Model")] if base.endswith("Model") else base
    found = []
    for suffix in HEAD_SUFFIXES:
        cls = getattr(transformers, stem + suffix, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            found.append(cls)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memplan", required=True)
    parser.add_argument("--configs", action="append", default=[], help="directory of *.json")
    parser.add_argument("--only", help="test only files whose name contains this")
    args = parser.parse_args()
    files = []
    for directory in args.configs:
        found = sorted(glob.glob(os.path.join(directory, "*.json")))
        if not found:
            die(f"no *.json in {directory}")
        files += found
    if args.only:
        files = [f for f in files if args.only in os.path.basename(f)]
    print(f"modern-oracle: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{len(files)} configs")
    started = time.monotonic()
    passed = failed = skipped = 0
    heads_done = set()
    with tempfile.TemporaryDirectory() as scratch:
        for path in files:
            label = os.path.basename(path)
            with open(path, encoding="utf-8") as file:
                data = json.load(file)
            model_type = data.get("model_type")
            if label in SKIP or model_type not in CONFIG_MAPPING:
                print(f"SKIP  {label}: {SKIP.get(label, f'model_type {model_type!r} unknown')}")
                skipped += 1
                continue
            config = CONFIG_MAPPING[model_type].from_dict(dict(data))
            variants = [("architectures", path, None)]
            base = MODEL_MAPPING[type(config)]
            variants.append(("base", path, base))
            if model_type not in heads_done:
                heads_done.add(model_type)
                for cls in head_classes(config):
                    # Three labels tell a head sized by num_labels from one sized 2; a class
                    # that insists on 2 (DistilBERT's QA) gets 2.
                    labels = 2 if cls.__name__ in TWO_LABELS else 3
                    variant = dict(data, architectures=[cls.__name__],
                                   id2label={str(i): f"L{i}" for i in range(labels)})
                    variant_path = os.path.join(scratch, f"{cls.__name__}.json")
                    with open(variant_path, "w", encoding="utf-8") as file:
                        json.dump(variant, file)
                    variants.append((cls.__name__, variant_path, cls))
            for name, config_path, cls in variants:
                head = f"{label} [{name}]"
                command_path = config_path
                if name == "base":
                    # `--model-class base` is the CLI's way to ask for the base model.
                    result = subprocess.run([args.memplan, "inventory", "--model", config_path,
                                             "--model-class", "base", "--format", "json"],
                                            capture_output=True, text=True, timeout=120)
                    doc = json.loads(result.stdout) if result.returncode == 0 else None
                    error = result.stderr.strip()[:400]
                else:
                    doc, error = run_memplan(args.memplan, command_path)
                if doc is None:
                    print(f"FAIL  {head}: memplan: {error}")
                    failed += 1
                    continue
                if cls is None:
                    cls = getattr(transformers, (data.get("architectures") or [""])[0], None)
                    if cls is None:
                        cls = getattr(transformers, doc["model"]["architecture"], None)
                cfg = config
                if config_path != path:
                    with open(config_path, encoding="utf-8") as file:
                        cfg = CONFIG_MAPPING[model_type].from_dict(json.load(file))
                # Accelerate sizes the model built in fp32 (create_empty_model passes
                # torch_dtype=float32); head classes would otherwise build their base model in
                # the config's dtype through AutoModel.from_config.
                cfg.dtype = torch.float32
                # A composite (Llava) builds each sub-model in its sub-config's dtype unless told
                # otherwise; from_config(torch_dtype=float32), as Accelerate calls it, builds all
                # of it in fp32.
                for sub in getattr(cfg, "sub_configs", {}) or {}:
                    if getattr(cfg, sub, None) is not None:
                        getattr(cfg, sub).dtype = torch.float32
                try:
                    with torch.device("meta"):
                        truth = Truth(cls(cfg))
                except Exception as error:  # noqa: BLE001 - any build failure is a failure
                    print(f"FAIL  {head}: transformers cannot build it: {type(error).__name__}: {error}")
                    failed += 1
                    continue
                problems = compare(truth, doc, model_type not in NAMES_4X)
                summary = (f"{truth.class_name} params={truth.params_total:,} "
                           f"L={truth.largest_layer_params:,} "
                           f"accelerate={truth.accelerate_total:,}/{truth.accelerate_largest:,}")
                if problems:
                    failed += 1
                    print(f"FAIL  {head}: {summary}")
                    for problem in problems:
                        print(f"        {problem}")
                else:
                    passed += 1
                    print(f"PASS  {head}: {summary}")
    print(f"modern-oracle: {time.monotonic() - started:.1f}s; "
          f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
