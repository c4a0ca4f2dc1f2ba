#!/usr/bin/env python3
"""Measure published setups on a GPU and append the results as records of the same format.

    python3 bench/measure_peak.py --memplan build/tools/memplan \\
        [--records tests/accuracy/published.json] [--append OUT.json] [--only ID,...] \\
        [--steps 3] [--runs RUNS.json] [--gpu-preset a100-80] [--dry-run]

Reads the records of tests/accuracy/published.json (one published run each, with the memplan
flags that express it; see bench/accuracy.py), picks the runnable ones and, on the local GPU,
trains each again with PyTorch and Transformers (random weights from the model's config, random
tokens, nothing downloaded), measuring what the record measured: torch.cuda.max_memory_allocated
for "max_memory_allocated" records, the GPU's used memory (NVML, as nvidia-smi shows it: the
CUDA context included) for "nvidia-smi" records. Each measurement becomes a new record, in the
same format, appended to --append (default: the records file itself), with the id suffixed by
the GPU, the source naming this script, the date, torch and Transformers, the measured CUDA
context, and memplan flags that describe the run as it happened (this PyTorch, this context).
bench/accuracy.py and tests/accuracy_test then judge memplan against it like any published row.

A record is runnable when its figure is a peak (not a verdict or a batch limit) and every memplan
flag is one this runner reproduces: one GPU, no ZeRO/FSDP/DeepSpeed/offload/tensor parallelism,
Transformers model code (not --framework litgpt), no QLoRA, and a model it can build (a config
path in the repository, or a name listed in CONFIGS). The reason is printed for the others.
Precisions: fp32; bf16-pure (weights, gradients and optimizer states in bf16); bf16-mixed or
fp16-mixed with --autocast (torch.autocast over fp32 weights). The optimizer is torch's, with
foreach/fused as the flags say; zero_grad keeps gradients (set_to_none=False).

--runs RUNS.json also records each run's step time (the median over the steps after the first,
timed with the GPU synchronised) as a measured run of `memplan calibrate`'s format
(memplan.runs/1: model, cluster, setup, step_time_s), appended to RUNS.json (a run of the same
id is replaced). The GPU is named by its memplan preset: --gpu-preset, else the preset whose name
the device's name matches (PRESETS); an unknown GPU stops the script before anything runs.

--dry-run needs neither a GPU nor PyTorch: it lists what would run and, with --append, writes the
records it would append with memplan's prediction in place of the measurement (marked
"dry_run": true, ids suffixed -dry-run), so that the record handling can be tested; with --runs, the step time stand-in is memplan's
own prediction for the run (`memplan plan` with its configuration given), so that calibrating on
the dry-run runs gives back memplan's priors.
"""
import argparse
import copy
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Hugging Face configs of the memplan builtin names the records use.
CONFIGS = {
    "bert-large-uncased": {
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 1024,
        "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
        "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2,
        "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
    },
    "llama-2-7b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
}

# memplan GPU presets by the device name torch reports (first match; more specific names first).
PRESETS = [("H200 NVL", "h200-nvl"), ("H200", "h200"), ("H100", "h100-80"), ("B200", "b200"),
           ("A100-SXM4-40GB", "a100-40"), ("A100-PCIE-40GB", "a100-40"), ("A100", "a100-80"),
           ("A800", "a800-80"), ("L40S", "l40s"), ("A10G", "a10g"), ("L4", "l4"), ("T4", "t4"),
           ("V100-SXM2-16GB", "v100-16"), ("V100", "v100-32"), ("RTX 4090", "rtx4090"),
           ("RTX 3090", "rtx3090"), ("MI300X", "mi300x")]
RUNS_FORMAT = "memplan.runs/1"

PEAK_KINDS = ("max_memory_allocated", "nvidia-smi")
# Flags this runner reproduces, with how many values each takes.
SUPPORTED = {"--model": 1, "--model-class": 1, "--precision": 1, "--optimizer": 1,
             "--micro-batch": 1, "--seq-len": 1, "--grad-accum": 1, "--checkpointing": 1,
             "--flash-attention": 0, "--no-flash-attention": 0, "--foreach": 0, "--no-foreach": 0,
             "--fused-optimizer": 0, "--sgd-momentum": 1, "--autocast": 0, "--lora-rank": 1,
             "--lora-targets": 1, "--cuda-context-mib": 1, "--torch-version": 1,
             "--framework": 1, "--gpus": 1, "--zero-stage": 1}


