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


def _accepted(builder, kwargs):
    """The keyword arguments ``builder`` takes: torchtune's lora_llama2 has no rope_base (Llama
    2's base is fixed at 10,000 there); a config asking for another base is refused rather than
    built wrong."""
    import inspect
    names = inspect.signature(builder).parameters
    dropped = {k: v for k, v in kwargs.items() if k not in names}
    if dropped.get("rope_base", 10000) != 10000:
        raise TraceError("model: %s.%s builds RoPE with base 10000, the config asks for %s" % (
            builder.__module__, builder.__name__, dropped["rope_base"]))
    return {k: v for k, v in kwargs.items() if k in names}


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
                    quantize_base=bool(setup.qlora), **_accepted(lora_builder, common))
                set_trainable_params(model, get_adapter_params(model))
                info["lora_targets"] = sorted(targets)
            else:
                model = builder(**_accepted(builder, common))
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
        # A tied head (Llama 3.2, Qwen2 0.5B) is a TiedLinear, a plain callable around the
        # nn.Module that runs F.linear with the embedding's weight: that module takes the hook.
        head = getattr(head, "linear", head)
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


# ---- torchtitan 0.3 ------------------------------------------------------------------------------

class Torchtitan:
    """torchtitan 0.3's trainer (trainer.py ``_forward_backward_body``, llama3/parallelize.py
    ``parallelize_llama``): the Llama 3 model of torchtitan.models.llama3 (fused wqkv, complex
    RoPE with a cache per layer sized to the sequence length, depth-scaled inits skipped: fake
    tensors have no values) built on the meta device, its activation checkpointing
    (``FullAC`` or the per-op ``SelectiveAC``, whose policy saves every compute-intensive op's
    output but recomputes every second matmul), then FSDP2 on every block and on the embeddings,
    the final norm and the head (``apply_fsdp_to_decoder``: always, on one rank too, for its
    mixed-precision policy: bf16 parameters in forward and backward, fp32 gradient reduction),
    over ``ranks`` ranks of a fake process group, traced by FSDPMemTracker. The loss is the
    config registry's: ``ChunkedLossWrapper`` (the head and cross-entropy run on ``loss_chunks``
    sequence chunks, each chunk's backward inside the loss, the hidden states' gradient gathered
    in fp32) or, with ``loss=full``, one logits tensor into ``cross_entropy_loss`` (fp32,
    sum-reduced); gradient clipping at norm 1.0 and AdamW (fused by default, torchtitan's
    ``implementation``) over all parameters.

    Attention: the language models attend through FlexAttention or varlen FlashAttention with
    per-document masks built from token positions, which fake tensors cannot compute. The trace
    runs one document per sequence through SDPA's causal FlashAttention, which keeps what varlen
    flash keeps (q, k, v, the output and an fp32 log-sum-exp per head and token) and allocates
    the same backward buffers (trace_cuda); the masks' own metadata (cu_seqlens, a few KiB) is
    not counted."""

    def build(self, setup, fake_mode, listing=False):
        import torch
        d = _llama_dims(setup)
        if setup.checkpointing == "selective":
            raise TraceError("checkpointing: torchtitan 0.3 has full and per-op selective "
                             "(op) checkpointing; its per-layer selective option is gone")
        if setup.checkpoint_every != 1:
            raise TraceError("checkpoint_every: torchtitan 0.3 checkpoints every block")
        if setup.precision not in ("bf16-mixed", "fp32"):
            raise TraceError("precision: torchtitan trains fp32 weights with FSDP2's "
                             "mixed-precision policy (bf16-mixed) or in fp32")
        if setup.lora_rank:
            raise TraceError("lora_rank: torchtitan's Llama 3 is traced for full training")
        if setup.attention != "sdpa":
            raise TraceError("attention: torchtitan's models attend through flash kernels "
                             "(traced as SDPA's); there is no eager path")
        if setup.loss == "fused":
            raise TraceError("loss: torchtitan's losses are chunked (its default) or full")
        if setup.loss == "chunked" and setup.seq_len % setup.loss_chunks:
            raise TraceError("loss_chunks: ChunkedLossWrapper needs the sequence length (%d) "
                             "divisible by the chunks (%d)" % (setup.seq_len, setup.loss_chunks))
        if d["attention_bias"] or d["model_type"] != "llama":
            raise TraceError("model: torchtitan's llama3 builds Llama models without biases")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss, \
            cross_entropy_loss
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():  # the mesh's rank table is real
            _fake_process_group(setup.ranks)
            mesh = init_device_mesh("cpu", (setup.ranks,), mesh_dim_names=("fsdp",))
        config = self._model_config(d, setup.seq_len)
        with torch.device("meta"):
            model = config.build()
        causal_flash = _causal_flash_class()
        for block in model.layers.values():
            block.attention.inner_attention = causal_flash()
        info = {"name": d["name"], "model_type": d["model_type"], "layers": d["num_layers"],
                "layers_in_config": d["layers_in_config"],
                "builder": "torchtitan.models.llama3.Llama3Model", "ranks": setup.ranks}
        _count(model, info)
        if not listing:
            if setup.checkpointing == "full":
                FullAC(FullAC.Config()).apply(model)
            elif setup.checkpointing == "op":
                SelectiveAC(SelectiveAC.Config()).apply(model)
        param_dtype = torch.bfloat16 if setup.precision == "bf16-mixed" else torch.float32
        apply_fsdp_to_decoder(model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32,
                              pp_enabled=False)
        model.to_empty(device="cpu")
        _init_buffers(model)
        model.train()
        b, s = setup.micro_batch, setup.seq_len
        tokens = torch.zeros((b, s), dtype=torch.long)
        labels = torch.zeros((b, s), dtype=torch.long)
        valid = torch.full((), float(b * s))
        state = {"tracker": None}
        if setup.loss == "chunked":
            chunked = ChunkedLossWrapper(ChunkedLossWrapper.Config(
                num_chunks=setup.loss_chunks, loss_fn=CrossEntropyLoss.Config()))
            chunked.set_lm_head(model.lm_head)
            model._skip_lm_head = True
            loss_module = _loss_module(chunked)

            def loss_fn(pred):
                with _nested_backward(state["tracker"]):
                    return loss_module(pred, labels, valid)
        else:
            def loss_fn(pred):
                return cross_entropy_loss(pred, labels) / valid

        def forward_loss():
            pred = model(tokens)
            loss = loss_fn(pred)
            del pred
            return loss

        optimizer = None
        step = None
        if not listing:
            from .trace_transformers import make_optimizer
            optimizer = make_optimizer([{"params": list(model.parameters()),
                                         "weight_decay": 0.1}], setup.optimizer)

            def step():
                from torchtitan.distributed import utils as dist_utils
                dist_utils.clip_grad_norm_(list(model.parameters()), max_norm=1.0,
                                           foreach=True)
                optimizer.step()

        blocks = list(model.layers.values())
        target = Target(model, optimizer, blocks, None, forward_loss, info=info,
                        tracker_class=FSDPMemTracker, step=step, inputs=(tokens, labels))
        target.on_tracker = lambda tracker: state.__setitem__("tracker", tracker)
        return target

    @staticmethod
    def _model_config(d, seq_len):
        from torchtitan.models import llama3
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        dim, vocab = d["embed_dim"], d["vocab_size"]
        if d["head_dim"] != dim // d["num_heads"]:
            raise TraceError("model: torchtitan's llama3 has head_dim = hidden_size / heads")
        scaling = d.get("rope_scaling") or {}
        llama_scaling = scaling.get("rope_type", scaling.get("type")) == "llama3"
        rope = ComplexRoPE.Config(dim=d["head_dim"], max_seq_len=seq_len,
                                  theta=d["rope_base"],
                                  scaling="llama" if llama_scaling else "none")
        layers = llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=d["num_layers"], dim=dim, n_heads=d["num_heads"],
            n_kv_heads=d["num_kv_heads"], hidden_dim=d["intermediate_dim"], rope=rope,
            attn_backend="varlen")
        for layer in layers:
            layer.attention_norm.eps = layer.ffn_norm.eps = d["norm_eps"]
        return llama3.Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=d["tie"],
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
            norm=RMSNorm.Config(normalized_shape=dim, eps=d["norm_eps"]),
            lm_head=Linear.Config(in_features=dim, out_features=vocab), layers=layers)


