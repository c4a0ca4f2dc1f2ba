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
            raise TraceError("loss: Liger's fused linear cross-entropy is not traced (its "
                             "Triton kernels do not run on fake CPU tensors)")
        b, s = setup.micro_batch, setup.seq_len
        tokens = torch.zeros((b, s), dtype=torch.long)
        labels_in = torch.zeros((b, s), dtype=torch.long)
        ignore_labels_cache = torch.full((b, 1), -100, dtype=torch.long)

        def forward_loss():
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
        return Target(model, optimizer, blocks, head, forward_loss, info=info,
                      inputs=(tokens, labels_in, ignore_labels_cache))

    @staticmethod
    def _builders(d):
        scaling = d.get("rope_scaling") or {}
        if d["model_type"] == "qwen2":
            from torchtune.models.qwen2 import _component_builders as qwen2
            return qwen2.qwen2, qwen2.lora_qwen2, {"tie_word_embeddings": d["tie"]}
        if scaling.get("rope_type", scaling.get("type")) == "llama3" and d["tie"]:
            from torchtune.models.llama3_2 import _component_builders as l32
            return l32.llama3_2, l32.lora_llama3_2, {
                "scale_factor": int(scaling.get("factor", 32)), "tie_word_embeddings": True}
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
        raise TraceError(
            "framework: torchtitan 0.3 is not traced yet: its language models attend through "
            "FlexAttention or varlen flash attention with per-document masks built from the "
            "token positions (data-dependent, which fake tensors cannot compute), and its "
            "ChunkedLossWrapper runs the backward inside the loss; see docs/trace.md")


class LitGPT:
    """LitGPT 0.5 (litgpt/finetune/lora.py and finetune/full.py ``fit``): litgpt.model.GPT (or
    litgpt.lora.GPT with lora_query/lora_value adapters and LoRA dropout 0.05 by default) from
    the LitGPT config of the same name, ``max_seq_length`` set to the sequence length, logits
    computed in chunks of 128 tokens (``lm_head_chunk_size=128``), converted to fp32 as Fabric's
    precision plugin converts a module's outputs, and ``chunked_cross_entropy`` over them; precision bf16 = Fabric's "bf16-true" (weights in bf16), bf16-mixed = autocast
    over fp32 weights; torch AdamW over the trainable parameters."""

    def build(self, setup, fake_mode, listing=False):
        import torch
        import litgpt
        from litgpt.utils import chunked_cross_entropy
        name, raw = load_config(setup.model)
        if setup.checkpointing != "none":
            raise TraceError("checkpointing: LitGPT's single-device fine-tuning does not "
                             "checkpoint (its FSDP strategy does)")
        if setup.qlora:
            raise TraceError("qlora: LitGPT's bitsandbytes precision plugin is not traced")
        if setup.loss == "fused":
            raise TraceError("loss: LitGPT uses chunked_cross_entropy (loss=chunked) or full")
        config_name = self._config_name(name)
        overrides = {}
        if setup.layers is not None:
            overrides["n_layer"] = setup.layers
        lora = {}
        if setup.lora_rank:
            targets = setup.lora_targets or ["query", "value"]
            allowed = {"query", "key", "value", "projection", "mlp", "head"}
            if set(targets) - allowed:
                raise TraceError("lora_targets: LitGPT adapts %s" % ", ".join(sorted(allowed)))
            lora = {"lora_r": setup.lora_rank, "lora_alpha": setup.lora_alpha or
                    2 * setup.lora_rank,
                    "lora_dropout": 0.05 if setup.dropout is None else float(setup.dropout)}
            for t in allowed:
                lora["lora_" + t] = t in targets
        try:
            if lora:
                from litgpt.lora import Config as LoRAConfig, GPT as LoRAGPT, \
                    mark_only_lora_as_trainable
                config = LoRAConfig.from_name(config_name, **overrides, **lora)
            else:
                from litgpt.model import GPT
                config = litgpt.Config.from_name(config_name, **overrides)
        except ValueError as error:
            raise TraceError("model: %s" % error)
        dtype = _dtype(setup)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LoRAGPT(config) if lora else GPT(config)
        finally:
            torch.set_default_dtype(previous)
        model.max_seq_length = setup.seq_len
        if lora:
            mark_only_lora_as_trainable(model)
        model.train()
        info = {"name": name, "litgpt_config": config_name, "layers": config.n_layer,
                "layers_in_config": raw.get("num_hidden_layers")}
        if lora:
            info["lora_targets"] = sorted(t for t in ("query", "key", "value", "projection",
                                                      "mlp", "head") if lora["lora_" + t])
            info["lora_dropout"] = lora["lora_dropout"]
        _count(model, info)
        b, s = setup.micro_batch, setup.seq_len
        input_ids = torch.zeros((b, s), dtype=torch.long)
        targets = torch.zeros((b, s), dtype=torch.long)
        chunk = 128 if setup.loss == "chunked" else 0

        def fabric_output(value):
            # Fabric's precision plugins (HalfPrecision for bf16-true, MixedPrecision for
            # bf16-mixed) convert the module's floating outputs to the default dtype, fp32
            # (lightning/fabric/plugins/precision/{half,amp}.py, convert_output).
            if isinstance(value, list):
                return [fabric_output(v) for v in value]
            return value.to(torch.float32) if value.is_floating_point() else value

        def forward_loss():
            if chunk:
                logits = fabric_output(model(input_ids, lm_head_chunk_size=chunk))
                logits[-1] = logits[-1][..., :-1, :]
                return chunked_cross_entropy(logits, targets[..., 1:])
            logits = fabric_output(model(input_ids))
            return chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:], chunk_size=0)

        optimizer = None
        if not listing:
            from .trace_transformers import make_optimizer
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = make_optimizer([{"params": params, "weight_decay": 0.02}],
                                       setup.optimizer)
        autocast = None
        if setup.precision.endswith("-mixed"):
            from . import trace_cuda
            ac = torch.bfloat16 if setup.precision == "bf16-mixed" else torch.float16

            def autocast():
                return trace_cuda.CudaAutocast(ac)
        head = model.lm_head if not chunk else None
        return Target(model, optimizer, list(model.transformer.h), head, forward_loss,
                      autocast=autocast, info=info, inputs=(input_ids, targets))

    @staticmethod
    def _config_name(name):
        from litgpt.config import configs
        wanted = name.lower()
        for c in configs:
            n = c["name"].lower()
            if n in (wanted, wanted + "-hf"):
                return c["name"]
        raise TraceError("model: no LitGPT config named like %r (LitGPT builds its own "
                         "configs by name, e.g. Llama-3.1-8B)" % name)


