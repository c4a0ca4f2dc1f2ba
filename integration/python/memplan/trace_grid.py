"""The traced grid: memplan.trace run over a fixed list of training setups, checked in as data
(tests/accuracy/trace_grid.json, and the held-out fifth in trace_grid_holdout.json) for the
estimator's test to be held to.

    python -m memplan.trace grid                     # regenerate both files (resumable)
    python -m memplan.trace grid --list              # the points, one id a line
    python -m memplan.trace grid --check tests/accuracy/trace_grid.json --sample
                                                     # re-trace the CI sample, compare exactly

The list of points is code (``points()``), in a fixed order; each point's trace is written to
the work directory as it finishes (``--work``, default build/trace-grid-work), so an interrupted
run continues where it stopped. The held-out fifth is chosen per point by ``held_out``: the
first 8 bytes of sha256("29:" + id) below a fifth of 2^64, so adding points never moves others.
Both files carry the same header (format, versions, the hold-out rule and the held-out ids, the
CI sample).
"""

import argparse
import hashlib
import json
import os
import sys
import time

GRID_FORMAT = "memplan-trace-grid/1"
HOLDOUT_SEED = 29
HOLDOUT_FRACTION = 0.2
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                     ".."))

# Where each model's config.json lives, relative to the repository (the estimator reads the
# same file).
MODEL_DIRS = ("estimator/models", "tests/oracle/modern_configs", "tests/accuracy/trace_models")


def model_path(name):
    root = os.environ.get("MEMPLAN_SOURCE_DIR", ROOT)
    for d in MODEL_DIRS:
        if os.path.isfile(os.path.join(root, d, name + ".json")):
            return d + "/" + name + ".json"
    raise KeyError("no config for %s under %s" % (name, ", ".join(MODEL_DIRS)))


def _point(framework, model, layers, b, s, precision="bf16-mixed", checkpointing="none",
           every=1, loss="full", optimizer="adamw", lora=0, qlora=False, attention="sdpa",
           gpu="a100", targets=None, chunks=8, saved=False, ranks=1):
    setup = {"framework": framework, "model": model, "layers": layers, "micro_batch": b,
             "seq_len": s, "precision": precision, "checkpointing": checkpointing,
             "checkpoint_every": every, "loss": loss, "loss_chunks": chunks,
             "optimizer": optimizer, "lora_rank": lora, "qlora": qlora, "attention": attention,
             "gpu": gpu, "lora_targets": targets, "ranks": ranks}
    parts = [framework, model, "L%d" % layers, "b%ds%d" % (b, s), precision, attention,
             "ckpt-%s%s" % (checkpointing, "-every%d" % every if every > 1 else ""),
             "loss-%s%s" % (loss, chunks if loss == "chunked" else ""), optimizer, gpu]
    if lora:
        parts.append("%slora%d%s" % ("q" if qlora else "", lora,
                                     "-" + "+".join(targets) if targets else ""))
    if ranks > 1:
        parts.append("fsdp%d" % ranks)
    return {"id": "/".join(parts), "setup": setup, "saved_tensors": saved}


# Decoder families Transformers builds (one real-shaped config each), the encoders and T5.
HF_DECODERS = ["llama-3.2-1b", "llama-3.1-8b", "mistral-7b", "qwen2.5-0.5b", "qwen2.5-7b",
               "qwen3-0.6b", "gemma-2b", "gemma-2-2b", "gemma-3-1b", "phi-3-mini", "gpt2",
               "pythia-160m", "smollm2-135m", "opt-125m", "falcon-rw-1b", "phi-2",
               "starcoder2-3b", "olmo-2-1124-7b", "bloom-560m", "gpt-j-6b", "mixtral-8x7b",
               "qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b", "qwen1.5-moe-a2.7b",
               "olmo3-7b-like", "ministral-8b-like", "smollm3-3b-like", "seed-oss-36b-like",
               "granite-3-8b-like", "olmoe-1b-7b", "hunyuan-7b-like", "glm-4-9b", "glm-4-32b-0414",
               "moonlight-16b-a3b", "starcoderbase-1b", "stablelm-2-1_6b", "stablelm-2-12b",
               "olmo-1b-hf", "olmo-7b-0424-hf", "aya-23-8b", "command-r-plus",
               "command-r7b", "minitron-8b", "exaone-4.0-32b-like", "gpt-neo-1.3b",
               "granite-3.0-1b-a400m", "afm-4.5b-like", "ernie-4.5-0.3b",
               "glm-4.5-air-like", "helium-2b-like"]