def parse_flags(flags):
    """{flag: value or True}; raises ValueError on a flag the runner does not reproduce."""
    out, i = {}, 0
    while i < len(flags):
        flag = flags[i]
        if flag not in SUPPORTED:
            raise ValueError(f"{flag} is not reproduced by this runner")
        n = SUPPORTED[flag]
        out[flag] = flags[i + 1] if n else True
        i += 1 + n
    return out


def runnable(record):
    """(plan, reason): the run's plan, or None and why not."""
    kind = record["measured"].get("kind")
    if kind not in PEAK_KINDS:
        return None, f"a {kind} figure (only peaks are measured)"
    try:
        f = parse_flags(record["memplan"])
    except ValueError as e:
        return None, str(e)
    if f.get("--framework", "transformers") != "transformers":
        return None, f"--framework {f['--framework']} (this runner trains Transformers models)"
    if f.get("--gpus", "1") != "1" or f.get("--zero-stage", "0") != "0":
        return None, "more than one GPU or a ZeRO stage"
    precision = f.get("--precision", "bf16-mixed")
    if precision in ("bf16-mixed", "fp16-mixed") and "--autocast" not in f:
        return None, (f"--precision {precision} without --autocast (DeepSpeed-style 16-bit "
                      "weights with an fp32 master copy; this runner trains with torch.autocast)")
    model = f.get("--model", "")
    if model in CONFIGS:
        config = CONFIGS[model]
    else:
        path = os.path.join(ROOT, model)
        if not (model.endswith(".json") and os.path.isfile(path)):
            return None, f"no config for model '{model}' (add it to CONFIGS)"
        with open(path) as fh:
            config = json.load(fh)
    optimizer = f.get("--optimizer", "adamw")
    if optimizer not in ("adamw", "sgd"):
        return None, f"--optimizer {optimizer}"
    plan = {"config": config, "model_class": f.get("--model-class", ""), "precision": precision,
            "optimizer": optimizer, "micro_batch": int(f.get("--micro-batch", "1")),
            "seq_len": int(f.get("--seq-len", "512")), "grad_accum": int(f.get("--grad-accum", "1")),
            "checkpointing": f.get("--checkpointing", "none") == "full",
            "selective": f.get("--checkpointing", "none") == "selective",
            "attention": "eager" if "--no-flash-attention" in f else "sdpa",
            "foreach": "--no-foreach" not in f, "fused": "--fused-optimizer" in f,
            "sgd_momentum": float(f.get("--sgd-momentum", "0")),
            "lora_rank": int(f.get("--lora-rank", "0")),
            "lora_targets": f.get("--lora-targets", ""), "kind": kind}
    if plan["selective"]:
        return None, "--checkpointing selective (Megatron's; Transformers has none)"
    return plan, ""


def find_memplan(given):
    for candidate in [given, os.path.join(ROOT, "build/tools/memplan"), shutil.which("memplan")]:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("memplan binary not found; pass --memplan PATH")


def predict(memplan, flags):
    run = subprocess.run([memplan, "estimate", *flags, "--format", "json"], capture_output=True,
                         text=True, cwd=ROOT)
    if run.returncode != 0:
        raise RuntimeError(f"memplan estimate {' '.join(flags)}: {run.stderr.strip()}")
    j = json.loads(run.stdout)
    peak = j["peak"]
    allocated = next(p["gpu_allocated_bytes"] for p in j["phases"] if p["phase"] == peak["phase"])
    return {"gpu_bytes": peak["gpu_bytes"], "allocated_bytes": allocated}