def _import_llmfoundry_mpt():
    """llmfoundry.models.mpt without llmfoundry's package initialisers: those import its data,
    callback and cloud stack (mosaicml-streaming, mlflow, ...), which requirements-trace.txt
    leaves out because they pin torch 2.7 and Transformers 4.51; the model code (MPT, its
    layers, registries) imports on its own once the four packages above it are plain
    namespaces."""
    import importlib.util
    import os
    if "llmfoundry.models.mpt.modeling_mpt" in sys.modules:
        return sys.modules["llmfoundry.models.mpt.modeling_mpt"]
    spec = importlib.util.find_spec("llmfoundry")
    if spec is None:
        raise TraceError("framework: llm-foundry is not installed "
                         "(tests/oracle/requirements-trace.txt)")
    root = list(spec.submodule_search_locations)[0]
    for name in ("llmfoundry", "llmfoundry.utils", "llmfoundry.models", "llmfoundry.models.hf"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = module
    import llmfoundry.models.mpt.modeling_mpt as modeling_mpt
    return modeling_mpt


class LLMFoundry:
    """llm-foundry 0.22's MPT (llmfoundry/models/mpt/modeling_mpt.py, MPTForCausalLM) from an MPT
    config.json, run as ComposerMPTCausalLM runs a step: logits from the model, targets shifted
    by get_targets, per-token nn.CrossEntropyLoss(reduction='none') summed over the non-ignored
    tokens (compute_loss_from_logits), composer's DecoupledAdamW (traced as torch's for-loop AdamW: the same
    allocations), amp_bf16 = autocast over fp32
    weights, activation checkpointing of every MPTBlock (torch's checkpoint_wrapper, as
    composer's FSDP applies it). attn_impl is 'torch' (scaled_multihead_dot_product_attention):
    'flash' needs the flash_attn package, which has no CPU build; the loss is torch's cross
    entropy for the same reason (llm-foundry's default 'fused_crossentropy' is flash_attn's)."""

    def build(self, setup, fake_mode, listing=False):
        import torch
        modeling_mpt = _import_llmfoundry_mpt()
        from llmfoundry.models.mpt.configuration_mpt import MPTConfig
        name, raw = load_config(setup.model)
        if raw.get("model_type") != "mpt":
            raise TraceError("model: llm-foundry builds MPT configs (model_type mpt); %s is %r"
                             % (name, raw.get("model_type")))
        if setup.lora_rank or setup.qlora:
            raise TraceError("lora_rank: llm-foundry's MPT is traced for full training")
        if setup.loss != "full":
            raise TraceError("loss: llm-foundry's MPT computes the full logits")
        if setup.checkpointing not in ("none", "full") or setup.checkpoint_every != 1:
            raise TraceError("checkpointing: llm-foundry checkpoints every MPTBlock (full)")
        fields = {k: v for k, v in raw.items()
                  if k not in ("architectures", "model_type", "transformers_version",
                               "torch_dtype", "_name_or_path", "tokenizer_name", "use_cache")}
        from llmfoundry.models.utils.config_defaults import attn_config_defaults
        # Keys of the Hub's older MPT configs (prefix_lm) that llm-foundry 0.22 no longer takes.
        attn = {k: v for k, v in dict(fields.get("attn_config") or {}).items()
                if k in attn_config_defaults}
        attn["attn_impl"] = "torch"
        if setup.dropout is not None:
            attn["attn_pdrop"] = float(setup.dropout)
            fields["resid_pdrop"] = fields["emb_pdrop"] = float(setup.dropout)
        fields["attn_config"] = attn
        fields["init_device"] = "cpu"
        # Transformers 5 no longer gives every config a pad_token_id; MPTModel reads it.
        fields.setdefault("pad_token_id", None)
        if setup.layers is not None:
            fields["n_layers"] = setup.layers
        config = MPTConfig(**fields)
        dtype = _dtype(setup)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = modeling_mpt.MPTForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        model.train()
        if setup.checkpointing == "full" and not listing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
                apply_activation_checkpointing
            from llmfoundry.models.layers.blocks import MPTBlock
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MPTBlock))
        info = {"name": name, "model_type": "mpt", "layers": config.n_layers,
                "layers_in_config": raw.get("n_layers"), "attn_impl": "torch",
                "alibi": bool(attn.get("alibi"))}
        _count(model, info)
        b, s = setup.micro_batch, setup.seq_len
        input_ids = torch.zeros((b, s), dtype=torch.long)
        labels = torch.zeros((b, s), dtype=torch.long)
        loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100, reduction="none")

        def forward_loss():
            outputs = model(input_ids=input_ids)
            targets = modeling_mpt.get_targets(labels)
            losses = loss_fn(outputs.logits.view(-1, outputs.logits.size(-1)), targets.view(-1))
            return losses.sum() / (targets != -100).sum()

        optimizer = None
        if not listing and setup.optimizer != "none":
            params = [p for p in model.parameters() if p.requires_grad]
            kind = setup.optimizer
            if kind == "adamw":
                # composer's DecoupledAdamW steps one tensor at a time (and reads each step
                # count with .item(), which a fake tensor cannot give): the same allocations
                # as torch's for-loop AdamW (denom = exp_avg_sq.sqrt() / c, then add_).
                kind = "adamw-forloop"
                info["optimizer_class"] = "composer.optim.DecoupledAdamW (as adamw-forloop)"
            from .trace_transformers import make_optimizer
            optimizer = make_optimizer([{"params": params}], kind)
        autocast = None
        if setup.precision.endswith("-mixed"):
            from . import trace_cuda
            ac = torch.bfloat16 if setup.precision == "bf16-mixed" else torch.float16

            def autocast():
                return trace_cuda.CudaAutocast(ac)
        blocks = list(model.transformer.blocks)
        return Target(model, optimizer, blocks, None, forward_loss, autocast=autocast,
                      info=info, inputs=(input_ids, labels))