EAGER_ONLY = ("gemma-2-2b", "bloom-560m", "gpt-j-6b", "gpt-oss-20b", "gpt-neo-1.3b")
# LoRA targets named where PEFT's defaults do not reach these models (fused experts, MLA, gpt-oss,
# families PEFT has no defaults for): the attention's query and value (MLA's decompressed keys and
# values).
LORA_TARGETS = {"mixtral-8x7b": ["q_proj", "v_proj"], "deepseek-v2-lite": ["q_proj", "kv_b_proj"],
                "gpt-oss-20b": ["q_proj", "v_proj"], "olmo3-7b-like": ["q_proj", "v_proj"],
                "ministral-8b-like": ["q_proj", "v_proj"], "smollm3-3b-like": ["q_proj", "v_proj"],
                "seed-oss-36b-like": ["q_proj", "v_proj"], "granite-3-8b-like": ["q_proj", "v_proj"],
                "olmoe-1b-7b": ["q_proj", "v_proj"], "hunyuan-7b-like": ["q_proj", "v_proj"],
                "glm-4-9b": ["q_proj", "v_proj"], "glm-4-32b-0414": ["q_proj", "v_proj"],
                "moonlight-16b-a3b": ["q_proj", "kv_b_proj"], "aya-23-8b": ["q_proj", "v_proj"],
                "command-r-plus": ["q_proj", "v_proj"], "command-r7b": ["q_proj", "v_proj"],
                "minitron-8b": ["q_proj", "v_proj"], "exaone-4.0-32b-like": ["q_proj", "v_proj"],
                "granite-3.0-1b-a400m": ["q_proj", "v_proj"], "afm-4.5b-like": ["q_proj", "v_proj"],
                "ernie-4.5-0.3b": ["q_proj", "v_proj"], "glm-4.5-air-like": ["q_proj", "v_proj"],
                "helium-2b-like": ["q_proj", "v_proj"]}
HF_ENCODERS = ["bert-base-uncased", "bert-large-uncased", "roberta-base", "xlm-roberta-base",
               "distilbert-base-uncased", "t5-v1_1-base", "t5-large"]