def used_gpu_bytes(torch):
    """The device's used memory as nvidia-smi shows it (NVML), else total - free."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used
    except Exception:  # no NVML binding: CUDA's view of the same device
        free, total = torch.cuda.mem_get_info()
        return total - free


def gpu_preset(name):
    """The memplan preset of a device name, or None."""
    for token, preset in PRESETS:
        if token.lower() in name.lower():
            return preset
    return None


def run_setup(plan):
    """The memplan TrainingSetup (estimate's "setup" JSON) of a runnable plan, as it ran."""
    setup = {"precision": plan["precision"], "optimizer": plan["optimizer"],
             "micro_batch": plan["micro_batch"], "seq_len": plan["seq_len"],
             "grad_accum": plan["grad_accum"], "zero_stage": 0,
             "checkpointing": "full" if plan["checkpointing"] else "none",
             "flash_attention": plan["attention"] != "eager", "foreach": plan["foreach"],
             "fused_optimizer": plan["fused"],
             "autocast": plan["precision"] in ("bf16-mixed", "fp16-mixed")}
    if plan["optimizer"] == "sgd":
        setup["sgd_momentum"] = plan["sgd_momentum"]
    if plan["lora_rank"]:
        setup["lora_rank"] = plan["lora_rank"]
        if plan["lora_targets"]:
            setup["lora_targets"] = plan["lora_targets"].split(",")
    return setup


def run_record(record, plan, step_s, env, preset, dry_run=False):
    """A measured run of `memplan calibrate`'s format for `record`'s setup on this machine."""
    flags = parse_flags(record["memplan"])
    return {"id": f"{record['id']}-{'dry-run' if dry_run else 'measured-' + preset}",
            "model": flags["--model"],
            "model_class": "base" if plan["model_class"] == "base" else "auto",
            "cluster": {"gpu": preset, "gpus_per_node": 1, "nodes": 1},
            "setup": run_setup(plan), "step_time_s": step_s,
            "source": (f"bench/measure_peak.py on {env['gpu']}, {datetime.date.today()}"
                       + (" (dry run: memplan's prediction in place of a measurement)"
                          if dry_run else "")),
            "environment": env}


def predicted_step(memplan, run):
    """memplan's step time for a run's configuration (the dry run's stand-in)."""
    s = run["setup"]
    args = ["plan", "--model", run["model"], "--model-class", run["model_class"], "--gpu",
            run["cluster"]["gpu"], "--gpus", "1", "--gpu-margin", "0",
            "--global-batch", str(s["micro_batch"] * s["grad_accum"]),
            "--micro-batch", str(s["micro_batch"]), "--seq-len", str(s["seq_len"]),
            "--precision", s["precision"], "--optimizer", s["optimizer"], "--zero-stage", "0",
            "--offload-optimizer", "none", "--offload-param", "none",
            "--checkpointing", s["checkpointing"], "--format", "json", "--top", "1"]
    args += [] if s["flash_attention"] else ["--no-flash-attention"]
    args += ["--foreach"] if s["foreach"] else ["--no-foreach"]
    args += ["--fused-optimizer"] if s["fused_optimizer"] else []
    args += ["--autocast"] if s["autocast"] else []
    if "sgd_momentum" in s:
        args += ["--sgd-momentum", str(s["sgd_momentum"])]
    if "lora_rank" in s:
        args += ["--lora-rank", str(s["lora_rank"])]
        if "lora_targets" in s:
            args += ["--lora-targets", ",".join(s["lora_targets"])]
    out = subprocess.run([memplan, *args], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"memplan {' '.join(args)}: {out.stderr.strip()}")
    plans = json.loads(out.stdout)["plans"]
    return plans[0]["step_time_s"] if plans else None


def write_json_atomically(doc, target):
    tmp = tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(target)),
                                      delete=False, suffix=".tmp")
    with tmp:
        json.dump(doc, tmp, indent=2)
        tmp.write("\n")
    os.replace(tmp.name, target)


def append_runs(runs, target):
    doc = {"format": RUNS_FORMAT, "runs": []}
    if os.path.exists(target):
        with open(target) as f:
            doc = json.load(f)
        if doc.get("format") != RUNS_FORMAT:
            sys.exit(f"{target}: not a {RUNS_FORMAT} file")
    ids = {r["id"] for r in runs}
    doc["runs"] = [r for r in doc["runs"] if r["id"] not in ids] + runs
    write_json_atomically(doc, target)
    print(f"{len(runs)} run(s) written to {target}")