def _causal_flash_class():
    """torchtitan's inner attention (B, L, N, H in and out) as SDPA's causal attention over the
    heads-first views, which trace_cuda runs as the GPU's FlashAttention."""
    import torch

    class CausalFlash(torch.nn.Module):
        def forward(self, q, k, v, attention_masks=None, scale=None, enable_gqa=False,
                    **kwargs):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                scale=scale, enable_gqa=enable_gqa)
            return out.transpose(1, 2)

    return CausalFlash


def _fake_process_group(ranks):
    """A fake process group of ``ranks`` ranks (collectives do nothing; torch's own fake
    backend, as FSDPMemTracker's tests use), this process rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        if dist.get_world_size() == ranks and dist.get_backend() == "fake":
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)


def _init_buffers(model):
    """torchtitan's ``init_states`` for the buffers (each block's RoPE cache), its parameter
    inits skipped: truncated-normal draws read values, which fake tensors do not have, and
    change no byte of memory."""
    import torch
    from torchtitan.protocols import module as titan_module
    original = titan_module.Module._init_self_parameters
    titan_module.Module._init_self_parameters = lambda self: None
    try:
        model.init_states(buffer_device=torch.device("cpu"))
    finally:
        titan_module.Module._init_self_parameters = original


def _loss_module(loss):
    import torch

    class Loss(torch.nn.Module):
        """The chunked loss as a module, so that the tracker sees its repeated head calls
        inside one parent (FSDPMemTracker refuses a second top-level forward of a module)."""

        def forward(self, pred, labels, valid):
            return loss(pred, labels, valid)[0]

    return Loss()


@contextlib.contextmanager
def _nested_backward(tracker):
    """ChunkedLossWrapper runs a backward per chunk inside the forward. The module tracker
    inside FSDPMemTracker assumes one backward after the forward: at a backward's end it forgets
    every module still running and fires the pops it queued for modules whose inputs need no
    gradient. Around each nested backward its state is kept and put back, so the step's own
    backward sees the forward as it was."""
    import torch
    if tracker is None:
        yield
        return
    mt = tracker._mod_tracker
    original = torch.Tensor.backward

    def backward(tensor, *args, **kwargs):
        saved = (set(mt.parents), dict(mt._active_module_cnt),
                 list(mt._post_bw_callbacks_to_enqueue), mt._has_callback)
        mt._post_bw_callbacks_to_enqueue.clear()
        try:
            return original(tensor, *args, **kwargs)
        finally:
            mt.parents, mt._active_module_cnt = saved[0], saved[1]
            mt._post_bw_callbacks_to_enqueue[:] = saved[2]
            mt._has_callback = saved[3]

    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = original


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
