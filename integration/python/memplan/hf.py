"""memplan.hf: the offload engine under the Hugging Face Trainer.

    from memplan.hf import MemplanTrainer
    trainer = MemplanTrainer(model=model, args=TrainingArguments(..., max_grad_norm=0),
                             train_dataset=data, memplan_path="/mnt/nvme/run1")
    trainer.train()

MemplanTrainer is a transformers.Trainer that, before the Trainer sets up, puts the model's
parameters and optimizer into memplan's engine (memplan.torch.offload, with the Trainer's learning
rate, betas, epsilon, weight decay and gradient accumulation) and gives the Trainer an
OffloadOptimizer: a torch.optim.Optimizer whose step() is the engine's step, at the learning rate
the Trainer's scheduler sets in its param_groups. Everything else is the Trainer's own loop
(data, loss, backward, scheduler, logging). Checkpoints (save_model, save_steps) are written from
the engine with OffloadedModule.save (safetensors, save_pretrained's layout), not from the module,
whose parameters are empty between uses.

Differences from the Trainer's own AdamW, refused or documented rather than silently changed:
  - max_grad_norm must be 0: gradients go to the engine as they are produced and never sit on the
    parameters, so there is no global norm to clip by (a ValueError otherwise).
  - weight decay applies to every trainable parameter (the Trainer's AdamW exempts biases and
    norms); train with weight_decay=0 to match it exactly, or accept decay on those too.
  - the optimizer is AdamW (optim="adamw_torch" semantics); other `optim` values are refused.
  - the logged grad_norm is 0 (nothing on the parameters to measure).

Any number of processes: under torchrun the engine shards every parameter over the ranks
(memplan.torch, "Across processes"); launch as for any Trainer script.
"""

import torch

import memplan.torch

__all__ = ["OffloadOptimizer", "MemplanTrainer"]


class OffloadOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer over an OffloadedModule, for code that expects one (the Trainer,
    Accelerate, LR schedulers): step() runs the engine's step with param_groups[0]'s "lr";
    zero_grad() does nothing (gradients never stay on the parameters). Its state_dict() holds only
    the param_groups: the optimizer's states are the engine's (resume from its stores)."""

    def __init__(self, offloaded, lr):
        self.offloaded = offloaded
        trainable = [e.param for e in offloaded.params if not e.frozen]
        super().__init__(trainable, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.offloaded.step(lr=float(self.param_groups[0]["lr"]))
        return loss

    def zero_grad(self, set_to_none=True):
        """Nothing to zero: gradients are handed to the engine as they are produced."""


def _trainer_class():
    import transformers
    return transformers.Trainer


class MemplanTrainer(_trainer_class()):
    """transformers.Trainer with the model's parameters and optimizer in memplan's engine.

    memplan_path: the directory for the engine's NVMe stores (None: host memory).
    memplan_options: further keywords for memplan.torch.offload (pinned_budget_bytes,
    sub_group_elements, fetch_units, dtype, resume, ...). ``self.memplan`` is the
    OffloadedModule.
    """

    def __init__(self, model=None, args=None, *pos, memplan_path=None, memplan_options=None,
                 **kwargs):
        if args is None or model is None:
            raise ValueError("MemplanTrainer needs model= and args=")
        if args.max_grad_norm:
            raise ValueError("MemplanTrainer: set max_grad_norm=0; gradients go to the engine as "
                             "they are produced, so there is no global norm to clip by")
        optim = str(getattr(args.optim, "value", args.optim))
        if optim not in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
            raise ValueError(f"MemplanTrainer: optim={optim!r}; the engine runs AdamW "
                             "(adamw_torch)")
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise ValueError("MemplanTrainer makes its own optimizer (the engine's)")
        options = dict(memplan_options or {})
        self.memplan = memplan.torch.offload(
            model, memplan_path, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon, weight_decay=args.weight_decay,
            gradient_accumulation_steps=args.gradient_accumulation_steps, **options)
        optimizer = OffloadOptimizer(self.memplan, args.learning_rate)
        kwargs["optimizers"] = (optimizer, kwargs.get("optimizers", (None, None))[1])
        super().__init__(model, args, *pos, **kwargs)

    def _save(self, output_dir=None, state_dict=None):
        # The module's parameters are empty between uses: the weights come from the engine.
        self.memplan.save(output_dir or self.args.output_dir)

    def save_model(self, output_dir=None, _internal_call=False):
        # Every rank calls this (save() gathers the shards: a collective); the first one writes.
        output_dir = output_dir or self.args.output_dir
        self.memplan.save(output_dir)
        tokenizer = getattr(self, "processing_class", None)
        if tokenizer is not None and self.args.should_save:
            tokenizer.save_pretrained(output_dir)