def measure(plan, steps):
    """Trains the plan on the GPU: (peak figure in bytes, CUDA context in bytes, environment,
    seconds per optimizer step: the median of the steps after the first)."""
    import torch
    import transformers

    torch.ones(1, device="cuda")
    context = used_gpu_bytes(torch)
    config = {k: v for k, v in plan["config"].items() if k != "architectures"}
    cfg = transformers.AutoConfig.for_model(**config)
    cfg._attn_implementation = plan["attention"]
    dtype = torch.bfloat16 if plan["precision"] == "bf16-pure" else torch.float32
    if plan["model_class"] == "base" and config["model_type"] == "bert":
        model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=dtype)
        labels_like_ids = False
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        labels_like_ids = True
    model = model.cuda()
    if plan["checkpointing"]:
        model.gradient_checkpointing_enable()
    if plan["lora_rank"]:
        import peft
        targets = plan["lora_targets"].split(",") if plan["lora_targets"] else None
        model = peft.get_peft_model(model, peft.LoraConfig(r=plan["lora_rank"], lora_alpha=16,
                                                           target_modules=targets))
    params = [p for p in model.parameters() if p.requires_grad]
    if plan["optimizer"] == "sgd":
        opt = torch.optim.SGD(params, lr=1e-4, momentum=plan["sgd_momentum"],
                              foreach=plan["foreach"])
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=None if plan["fused"] else plan["foreach"],
                                fused=plan["fused"] or None)
    autocast = plan["precision"] in ("bf16-mixed", "fp16-mixed")
    amp_dtype = torch.bfloat16 if plan["precision"] == "bf16-mixed" else torch.float16
    vocab = config.get("vocab_size", 32000)
    torch.cuda.reset_peak_memory_stats()
    step_times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(plan["grad_accum"]):
            ids = torch.randint(0, vocab, (plan["micro_batch"], plan["seq_len"]), device="cuda")
            labels = ids if labels_like_ids else torch.zeros(plan["micro_batch"], dtype=torch.long,
                                                             device="cuda")
            with torch.autocast("cuda", dtype=amp_dtype, enabled=autocast):
                loss = model(input_ids=ids, labels=labels).loss / plan["grad_accum"]
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    figure = (torch.cuda.max_memory_allocated() if plan["kind"] == "max_memory_allocated"
              else used_gpu_bytes(torch))
    env = {"gpu": torch.cuda.get_device_name(), "gpu_memory_bytes":
           torch.cuda.get_device_properties(0).total_memory, "torch": torch.__version__,
           "transformers": transformers.__version__}
    step_s = statistics.median(step_times[1:]) if len(step_times) > 1 else step_times[0]
    return figure, context, env, step_s


