"""memplan.trace for torchtune, torchtitan, LitGPT and llm-foundry: each framework's own model
builder, loss, checkpointing and optimizer, run the way its recipe or trainer runs a step. The
model comes from a Hugging Face config.json (the dimensions are mapped onto the framework's
builder, as its checkpoint converters map them); each adapter says which recipe it follows."""

import contextlib
import sys
import types

from .trace import Target, TraceError, load_config


def adapter(name):
    table = {"torchtune": Torchtune, "torchtitan": Torchtitan, "litgpt": LitGPT,
             "llm-foundry": LLMFoundry}
    return table[name]()


def _llama_dims(setup):
    """The Llama-family dimensions of a config.json (llama, mistral, qwen2 share them)."""
    name, raw = load_config(setup.model)
    model_type = raw.get("model_type")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise TraceError("model: %s builds Llama-family models (llama, mistral, qwen2); %s is "
                         "%r" % (setup.framework, name, model_type))
    layers = setup.layers or raw["num_hidden_layers"]
    heads = raw["num_attention_heads"]
    dims = {
        "name": name, "model_type": model_type, "vocab_size": raw["vocab_size"],
        "num_layers": layers, "layers_in_config": raw["num_hidden_layers"],
        "num_heads": heads, "num_kv_heads": raw.get("num_key_value_heads") or heads,
        "embed_dim": raw["hidden_size"], "intermediate_dim": raw["intermediate_size"],
        "max_seq_len": raw.get("max_position_embeddings", 4096),
        "norm_eps": raw.get("rms_norm_eps", 1e-5), "rope_base": raw.get("rope_theta", 10000.0),
        "rope_scaling": raw.get("rope_scaling"), "tie": bool(raw.get("tie_word_embeddings")),
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
        "attention_bias": bool(raw.get("attention_bias", model_type == "qwen2")),
    }
    if setup.dropout:
        dims["attn_dropout"] = float(setup.dropout)
    return dims


