"""memplan.trace for Hugging Face Transformers (+ PEFT LoRA, bitsandbytes-layout QLoRA): the
model class the config's ``architectures`` names, built on fake tensors, run as the Trainer runs
it (``loss = model(**batch).loss``, its gradient checkpointing, torch AdamW over the Trainer's
decay / no-decay parameter groups, autocast for mixed precision)."""

import contextlib

from .trace import TraceError, load_config

# Config fields that hold a dropout probability, per family (set by Setup.dropout).
_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                   "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
                   "dropout_rate", "dropout", "attention_dropout_prob", "summary_first_dropout",
                   "classifier_dropout", "ffn_dropout", "activation_dropout")
# Config fields naming the number of blocks (the first present is set by Setup.layers).
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")

# Peft's default LoRA targets per model_type are its own table; these are used when a family is
# missing from it.
_DEFAULT_TARGETS = {"gpt2": ["c_attn"], "bert": ["query", "value"], "roberta": ["query", "value"],
                    "t5": ["q", "v"], "mpt": ["Wqkv"]}


def _config(setup):
    import transformers
    name, raw = load_config(setup.model)
    raw = dict(raw)
    model_type = raw.get("model_type")
    if not model_type:
        raise TraceError("model: %s has no model_type" % name)
    layers_full = None
    if setup.layers is not None:
        for field in _LAYER_FIELDS:
            if field in raw:
                layers_full = raw[field]
                raw[field] = setup.layers
                break
        else:
            raw["num_hidden_layers"] = setup.layers
        for field in ("layer_types", "sliding_window_pattern_list", "attention_layers"):
            # Per-layer lists (gpt-oss, gemma3, qwen3 attention types) follow the new count.
            if isinstance(raw.get(field), list) and len(raw[field]) > setup.layers:
                raw[field] = raw[field][:setup.layers]
        if isinstance(raw.get("attention_types"), list):
            # GPT-Neo's [[["global", "local"], 12]] must expand to the new layer count.
            kinds = [k for kinds, repeat in raw["attention_types"] for _ in range(repeat)
                     for k in kinds]
            raw["attention_types"] = [[[k], 1] for k in kinds[:setup.layers]]
        if model_type == "t5":
            layers_full = raw.get("num_layers", layers_full)
            raw["num_layers"] = setup.layers
            raw["num_decoder_layers"] = setup.layers
    if setup.dropout is not None:
        for field in _DROPOUT_FIELDS:
            if field in raw and isinstance(raw[field], (int, float)) and \
                    not isinstance(raw[field], bool):
                raw[field] = float(setup.dropout)
    architectures = raw.pop("architectures", None) or []
    for key in ("model_type", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        raw.pop(key, None)
    try:
        config = transformers.AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as error:
        raise TraceError("model: Transformers cannot build model_type %r: %s" % (model_type,
                                                                                  error))
    return name, model_type, architectures, config, layers_full


_ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert")  # traced as masked LMs


def _model_class(architectures, model_type):
    import transformers
    for arch in architectures:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    if model_type == "t5":
        return transformers.T5ForConditionalGeneration
    if model_type in _ENCODERS:
        return transformers.AutoModelForMaskedLM
    return transformers.AutoModelForCausalLM


def _peft_task(model_type, model=None):
    """PEFT's task_type for the model _model_class builds: its wrapper's forward is that task's
    (PeftModelForCausalLM asks the model for prepare_inputs_for_generation, which a masked LM
    or a classifier lacks); None wraps in the plain PeftModel, whose forward is the model's (and
    leaves a classifier's head frozen, as the step model assumes)."""
    name = type(model).__name__ if model is not None else ""
    if name.endswith("ForSequenceClassification") or name.endswith("ForTokenClassification"):
        return None
    if model_type == "t5":
        return "SEQ_2_SEQ_LM"
    if model_type in _ENCODERS:
        return None
    return "CAUSAL_LM"


def find_blocks(model):
    """The model's repeated blocks: the ModuleList holding the most parameters."""
    import torch
    best, best_params = [], -1
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            n = sum(p.numel() for p in module.parameters())
            if n > best_params:
                best, best_params = list(module), n
    return best


def build(setup, fake_mode, listing=False):
    import torch
    from . import trace_cuda
    name, model_type, architectures, config, layers_full = _config(setup)
    if setup.checkpointing in ("selective", "op"):
        raise TraceError("checkpointing: Transformers checkpoints whole blocks (none or full, "
                         "with checkpoint_every); %r is torchtitan's" % setup.checkpointing)
    if setup.loss == "chunked":
        raise TraceError("loss: Transformers computes the full logits (chunked is torchtune's "
                         "and LitGPT's)")
    if setup.ranks != 1:
        raise TraceError("ranks: one GPU for Transformers")
    if setup.qlora:
        raise TraceError("qlora: QLoRA through Transformers/PEFT (bitsandbytes Linear4bit) is "
                         "not traced; torchtune's QLoRA (torchao NF4) is")
    if setup.loss == "fused":
        raise TraceError("loss: Liger's fused linear cross-entropy is not traced (its Triton "
                         "kernels do not run on fake CPU tensors)")
    cls = _model_class(architectures, model_type)
    pure = setup.precision in ("bf16", "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision, torch.float32)
    if setup.qlora:
        # bitsandbytes keeps the non-quantized weights (norms, embeddings, head) in the compute
        # dtype Transformers loads them in (torch_dtype=bfloat16 in the QLoRA recipes).
        dtype = torch.bfloat16 if setup.precision != "fp16-mixed" else torch.float16
    kwargs = {"attn_implementation": setup.attention}
    try:
        if hasattr(cls, "from_config"):
            model = cls.from_config(config, dtype=dtype, **kwargs)
        else:
            model = cls._from_config(config, dtype=dtype, **kwargs)
    except (ValueError, TypeError) as error:
        raise TraceError("model: %s cannot be built: %s" % (cls.__name__, error))
    model.train()
    info = {"name": name, "model_type": model_type, "class": type(model).__name__,
            "layers": getattr(config, "num_hidden_layers", None), "layers_in_config": layers_full,
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    if setup.checkpointing == "full" and not listing:
        model.gradient_checkpointing_enable(every_n_layers=setup.checkpoint_every) \
            if setup.checkpoint_every > 1 else model.gradient_checkpointing_enable()
    if setup.lora_rank:
        model = _apply_lora(model, setup, model_type, info)
    info["params"] = sum(p.numel() for p in _unique_params(model))
    info["trainable_params"] = sum(p.numel() for p in _unique_params(model) if p.requires_grad)

    b, s = setup.micro_batch, setup.seq_len
    vocab = getattr(config, "vocab_size", 32000)
    input_ids = torch.zeros((b, s), dtype=torch.long)
    is_seq_cls = type(model).__name__.endswith("ForSequenceClassification") or \
        cls.__name__.endswith("ForSequenceClassification")
    labels = torch.zeros((b,), dtype=torch.long) if is_seq_cls else \
        torch.zeros((b, s), dtype=torch.long)
    if is_seq_cls and getattr(model.config, "pad_token_id", None) is None:
        # A decoder's sequence classifier pools each sequence's last non-padding token and
        # refuses more than one sequence without a pad token (a trainer's tokenizer has one).
        model.config.pad_token_id = 0
    del vocab

    optimizer = None if listing else _optimizer(model, setup)
    head = None
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if head is None:
        # A classifier's output head (BERT's and DistilBERT's classifier, RoBERTa's
        # classification head, a decoder's score): the loss phase starts when its forward ends,
        # as at a language model's head, not when the model's forward (which computes the loss)
        # returns.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for name in ("classifier", "score"):
            module = getattr(base, name, None)
            if isinstance(module, torch.nn.Module):
                head = module
                break
    def forward_loss():
        return model(input_ids=input_ids, labels=labels).loss

    autocast = None
    if setup.precision in ("bf16-mixed", "fp16-mixed"):
        ac_dtype = torch.bfloat16 if setup.precision == "bf16-mixed" else torch.float16

        def autocast():
            return trace_cuda.CudaAutocast(ac_dtype)
    from .trace import Target
    target = Target(model, optimizer, find_blocks(model), head, forward_loss,
                    autocast=autocast, info=info, inputs=(input_ids, labels))
    if setup.precision == "fp16-mixed" and optimizer is not None:
        _grad_scaler(target)
    del pure
    return target


def _unique_params(model):
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _apply_lora(model, setup, model_type, info):
    try:
        import peft
    except ImportError as error:
        raise TraceError("lora_rank: PEFT is not installed (%s)" % error)
    targets = setup.lora_targets or _DEFAULT_TARGETS.get(model_type)
    if targets is None:
        mapping = getattr(peft.utils, "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING", {})
        if model_type not in mapping:
            # PEFT has no default for this family: its attention query and value projections
            # (or the fused qkv projection), as PEFT's defaults are for the others.
            leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
            for candidate in (["q_proj", "v_proj"], ["qkv_proj"], ["query_key_value"],
                              ["c_attn"], ["Wqkv"]):
                if set(candidate) <= leaves:
                    targets = candidate
                    break
    config = peft.LoraConfig(r=setup.lora_rank, lora_alpha=setup.lora_alpha or 2 * setup.lora_rank,
                             target_modules=targets, lora_dropout=0.0, bias="none",
                             task_type=_peft_task(model_type, model))
    # PEFT 0.21 refuses torchao < 0.16 wherever torchao is importable, even for plain Linear
    # layers; the pinned torchao is 0.15 (torchtune 0.6 needs it) and no layer here is torchao-
    # quantized, so PEFT's torchao dispatcher is told torchao is absent.
    from peft.tuners.lora import torchao as peft_torchao
    original = peft_torchao.is_torchao_available
    peft_torchao.is_torchao_available = lambda: False
    try:
        model = peft.get_peft_model(model, config)
    except ValueError as error:
        raise TraceError("lora_targets: %s" % error)
    finally:
        peft_torchao.is_torchao_available = original
    info["lora_targets"] = sorted(model.peft_config["default"].target_modules)
    if setup.qlora:
        # peft.prepare_model_for_kbit_training: the non-quantized parameters in fp32 (the QLoRA
        # recipe), input grads for checkpointing.
        import torch
        for p in model.parameters():
            if not p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) and \
                    not getattr(p, "_memplan_nf4", False):
                p.data = p.data.float()
    return model


def _optimizer(model, setup):
    import torch
    params = [p for p in _unique_params(model) if p.requires_grad]
    if setup.optimizer == "none" or not params:
        return None
    # Trainer.create_optimizer: weight decay on everything but biases and norm weights.
    decay, no_decay = [], []
    names = {id(p): n for n, p in model.named_parameters()}
    for p in params:
        n = names.get(id(p), "")
        (no_decay if ("bias" in n or "norm" in n.lower() or "ln" in n.split(".")[-2:-1])
         else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": 0.0},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return make_optimizer(groups, setup.optimizer)


def make_optimizer(groups, kind):
    """torch's optimizers as a CUDA run gets them (foreach is the CUDA default; see
    trace_cuda, item 9)."""
    import torch
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-5, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(groups, lr=1e-5, fused=True)
    if kind == "adamw-forloop":
        return torch.optim.AdamW(groups, lr=1e-5, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-3, foreach=True)
    if kind == "sgd-momentum":
        return torch.optim.SGD(groups, lr=1e-3, momentum=0.9, foreach=True)
    raise TraceError("optimizer: %r is not one of adamw, adamw-fused, adamw-forloop, sgd, "
                     "sgd-momentum, none" % kind)


def _grad_scaler(target):
    """fp16 mixed precision: the loss scaled before backward, gradients unscaled in place
    before the step (torch.amp.GradScaler; its found-inf flags are one float each)."""
    import torch
    scale = torch.full((), 65536.0)
    inner = target.forward_loss

    def forward_loss():
        return inner() * scale

    def step():
        inv = scale.reciprocal()
        found = torch.zeros(())
        for group in target.optimizer.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        target.optimizer.step()

    target.forward_loss = forward_loss
    target.step = step


@contextlib.contextmanager
def nothing():
    yield