def measured_record(record, plan, figure_bytes, context_bytes, env, dry_run=False):
    """A record of the same format for a run of `record`'s setup on this machine."""
    out = copy.deepcopy(record)
    gpu_tag = "".join(ch if ch.isalnum() else "-" for ch in env["gpu"].lower()).strip("-")
    out["id"] = f"{record['id']}-{'dry-run' if dry_run else 'measured-' + gpu_tag}"
    out["source"] = (f"bench/measure_peak.py on {env['gpu']}, {datetime.date.today()}, "
                     f"torch {env['torch']}, transformers {env['transformers']}"
                     + (" (dry run: memplan's prediction in place of a measurement)"
                        if dry_run else ""))
    out["hardware"] = {"gpu": env["gpu"], "gpus": 1, "gpu_memory_bytes": env["gpu_memory_bytes"]}
    out["setup"] = f"as {record['id']}, re-run by bench/measure_peak.py (random weights)"
    mib = context_bytes / 2**20
    out["measured"] = {"value": figure_bytes, "units": "bytes", "kind": plan["kind"]}
    if plan["kind"] == "nvidia-smi":
        out["measured"]["context_mib"] = round(mib)
    flags = list(record["memplan"])
    if "--torch-version" in flags:  # the run used this PyTorch, not the published one's
        i = flags.index("--torch-version")
        del flags[i:i + 2]
    if "--cuda-context-mib" in flags:
        flags[flags.index("--cuda-context-mib") + 1] = str(round(mib))
    elif plan["kind"] == "nvidia-smi":
        flags += ["--cuda-context-mib", str(round(mib))]
    out["memplan"] = flags
    out["assumptions"] = [f"re-run of {record['id']} with this machine's PyTorch and CUDA context "
                          f"({round(mib)} MiB measured)"]
    if dry_run:
        out["dry_run"] = True
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--memplan", default=None, help="path to the memplan binary")
    ap.add_argument("--records", default=os.path.join(ROOT, "tests/accuracy/published.json"))
    ap.add_argument("--append", default=None,
                    help="records file to append the measured rows to (default: --records)")
    ap.add_argument("--only", default="", help="comma-separated record ids to run")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", default=None,
                    help="also record step times as memplan.runs/1 runs (memplan calibrate)")
    ap.add_argument("--gpu-preset", default=None,
                    help="the memplan GPU preset of this GPU (default: from its name)")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU, no PyTorch: list what would run, write predicted stand-ins")
    args = ap.parse_args()
    with open(args.records) as f:
        doc = json.load(f)
    only = {s for s in args.only.split(",") if s}
    preset = args.gpu_preset
    if args.runs and preset is None:
        if args.dry_run:
            preset = "a100-80"
        else:
            import torch
            preset = gpu_preset(torch.cuda.get_device_name())
            if preset is None:
                sys.exit(f"no memplan preset for {torch.cuda.get_device_name()}: give --gpu-preset")
    new, runs = [], []
    for record in doc["records"]:
        if (only and record["id"] not in only) or record.get("dry_run"):
            continue
        plan, why = runnable(record)
        if plan is None:
            print(f"{record['id']:38} not runnable: {why}")
            continue
        if args.dry_run:
            context = int(float(dict(zip(record["memplan"], record["memplan"][1:]))
                                .get("--cuda-context-mib", "0")) * 2**20)
            env = {"gpu": "dry-run", "gpu_memory_bytes": record["hardware"]["gpu_memory_bytes"],
                   "torch": "-", "transformers": "-"}
            out = measured_record(record, plan, 0, context, env, dry_run=True)
            p = predict(find_memplan(args.memplan), out["memplan"])  # the flags as re-run
            out["measured"]["value"] = (p["allocated_bytes"] if plan["kind"] == "max_memory_allocated"
                                        else p["gpu_bytes"])
            new.append(out)
            if args.runs:
                run = run_record(record, plan, 0, env, preset, dry_run=True)
                run["step_time_s"] = predicted_step(find_memplan(args.memplan), run)
                if run["step_time_s"]:
                    runs.append(run)
                else:
                    print(f"{record['id']:38} no step time: it does not fit a {preset}")
            print(f"{record['id']:38} would run: {plan['config']['model_type']} {plan['precision']} "
                  f"batch {plan['micro_batch']} x {plan['seq_len']}, {plan['attention']}, "
                  f"{plan['optimizer']}; measures {plan['kind']}")
            continue
        figure, context, env, step_s = measure(plan, args.steps)
        new.append(measured_record(record, plan, figure, context, env))
        if args.runs:
            runs.append(run_record(record, plan, step_s, env, preset))
        print(f"{record['id']:38} measured {figure / 2**30:.2f} GiB, {step_s:.3f} s/step on "
              f"{env['gpu']}")
    target = args.append or args.records
    if new and (args.append or not args.dry_run):
        if os.path.exists(target):
            with open(target) as f:
                out_doc = json.load(f)
        else:
            out_doc = {"version": doc.get("version", 1), "about": doc.get("about", ""),
                       "records": []}
        ids = {r["id"] for r in new}
        out_doc["records"] = [r for r in out_doc["records"] if r["id"] not in ids] + new
        write_json_atomically(out_doc, target)
        print(f"{len(new)} record(s) written to {target}")
    if runs:
        append_runs(runs, args.runs)


if __name__ == "__main__":
    main()