@contextlib.contextmanager
def real_rope_init(fake_mode, package):
    """Rotary caches built from real numbers: torchtune's Llama3ScaledRoPE (and its kin) loop
    over the frequencies in Python while building the cache, which a fake tensor cannot do. Every
    ``rope_init`` of ``package`` runs outside fake mode on small real tensors, and its buffers are
    then made fake (same shapes and dtypes; the cache is a buffer either way)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    patched = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(package + ".") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.nn.Module) and \
                    "rope_init" in vars(value) and value not in [c for c, _ in patched]:
                patched.append((value, vars(value)["rope_init"]))

    def wrap(original):
        def rope_init(self):
            with unset_fake_temporarily():
                original(self)
            for key, buf in list(self._buffers.items()):
                if buf is not None and not isinstance(buf, torch._subclasses.FakeTensor):
                    self._buffers[key] = fake_mode.from_tensor(buf)
        return rope_init

    for cls, original in patched:
        cls.rope_init = wrap(original)
    try:
        yield
    finally:
        for cls, original in patched:
            cls.rope_init = original


def _dtype(setup):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)


def _count(model, info):
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel()
        total += n
        if p.requires_grad:
            trainable += n
    info["params"] = total
    info["trainable_params"] = trainable


# ---- torchtune 0.6 -------------------------------------------------------------------------------

class Torchtune:
    """torchtune's recipes (recipes/lora_finetune_single_device.py, full_finetune_single_device.py
    _loss_step): the model from torchtune.models' component builders in the recipe's dtype (bf16
    by default: weights, gradients and optimizer states all in bf16), LoRA/QLoRA adapters
    (lora_attn_modules, apply_lora_to_mlp; QLoRA: torchao NF4 base weights), activation
    checkpointing of every TransformerSelfAttentionLayer (training.set_activation_checkpointing),
    logits in ``loss_chunks`` chunks for CEWithChunkedOutputLoss (set_num_output_chunks) or one
    tensor for nn.CrossEntropyLoss, labels shifted with an ignore column, ``del logits`` before
    backward, optimizer over model.parameters()."""

    def build(self, setup, fake_mode, listing=False):
        import torch
        from torchtune import modules, training
        from torchtune.modules.peft import get_adapter_params, set_trainable_params
        from . import trace_cuda
        d = _llama_dims(setup)
        if setup.checkpointing not in ("none", "full") or setup.checkpoint_every != 1:
            raise TraceError("checkpointing: torchtune's recipes checkpoint every "
                             "TransformerSelfAttentionLayer (none or full)")
        if setup.precision.endswith("-mixed"):
            raise TraceError("precision: torchtune recipes train in one dtype (bf16, fp32)")
        if setup.attention != "sdpa":
            raise TraceError("attention: torchtune uses SDPA")
        builder, lora_builder, extra = self._builders(d)
        common = dict(vocab_size=d["vocab_size"], num_layers=d["num_layers"],
                      num_heads=d["num_heads"], num_kv_heads=d["num_kv_heads"],
                      embed_dim=d["embed_dim"], intermediate_dim=d["intermediate_dim"],
                      max_seq_len=d["max_seq_len"], norm_eps=d["norm_eps"],
                      rope_base=int(d["rope_base"]), attn_dropout=d.get("attn_dropout", 0.0),
                      **extra)
        info = {"name": d["name"], "model_type": d["model_type"], "layers": d["num_layers"],
                "layers_in_config": d["layers_in_config"], "builder": builder.__module__ + "." +
                builder.__name__}
        with training.set_default_dtype(_dtype(setup)), real_rope_init(fake_mode, "torchtune"):
            if setup.lora_rank:
                targets = setup.lora_targets or ["q_proj", "v_proj", "output_proj", "mlp"]
                attn = [t for t in targets if t in ("q_proj", "k_proj", "v_proj", "output_proj")]
                unknown = set(targets) - set(attn) - {"mlp", "output"}
                if unknown:
                    raise TraceError("lora_targets: torchtune adapts q_proj, k_proj, v_proj, "
                                     "output_proj, mlp, output; not %s" % ", ".join(sorted(
                                         unknown)))
                model = lora_builder(
                    lora_attn_modules=attn, apply_lora_to_mlp="mlp" in targets,
                    apply_lora_to_output="output" in targets, lora_rank=setup.lora_rank,
                    lora_alpha=setup.lora_alpha or 2 * setup.lora_rank, lora_dropout=0.0,
                    quantize_base=bool(setup.qlora), **common)
                set_trainable_params(model, get_adapter_params(model))
                info["lora_targets"] = sorted(targets)
            else:
                model = builder(**common)
        if setup.checkpointing == "full" and not listing:
            training.set_activation_checkpointing(
                model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        model.train()
        _count(model, info)
        if setup.loss == "chunked":
            from torchtune.modules.loss import CEWithChunkedOutputLoss
            loss_fn = CEWithChunkedOutputLoss(num_output_chunks=setup.loss_chunks)
            model.set_num_output_chunks(loss_fn.num_output_chunks)
        elif setup.loss == "full":
            loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100)
        else:
            from . import trace_liger
            loss_fn = None
            liger = trace_liger.torchtune_loss(model, setup)
        b, s = setup.micro_batch, setup.seq_len
        tokens = torch.zeros((b, s), dtype=torch.long)
        labels_in = torch.zeros((b, s), dtype=torch.long)
        ignore_labels_cache = torch.full((b, 1), -100, dtype=torch.long)

        def forward_loss():
            if loss_fn is None:
                return liger(tokens, labels_in)
            logits = model(tokens)
            labels = torch.hstack((labels_in[..., 1:], ignore_labels_cache[:b]))
            if not isinstance(logits, list):
                labels = labels.reshape(-1)
                logits = logits.reshape(-1, logits.size(-1))
            loss = loss_fn(logits, labels)
            del logits
            return loss

        optimizer = None
        if not listing:
            from .trace_transformers import make_optimizer
            kind = setup.optimizer
            optimizer = make_optimizer([{"params": list(model.parameters()),
                                         "weight_decay": 0.01}], kind)
        blocks = list(model.layers)
        # model.output runs once per chunk with chunked logits: the loss phase starts when the
        # model's forward returns.
        head = model.output if setup.loss == "full" else None
        return Target(model, optimizer, blocks, head, forward_loss, info=info)

    @staticmethod
    def _builders(d):
        scaling = d.get("rope_scaling") or {}
        if d["model_type"] == "qwen2":
            from torchtune.models.qwen2 import _component_builders as qwen2
            return qwen2.qwen2, qwen2.lora_qwen2, {"tie_word_embeddings": d["tie"]}
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            from torchtune.models.llama3_1 import _component_builders as l31
            return l31.llama3_1, l31.lora_llama3_1, {"scale_factor": int(scaling.get("factor",
                                                                                      8))}
        if d["vocab_size"] >= 128000:
            from torchtune.models.llama3 import _component_builders as l3
            return l3.llama3, l3.lora_llama3, {}
        from torchtune.models.llama2 import _component_builders as l2
        return l2.llama2, l2.lora_llama2, {}


# ---- placeholders filled below -------------------------------------------------------------------

class Torchtitan:
    def build(self, setup, fake_mode, listing=False):
        raise TraceError("framework: torchtitan is not traced yet")


class LitGPT:
    def build(self, setup, fake_mode, listing=False):
        raise TraceError("framework: litgpt is not traced yet")


class LLMFoundry:
    def build(self, setup, fake_mode, listing=False):
        raise TraceError("framework: llm-foundry is not traced yet")