def points():
    """Every grid point, in a fixed order."""
    out = []
    tf = "transformers"
    for m in HF_DECODERS:
        # Gemma-2, BLOOM, GPT-J and gpt-oss have no SDPA path in Transformers 5: eager is what
        # they run.
        attn = "eager" if m in EAGER_ONLY else "sdpa"
        out.append(_point(tf, m, 2, 1, 1024, saved=True, attention=attn))
        out.append(_point(tf, m, 2, 1, 1024, checkpointing="full", attention=attn))
        out.append(_point(tf, m, 2, 2, 512, precision="bf16", attention=attn))
        out.append(_point(tf, m, 2, 1, 512, precision="fp32", attention="eager"))
        out.append(_point(tf, m, 2, 2, 1024, checkpointing="full", lora=16, attention=attn,
                          targets=LORA_TARGETS.get(m)))
    for m in HF_ENCODERS:
        out.append(_point(tf, m, 2, 4, 512, saved=True))
        out.append(_point(tf, m, 2, 4, 512, checkpointing="full"))
        out.append(_point(tf, m, 2, 2, 512, precision="fp32"))
        out.append(_point(tf, m, 2, 8, 256, precision="fp16-mixed"))
    for m in ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b"):
        for b, s in ((1, 512), (2, 2048), (4, 1024), (1, 4096), (8, 256)):
            for ck in ("none", "full"):
                out.append(_point(tf, m, 2, b, s, checkpointing=ck))
    # Decoder classifiers (Note [Decoder classifiers in the step model]): a reward model (one
    # label, a regression), a two-label sequence classifier and a token classifier.
    for m in ("llama-3.1-8b-reward", "qwen2.5-0.5b-sst2", "llama-3.2-1b-ner"):
        out.append(_point(tf, m, 2, 2, 1024))
        out.append(_point(tf, m, 2, 2, 1024, checkpointing="full"))
        out.append(_point(tf, m, 2, 4, 512, precision="bf16"))
        out.append(_point(tf, m, 2, 4, 1024, checkpointing="full", lora=16,
                          targets=["q_proj", "v_proj"]))
        out.append(_point(tf, m, 2, 8, 512, lora=16, targets=["q_proj", "v_proj"]))
    # The encoders' classifiers (Note [Encoder classifiers in the step model]): BERT's token
    # classifier, DistilBERT's and RoBERTa's sequence classifiers; and LoRA without checkpointing,
    # where the frozen embeddings' dropout keeps no mask.
    for m in ("bert-base-ner", "distilbert-sst2", "roberta-large-mnli"):
        out.append(_point(tf, m, 2, 8, 512))
        out.append(_point(tf, m, 2, 8, 512, checkpointing="full"))
        out.append(_point(tf, m, 2, 16, 256, precision="fp32"))
        out.append(_point(tf, m, 2, 8, 512, precision="fp16-mixed", lora=16,
                          targets=["q_lin", "v_lin"] if m == "distilbert-sst2" else None))
    out.append(_point(tf, "bert-base-uncased", 2, 8, 512, lora=16))
    # LoRA with checkpointing on the encoders: the frozen word embedding's output outlives the
    # embeddings module (Note [The frozen embedding's leaf] in estimator/step_blocks.cc).
    for m, t in (("bert-base-uncased", None), ("roberta-base", None),
                 ("distilbert-base-uncased", ["q_lin", "v_lin"])):
        out.append(_point(tf, m, 2, 4, 512, checkpointing="full", lora=16, targets=t))
    for m in ("llama-3.2-1b", "gpt2", "qwen3-0.6b"):
        out.append(_point(tf, m, 4, 2, 1024, checkpointing="full", every=2))
        out.append(_point(tf, m, 6, 1, 1024, checkpointing="full", every=3))
    for opt in ("sgd", "sgd-momentum", "adamw-fused", "adamw-forloop"):
        out.append(_point(tf, "llama-3.2-1b", 2, 1, 1024, optimizer=opt))
        out.append(_point(tf, "gpt2", 2, 4, 512, optimizer=opt, precision="fp32"))
    for gpu in ("h100", "v100", "rtx4090"):
        out.append(_point(tf, "llama-3.1-8b", 2, 1, 2048, gpu=gpu))
        out.append(_point(tf, "gpt2", 2, 4, 1024, gpu=gpu, precision="fp16-mixed"))
    # SmolLM3's fourth layer applies no rotary embedding (its NoPE layers).
    out.append(_point(tf, "smollm3-3b-like", 4, 1, 1024))
    out.append(_point(tf, "smollm3-3b-like", 4, 2, 1024, checkpointing="full"))
    # Command R7B's fourth layer is full attention without rotary embeddings; from 4096 tokens the
    # three sliding layers take a window mask.
    out.append(_point(tf, "command-r7b", 4, 1, 1024))
    out.append(_point(tf, "command-r7b", 4, 1, 4608, checkpointing="full"))
    # EXAONE 4.0 likewise: its global fourth layer has no rotary embedding.
    out.append(_point(tf, "exaone-4.0-32b-like", 4, 1, 1024))
    out.append(_point(tf, "exaone-4.0-32b-like", 4, 1, 4608, checkpointing="full", precision="bf16"))
    # DeepSeek-V3's first three layers are dense: four reach its router (256 experts in 8
    # groups) and the query's q_lora_rank bottleneck, which Moonlight does not have.
    out.append(_point(tf, "deepseek-v3", 4, 1, 512))
    out.append(_point(tf, "deepseek-v3", 4, 2, 256, precision="bf16", checkpointing="full"))
    out.append(_point(tf, "deepseek-v3", 4, 1, 512, checkpointing="full", lora=16,
                      targets=["q_b_proj", "kv_b_proj"]))
    out.append(_point(tf, "smollm2-135m", 30, 4, 1024))
    out.append(_point(tf, "smollm2-135m", 30, 4, 1024, checkpointing="full"))
    out.append(_point(tf, "llama-3.2-1b", 16, 1, 2048, checkpointing="full"))
    out.append(_point(tf, "gpt2", 12, 4, 1024, precision="fp32"))
    for m in ("llama-3.1-8b", "mistral-7b", "qwen2.5-7b"):
        for r, t in ((8, None), (64, None), (16, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"])):
            out.append(_point(tf, m, 2, 1, 2048, checkpointing="full", lora=r, targets=t))
        out.append(_point(tf, m, 2, 2, 2048, lora=16))
    for m in ("llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "gemma-2b", "phi-3-mini"):
        for b, s in ((4, 512), (1, 8192)):
            out.append(_point(tf, m, 2, b, s, checkpointing="full", precision="bf16"))
    for m in ("gpt2", "pythia-160m", "opt-125m", "bert-base-uncased", "t5-v1_1-base"):
        out.append(_point(tf, m, 2, 16, 512, checkpointing="full"))
        out.append(_point(tf, m, 2, 2, 128, attention="eager"))
    # torchtune's recipes: full fine-tuning, LoRA and QLoRA in bf16, chunked CE, AC on/off.
    tt = "torchtune"
    for m in ("llama-3.2-1b", "llama-3.1-8b", "llama-2-7b", "qwen2.5-0.5b"):
        for kind in ("full", "lora", "qlora"):
            for ck in ("full", "none"):
                out.append(_point(tt, m, 2, 2, 2048, precision="bf16", checkpointing=ck,
                                  loss="chunked", optimizer="adamw-fused",
                                  lora=8 if kind != "full" else 0, qlora=kind == "qlora",
                                  saved=(kind == "lora" and ck == "none")))
        out.append(_point(tt, m, 2, 2, 2048, precision="bf16", checkpointing="full",
                          loss="full", optimizer="adamw-fused", lora=8))
    for m in ("llama-3.2-1b", "qwen2.5-0.5b"):
        for b, s in ((1, 4096), (8, 1024)):
            out.append(_point(tt, m, 2, b, s, precision="bf16", checkpointing="full",
                              loss="chunked", optimizer="adamw-fused"))
    for b, s in ((1, 4096), (4, 1024), (2, 8192)):
        out.append(_point(tt, "llama-3.1-8b", 2, b, s, precision="bf16", checkpointing="full",
                          loss="chunked", optimizer="adamw-fused", lora=8, qlora=True))
        out.append(_point(tt, "llama-3.1-8b", 2, b, s, precision="bf16", checkpointing="full",
                          loss="chunked", optimizer="adamw-fused", lora=8))
    out.append(_point(tt, "llama-3.1-8b", 2, 2, 2048, precision="bf16", checkpointing="full",
                      loss="chunked", chunks=16, optimizer="adamw-fused", lora=8))
    out.append(_point(tt, "llama-3.1-8b", 2, 2, 2048, precision="fp32", checkpointing="full",
                      loss="chunked", optimizer="adamw", lora=8))
    # LitGPT's fit step.
    lg = "litgpt"
    for m in ("llama-2-7b", "llama-3.1-8b", "pythia-160m"):
        for kind in ("lora", "full"):
            for precision in ("bf16", "bf16-mixed"):
                for loss in ("chunked", "full"):
                    out.append(_point(lg, m, 2, 1, 1024, precision=precision, loss=loss,
                                      lora=8 if kind == "lora" else 0,
                                      saved=(kind == "lora" and precision == "bf16" and
                                             loss == "chunked")))
    for b, s in ((2, 512), (4, 2048), (1, 4096)):
        out.append(_point(lg, "llama-2-7b", 2, b, s, precision="bf16", loss="chunked",
                          lora=8))
        out.append(_point(lg, "llama-3.1-8b", 2, b, s, precision="bf16", loss="chunked",
                          lora=16, targets=["query", "key", "value", "projection", "mlp"]))
    # llm-foundry's MPT.
    lf = "llm-foundry"
    for m in ("mpt-1b", "mpt-7b"):
        for ck in ("none", "full"):
            for precision in ("bf16-mixed", "bf16", "fp32"):
                out.append(_point(lf, m, 2, 2, 1024, precision=precision, checkpointing=ck,
                                  saved=(ck == "none" and precision == "bf16-mixed")))
        for b, s in ((1, 2048), (4, 512), (8, 2048)):
            out.append(_point(lf, m, 2, b, s, checkpointing="full"))
    # torchtitan's trainer: FSDP2 (on one rank too), its checkpointing policies and losses. The
    # step model does not run torchtitan yet: these points are counted as refused.
    ttn = "torchtitan"
    for m in ("llama-3.2-1b", "llama-3.1-8b"):
        for ck in ("none", "full", "op"):
            out.append(_point(ttn, m, 2, 1, 2048, checkpointing=ck, loss="chunked",
                              optimizer="adamw-fused"))
        out.append(_point(ttn, m, 2, 1, 2048, checkpointing="op", loss="full",
                          optimizer="adamw-fused"))
        for ranks in (2, 8):
            out.append(_point(ttn, m, 2, 2, 2048, checkpointing="op", loss="chunked",
                              optimizer="adamw-fused", ranks=ranks))
    out.append(_point(ttn, "llama-3.1-8b", 4, 2, 4096, checkpointing="full", loss="chunked",
                      optimizer="adamw-fused", ranks=8))
    out.append(_point(ttn, "llama-3.1-8b", 2, 1, 8192, checkpointing="op", loss="chunked",
                      optimizer="adamw-fused", ranks=8, gpu="h100"))
    out.append(_point(ttn, "llama-3.2-1b", 2, 4, 1024, precision="fp32", checkpointing="op",
                      loss="chunked", optimizer="adamw-fused", ranks=4))
    out.append(_point(ttn, "llama-2-7b", 2, 2, 2048, checkpointing="op", loss="chunked",
                      optimizer="adamw-fused", ranks=8))
    out.append(_point(ttn, "llama-2-7b", 2, 2, 2048, checkpointing="none", loss="full",
                      ranks=2))
    seen = set()
    unique = []
    for p in out:
        if p["id"] not in seen:
            seen.add(p["id"])
            unique.append(p)
    return unique


# A few points of each framework, small enough to re-trace in CI in about two minutes.
CI_SAMPLE = [
    "transformers/llama-3.2-1b/L2/b1s1024/bf16-mixed/sdpa/ckpt-none/loss-full/adamw/a100",
    "transformers/llama-3.2-1b/L2/b1s1024/bf16-mixed/sdpa/ckpt-full/loss-full/adamw/a100",
    "transformers/gpt2/L2/b4s512/fp32/sdpa/ckpt-none/loss-full/sgd/a100",
    "transformers/bert-base-uncased/L2/b4s512/bf16-mixed/sdpa/ckpt-none/loss-full/adamw/a100",
    "transformers/qwen2.5-0.5b/L2/b2s1024/bf16-mixed/sdpa/ckpt-full/loss-full/adamw/a100/lora16",
    "torchtune/qwen2.5-0.5b/L2/b2s2048/bf16/sdpa/ckpt-full/loss-chunked8/adamw-fused/a100/"
    "qlora8",
    "torchtune/llama-3.2-1b/L2/b2s2048/bf16/sdpa/ckpt-none/loss-chunked8/adamw-fused/a100/"
    "lora8",
    "litgpt/pythia-160m/L2/b1s1024/bf16/sdpa/ckpt-none/loss-chunked8/adamw/a100/lora8",
    "llm-foundry/mpt-1b/L2/b2s1024/bf16-mixed/sdpa/ckpt-full/loss-full/adamw/a100",
    "torchtitan/llama-3.2-1b/L2/b2s2048/bf16-mixed/sdpa/ckpt-op/loss-chunked8/adamw-fused/a100/"
    "fsdp2",
]


def held_out(point_id):
    """Whether a point is in the held-out fifth: the first 8 bytes of sha256("29:" + id), as a
    big-endian integer, are below a fifth of 2^64. Each point's lot is its own, so points added
    to the grid later never move the others between the two files."""
    digest = hashlib.sha256(("%d:%s" % (HOLDOUT_SEED, point_id)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < int(HOLDOUT_FRACTION * 2**64)


def holdout_ids(ids):
    """The held-out points of ``ids`` (held_out)."""
    return {i for i in ids if held_out(i)}


def trace_point(point):
    """The record of one point: its setup as given plus the trace's figures."""
    from . import trace
    setup = dict(point["setup"])
    path = model_path(setup["model"])
    setup_for_run = dict(setup, model=os.path.join(os.environ.get("MEMPLAN_SOURCE_DIR", ROOT),
                                                    path))
    result = trace.run(setup_for_run, saved_tensors=point.get("saved_tensors", False))
    setup_out = dict(result["setup"])
    setup_out["model"] = setup["model"]
    record = {"id": point["id"], "setup": setup_out, "model_config": path,
              "model": result["model"], "gpu_arch": result["gpu_arch"],
              "sdpa_backends": result["sdpa_backends"], "peak": result["peak"],
              "phases": result["phases"], "step_start": result["step_start"],
              "workspaces": result["workspaces"]}
    if "saved_tensors" in result:
        record["saved_tensors"] = result["saved_tensors"]
    return record, result["versions"], result["trace_seconds"]


def figures(record):
    """What must not change when the grid is re-traced (the CI check compares these)."""
    # Not the peaks' modules: where two blocks' modules are current at the peak, the data made
    # before the tracer broke that tie by name picked one in hash order.
    def located(d):
        return {k: v for k, v in d.items() if k != "module"} if isinstance(d, dict) else d
    peak = located(record["peak"])
    phases = {name: located(phase) for name, phase in record["phases"].items()}
    return {"peak": peak, "phases": phases,
            "step_start": record["step_start"], "workspaces": record["workspaces"],
            "sdpa_backends": record["sdpa_backends"]}


def _work_file(work, point_id):
    return os.path.join(work, hashlib.sha1(point_id.encode()).hexdigest()[:16] + ".json")


def generate(work, out, holdout_out, only=None, stop_on_error=False, timeout=600):
    from . import trace
    os.makedirs(work, exist_ok=True)
    grid = points()
    selected = [p for p in grid if not only or any(o in p["id"] for o in only)]
    failures = []
    versions = {}
    started = time.time()
    for index, point in enumerate(selected, 1):
        path = _work_file(work, point["id"])
        if os.path.isfile(path):
            with open(path, "r", encoding="utf-8") as f:
                saved = json.load(f)
            if saved.get("id") == point["id"] and saved.get("setup_in") == point["setup"]:
                versions.update(saved.get("versions", {}))
                continue
        t0 = time.time()
        import signal

        def timed_out(signum, frame):
            raise TimeoutError("no trace after %d s" % timeout)
        previous = signal.signal(signal.SIGALRM, timed_out)
        signal.alarm(timeout)
        try:
            record, v, seconds = trace_point(point)
        except Exception as error:  # noqa: BLE001 - reported, the run goes on
            failures.append((point["id"], "%s: %s" % (type(error).__name__, error)))
            sys.stderr.write("[%d/%d] FAILED %s: %s\n" % (index, len(selected), point["id"],
                                                          str(error).splitlines()[0][:200]
                                                          if str(error) else type(error)))
            if stop_on_error:
                raise
            continue
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        versions.update(v)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"id": point["id"], "setup_in": point["setup"], "versions": v,
                       "record": record}, f)
        os.replace(path + ".tmp", path)
        sys.stderr.write("[%d/%d] %.1f s  peak %.3f GiB  %s\n" % (
            index, len(selected), time.time() - t0, record["peak"]["bytes"] / 2**30,
            point["id"]))
    if only:
        sys.stderr.write("--only: traced %d points into %s; the grid files are written by a "
                         "run without --only\n" % (len(selected), work))
        return failures
    records = []
    for point in grid:
        path = _work_file(work, point["id"])
        if not os.path.isfile(path):
            continue
        with open(path, "r", encoding="utf-8") as f:
            saved = json.load(f)
        versions.update(saved.get("versions", {}))
        records.append(saved["record"])
    held = holdout_ids([r["id"] for r in records])
    header = {
        "format": GRID_FORMAT,
        "generated_by": "python -m memplan.trace grid (memplan/trace_grid.py)",
        "versions": dict(sorted(versions.items())),
        "points": len(records),
        "holdout": {"seed": HOLDOUT_SEED, "fraction": HOLDOUT_FRACTION,
                    "rule": "sha256(\"<seed>:<id>\")[:8] as a big-endian integer < "
                            "fraction * 2^64",
                    "file": os.path.basename(holdout_out), "count": len(held),
                    "ids": sorted(held)},
        "ci_sample": CI_SAMPLE,
        "units": "bytes allocated, as the CUDA caching allocator counts them "
                 "(torch.cuda.max_memory_allocated); docs/trace.md",
    }
    kept = [r for r in records if r["id"] not in held]
    out_held = [r for r in records if r["id"] in held]
    from .trace import write_atomic
    write_atomic(out, json.dumps(dict(header, part="development", records=kept), indent=1) +
                 "\n")
    write_atomic(holdout_out, json.dumps(dict(header, part="holdout", records=out_held),
                                         indent=1) + "\n")
    sys.stderr.write("grid: %d points (%d kept in %s, %d held out in %s), %d failed, %.0f s\n"
                     % (len(records), len(kept), out, len(out_held), holdout_out,
                        len(failures), time.time() - started))
    for pid, error in failures:
        sys.stderr.write("  failed: %s: %s\n" % (pid, error.splitlines()[0][:300]))
    del trace
    return failures


def check(path, ids=None, sample=False):
    """Re-trace records of a grid file and compare their figures exactly; returns the ids
    missing, the mismatches and how many points were asked for."""
    with open(path, "r", encoding="utf-8") as f:
        grid = json.load(f)
    if grid.get("format") != GRID_FORMAT:
        raise ValueError("%s: format %r, expected %s" % (path, grid.get("format"), GRID_FORMAT))
    wanted = set(grid["ci_sample"]) if sample else set(ids or [])
    by_id = {r["id"]: r for r in grid["records"]}
    if sample:
        # Both files carry the same header: a sample point held out lives in the other file.
        held = set(grid.get("holdout", {}).get("ids", []))
        in_holdout = grid.get("part") == "holdout"
        elsewhere = sorted(i for i in wanted if i not in by_id and (i in held) != in_holdout)
        for pid in elsewhere:
            sys.stderr.write("elsewhere %s (in the %s file)\n"
                             % (pid, "development" if in_holdout else "held-out"))
        wanted -= set(elsewhere)
    missing = sorted(i for i in wanted if i not in by_id)
    mismatches = []
    by_point = {p["id"]: p for p in points()}
    for pid in sorted(wanted):
        if pid not in by_id:
            continue
        point = by_point.get(pid)
        if point is None:
            mismatches.append((pid, "not a point of memplan.trace_grid.points() any more"))
            continue
        t0 = time.time()
        record, _, _ = trace_point(dict(point, saved_tensors=False))
        old, new = figures(by_id[pid]), figures(record)
        status = "ok" if old == new else "DIFFERS"
        sys.stderr.write("%-8s %.1f s  %s\n" % (status, time.time() - t0, pid))
        if old != new:
            mismatches.append((pid, _first_difference(old, new)))
    return missing, mismatches, len(wanted)


def _first_difference(old, new, prefix=""):
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _first_difference(old.get(key), new.get(key), prefix + "." + str(key))
    return "%s: checked in %r, traced %r" % (prefix.lstrip("."), old, new)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m memplan.trace grid",
        description="Regenerate the traced grid (tests/accuracy/trace_grid.json and the "
                    "held-out fifth, trace_grid_holdout.json), resumably, or re-trace part of "
                    "it and compare (--check). Progress goes to stderr.")
    parser.add_argument("--out", default=os.path.join(ROOT, "tests", "accuracy",
                                                      "trace_grid.json"))
    parser.add_argument("--holdout-out", default=os.path.join(ROOT, "tests", "accuracy",
                                                              "trace_grid_holdout.json"))
    parser.add_argument("--work", default=os.path.join(ROOT, "build", "trace-grid-work"),
                        help="one finished trace per file; a rerun skips them (default "
                             "build/trace-grid-work)")
    parser.add_argument("--only", action="append",
                        help="trace only the points whose id contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the point ids and stop")
    parser.add_argument("--check", metavar="GRID_JSON",
                        help="re-trace records of this file and compare their figures")
    parser.add_argument("--sample", action="store_true",
                        help="with --check: the file's ci_sample points")
    parser.add_argument("--id", action="append", help="with --check: this point (repeatable)")
    parser.add_argument("--stop-on-error", action="store_true")
    parser.add_argument("--timeout", type=int, default=600,
                        help="seconds one point may take before it is reported failed")
    args = parser.parse_args(argv)
    if args.list:
        for p in points():
            print(p["id"])
        return 0
    if args.check:
        missing, mismatches, count = check(args.check, ids=args.id, sample=args.sample)
        for pid in missing:
            sys.stderr.write("missing from %s: %s\n" % (args.check, pid))
        for pid, why in mismatches:
            sys.stderr.write("mismatch %s: %s\n" % (pid, why))
        failed = len(mismatches) + len(missing)
        print("%d passed, %d failed" % (count - failed, failed))
        return 1 if (missing or mismatches) else 0
    failures = generate(args.work, args.out, args.holdout_out, only=args.only,
                        stop_on_error=args.stop_on_error, timeout=args.timeout)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
