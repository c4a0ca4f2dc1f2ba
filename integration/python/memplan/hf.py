"""memplan.hf: the offload engine under the Hugging Face Trainer.

    from memplan.hf import MemplanTrainer
    trainer = MemplanTrainer(model=model, args=TrainingArguments(..., bf16=True),
                             train_dataset=data, memplan_path="/mnt/nvme/run1")
    trainer.train()                       # or train(resume_from_checkpoint=True)

MemplanTrainer is a transformers.Trainer that, when training begins, puts the model's parameters
and optimizer into memplan's engine (memplan.torch.offload, with the Trainer's learning rate,
betas, epsilon, weight decay, gradient accumulation, clipping and parameter groups) and gives the
Trainer an OffloadOptimizer: a torch.optim.Optimizer whose step() is the engine's step, at the
learning rates the Trainer's scheduler sets in its param_groups. Everything else is the Trainer's
own loop (data, loss, backward, mixed precision, scheduler, logging, evaluation, checkpoints).
When train() returns (or raises) the engine is closed: the model holds its trained weights again
as ordinary tensors, and another trainer may use the same memplan_path.

What the Trainer's settings do (tests/python/test_hf_trainer.py checks each against the plain
Trainer):
  - optim: AdamW (adamw_torch, adamw_torch_fused, adamw_hf); others are refused.
  - parameter groups: the Trainer's, weight decay on every parameter but biases and norms
    (get_decay_parameter_names), as groups in the engine.
  - max_grad_norm: clipping by the global gradient norm, as torch.nn.utils.clip_grad_norm_ (the
    engine measures every gradient as it arrives; over every rank); the logged grad_norm is that
    norm.
  - bf16 / fp16: torch.autocast through the engine's parameters (forward and backward); fp16's
    loss scaling is torch's GradScaler: a step whose gradients overflowed is skipped, its scale
    lowered, exactly as without memplan.
  - checkpoints (save_steps, save_strategy): the model as save_pretrained lays it out
    (model.safetensors), optimizer.pt (the param groups) with the optimizer's whole state in
    memplan_optimizer/ (one safetensors file per rank; OffloadedModule.save_checkpoint), the
    scheduler, RNG and trainer state as the Trainer writes them; train(resume_from_checkpoint=...)
    restores weights, optimizer states, scheduler, step and data position. A plain Trainer's
    checkpoint (optimizer.pt with torch's AdamW states) resumes too.
  - gradient checkpointing and evaluation, with any number of processes: under torchrun every
    rank holds a shard of every parameter (ZeRO-3; memplan.torch, "Across processes"); the model
    is not wrapped in DistributedDataParallel (the engine reduces the gradients).
"""

import os
import warnings

import torch

import memplan.torch

__all__ = ["OffloadOptimizer", "MemplanTrainer"]

# Where MemplanTrainer writes the engine's optimizer state in a Trainer checkpoint.
MEMPLAN_CHECKPOINT_DIR = "memplan_optimizer"


class OffloadOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer over an OffloadedModule, for code that expects one (the Trainer,
    Accelerate, LR schedulers, GradScaler): one param group per engine parameter group, with its
    options (lr, weight_decay, betas, eps), which every engine step takes from param_groups as they
    are then (a scheduler's learning rates included); step() is the engine's step; zero_grad()
    drops a step in progress. state_dict() is torch's AdamW form with the engine's states (whole
    tensors: a collective with several ranks), load_state_dict() loads one (a plain AdamW's of the
    same model too)."""

    def __init__(self, offloaded, lr=None):
        self.offloaded = offloaded
        self._memplan_offloaded = offloaded  # how memplan.torch's patches find the engine
        groups = []
        for g, entries in enumerate(offloaded.param_group_entries()):
            options = offloaded.group_param_options(g)
            if lr is not None:
                options["lr"] = lr
            groups.append(dict(options, params=[e.param for e in entries]))
        super().__init__(groups, {k: v for k, v in groups[0].items() if k != "params"})
        # The engine reads the groups' options from here at every step (before backward with
        # overlap_optimizer): what a scheduler set since is what the step uses.
        offloaded._options_source = self._engine_groups

    def _engine_groups(self):
        kind = self.offloaded.optimizer_kind
        return [memplan.torch._engine_group_options(
            {k: v for k, v in group.items() if k != "params"}, kind, f"param_groups[{g}]")
            for g, group in enumerate(self.param_groups)]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.offloaded.step()
        return loss

    def zero_grad(self, set_to_none=True):
        """Drops a step in progress (gradients are handed to the engine as they are produced)."""
        self.offloaded.zero_grad()

    def _packed_groups(self):
        groups, index = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        return groups

    def state_dict(self):
        """torch.optim's state_dict: the engine's states per parameter, the param groups."""
        state = self.offloaded.optimizer_state_dict()
        state["param_groups"] = self._packed_groups()
        return state

    def light_state_dict(self, checkpoint_dir):
        """The param groups only, and where the engine's state was written (Trainer checkpoints:
        optimizer.pt beside memplan_optimizer/)."""
        return {"state": {}, "param_groups": self._packed_groups(),
                "memplan": {"checkpoint": checkpoint_dir}}

    def load_state_dict(self, state_dict):
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"memplan.hf: the optimizer state has {len(groups)} param groups; "
                             f"this optimizer has {len(self.param_groups)}")
        for g, (saved, group) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"memplan.hf: param group {g} of the optimizer state has "
                                 f"{len(saved['params'])} parameters; this one has "
                                 f"{len(group['params'])}")
        if "memplan" not in state_dict:  # torch's form: the states themselves
            self.offloaded.load_optimizer_state_dict(state_dict)
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})


def _trainer_class():
    import transformers
    return transformers.Trainer


def _stores_of(path, rank, world_size):
    """The store directories an earlier run of the engine left under `path` for this rank."""
    base = path if world_size == 1 else os.path.join(path, f"rank{rank}")
    return base, [os.path.join(base, "params"), os.path.join(base, "optimizer")]


class MemplanTrainer(_trainer_class()):
    """transformers.Trainer with the model's parameters and optimizer in memplan's engine.

    memplan_path: the directory for the engine's NVMe stores (None: host memory); created with
    its parents.
    memplan_options: further keywords for memplan.torch.offload (pinned_budget_bytes,
    sub_group_elements, fetch_units, dtype, overlap_optimizer (on by default here: the Trainer
    gives every option before backward), resume, ...). ``self.memplan`` is
    the OffloadedModule (after train(); closed when it returns, its stats() kept). A second
    train() puts the model, with its trained weights, into a new engine, whose optimizer starts
    afresh (a Trainer checkpoint carries the optimizer's state across: resume_from_checkpoint).
    """

    def __init__(self, model=None, args=None, *pos, memplan_path=None, memplan_options=None,
                 **kwargs):
        if args is None or model is None:
            raise ValueError("MemplanTrainer needs model= and args=")
        optim = str(getattr(args.optim, "value", args.optim))
        if optim not in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
            raise ValueError(f"MemplanTrainer: optim={optim!r}; the engine runs AdamW "
                             "(adamw_torch)")
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise ValueError("MemplanTrainer makes its own optimizer (the engine's)")
        if kwargs.get("model_init") is not None:
            raise ValueError("MemplanTrainer: model_init (a model made anew by train(), as a "
                             "hyper-parameter search does) is not supported: the engine holds "
                             "the model it is given; make a MemplanTrainer per trial instead")
        if memplan_path is not None and not str(memplan_path):
            raise ValueError("MemplanTrainer: memplan_path is empty; give a directory, or None "
                             "for host memory")
        self.memplan_path = memplan_path
        self.memplan_options = dict(memplan_options or {})
        self.memplan = None
        super().__init__(model, args, *pos, **kwargs)

    # ---- the engine's life: one train() -------------------------------------------------------

    def _memplan_open(self, resume_from_checkpoint):
        args = self.args
        model = self.model
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if n in decay],
                   "weight_decay": args.weight_decay},
                  {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]
        options = dict(self.memplan_options)
        options.setdefault("max_grad_norm", float(args.max_grad_norm or 0))
        # Issue 33: overlapped by default. Under the Trainer every option of a step is known before
        # its backward (the groups' options are read from param_groups, where the scheduler set
        # them, and the clipping is declared above), which is what overlapping needs; the results
        # are the serial step's, bit for bit. memplan_options overlap_optimizer=False turns it off.
        options.setdefault("overlap_optimizer", True)
        rank, world = args.process_index, args.world_size
        if options.get("resume") and resume_from_checkpoint is not None:
            raise ValueError("MemplanTrainer: resume_from_checkpoint and memplan_options "
                             "resume=True both given; the checkpoint is resumed from, the "
                             "engine's stores are not (drop one)")
        if self.memplan_path is not None and not options.get("resume"):
            # Under the Trainer, memplan_path is the engine's scratch space (as DeepSpeed's
            # nvme_path): checkpoints are the Trainer's, so stores an earlier run left are
            # replaced (one in use by a live process is refused).
            self._remove_stale_stores(rank, world)
        self.memplan = memplan.torch.offload(
            model, self.memplan_path, lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            param_groups=groups, **options)
        if self.memplan.resumed_step and resume_from_checkpoint is None:
            warnings.warn(
                f"MemplanTrainer: the engine resumed its weights and optimizer at step "
                f"{self.memplan.resumed_step}, but the Trainer starts at step 0 (learning-rate "
                "schedule and data from the beginning); train(resume_from_checkpoint=...) resumes "
                "both", stacklevel=3)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            self.memplan.use_grad_scaler(scaler)
        # memplan's engine is the data-parallel one (ZeRO-3 over the ranks): Accelerate must not
        # wrap the model in DistributedDataParallel, whose own gradient reductions and buffer
        # broadcasts would interleave with the engine's collectives differently on each rank.
        # Prepared as for evaluation (autocast, placement; no DDP), and marked prepared.
        self.model = self.accelerator.prepare_model(model, evaluation_mode=True)
        self.model._is_accelerate_prepared = True
        self.model_wrapped = self.model
        self.optimizer = None
        self.lr_scheduler = None

    def _remove_stale_stores(self, rank, world):
        """Stores an earlier run of this path left behind (not in use by a live process) are
        removed before the engine makes its own."""
        import shutil
        memplan.torch._close_holder(self.memplan_path)  # an earlier trainer of this process
        base, stores = _stores_of(self.memplan_path, rank, world)
        stale = [d for d in stores if os.path.isdir(d)]
        if not stale:
            return
        for d in stale:
            if os.path.exists(os.path.join(d, "memplan-swap.lock")):
                # The engine's own check names a live holder; a dead one's lock is stale too.
                import fcntl
                with open(os.path.join(d, "memplan-swap.lock"), "rb") as f:
                    try:
                        fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise RuntimeError(f"MemplanTrainer: {d} is in use by another process; "
                                           "use another memplan_path") from None
        for d in stale:
            shutil.rmtree(d)
        steps = os.path.join(base, "param_steps.json")
        if os.path.exists(steps):
            os.unlink(steps)
        warnings.warn(f"MemplanTrainer: replacing the engine stores an earlier run left in {base} "
                      "(resume from a Trainer checkpoint with train(resume_from_checkpoint=...))",
                      stacklevel=4)

    def _memplan_close(self):
        if self.memplan is not None and not self.memplan._closed:
            self.memplan.close()
        # The model is an ordinary module again: the optimizer over the engine is gone with it.
        self.optimizer = None
        self.lr_scheduler = None

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        """transformers.Trainer.train with the model in memplan's engine for its duration."""
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory "
                                 f"({self.args.output_dir})")
        self._memplan_open(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._memplan_close()

    def _engine_open(self):
        return self.memplan is not None and not self.memplan._closed

    def create_optimizer(self, model=None):
        if not self._engine_open():
            raise RuntimeError("MemplanTrainer: the optimizer is the engine's, made by train()")
        if self.optimizer is None:
            self.optimizer = OffloadOptimizer(self.memplan)
        return self.optimizer

    def _offload_optimizer(self):
        optimizer = self.optimizer
        while optimizer is not None and not isinstance(optimizer, OffloadOptimizer):
            optimizer = getattr(optimizer, "optimizer", None)
        return optimizer

    # ---- checkpoints ----------------------------------------------------------------------------

    def _save(self, output_dir=None, state_dict=None):
        if not self._engine_open():
            return super()._save(output_dir, state_dict)
        # The module's parameters are empty between uses: the weights come from the engine.
        self.memplan.save(output_dir or self.args.output_dir)

    def save_model(self, output_dir=None, _internal_call=False):
        if not self._engine_open():
            return super().save_model(output_dir, _internal_call)
        # Every rank calls this (save() gathers the shards: a collective); the first one writes.
        output_dir = output_dir or self.args.output_dir
        self.memplan.save(output_dir)
        tokenizer = getattr(self, "processing_class", None)
        if tokenizer is not None and self.args.should_save:
            tokenizer.save_pretrained(output_dir)
        return None

    def _save_optimizer_and_scheduler(self, output_dir):
        if not self._engine_open():
            return super()._save_optimizer_and_scheduler(output_dir)
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
        # The optimizer's whole state, one file per rank (every rank writes its own), then the
        # param groups and the scheduler as the Trainer writes them.
        self.memplan.save_checkpoint(os.path.join(output_dir, MEMPLAN_CHECKPOINT_DIR))
        if self.args.should_save:
            optimizer = self._offload_optimizer()
            torch.save(optimizer.light_state_dict(MEMPLAN_CHECKPOINT_DIR),
                       os.path.join(output_dir, OPTIMIZER_NAME))
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(),
                           os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if (self._engine_open() and
                os.path.isdir(os.path.join(resume_from_checkpoint, MEMPLAN_CHECKPOINT_DIR))):
            return None  # the master weights come with the optimizer state, exactly
        # A checkpoint of weights only (save_only_model, a plain Trainer's): the Trainer loads
        # them with model.load_state_dict, which loads into the engine while it holds the model.
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None or not self._engine_open():
            return super()._load_optimizer_and_scheduler(checkpoint)
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
        optimizer = self._offload_optimizer()
        memplan_dir = os.path.join(checkpoint, MEMPLAN_CHECKPOINT_DIR)
        optimizer_file = os.path.join(checkpoint, OPTIMIZER_NAME)
        if os.path.isdir(memplan_dir):
            self.memplan.load_checkpoint(memplan_dir)
        if os.path.isfile(optimizer_file):
            optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu",
                                                 weights_only=True))
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            with warnings.catch_warnings(record=True):
                self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        return None
