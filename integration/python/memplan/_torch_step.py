"""OffloadedModule's gradients and optimizer step (a private module of memplan.torch): handing
gradients to the engine, the step's options, clipping, loss scaling, step() and zero_grad(), as a
mixin class memplan.torch.OffloadedModule inherits (it uses the fields OffloadedModule.__init__
sets)."""

import math

import torch

from ._torch_common import _engine_group_options


class _StepMixin:
    """OffloadedModule's gradients and optimizer step (see the module's docstring)."""

    # ---- gradients and the step ------------------------------------------------------------------

    def _gradient(self, entry, grad):
        if grad.layout != torch.strided:
            raise RuntimeError(f"memplan.torch: the gradient of {entry.name} is sparse "
                               f"({grad.layout}); not supported")
        self._overflow_norm = None  # a new step's backward: an overflow dropped the last one
        grad = grad.detach()
        if grad.dtype != self.dtype:
            grad = grad.to(self.dtype)
        last = self._micro + 1 >= self.accumulation
        summed = self._grad_sums.pop(entry.id, None)
        if summed is not None:
            grad = summed.add_(grad)
        if not last:
            self._grad_sums[entry.id] = grad.clone() if summed is None else grad
            return
        if entry.id in self._grads_given:
            raise RuntimeError(f"memplan: gradient of {entry.name} produced twice in one step "
                               "(a second backward before step(): call step() after each "
                               "backward, or set gradient_accumulation_steps); the step was "
                               "dropped, run its forward and backward again")
        grad = grad.contiguous().reshape(-1)
        self._prepare()
        # The engine's copy waits for torch's stream, where the gradient is being computed.
        self.engine.grad_ready(entry.id, grad, stream=self._stream())
        self._grads_given.add(entry.id)

    def _step_options(self, preparing=False):
        """The engine's options of the coming step: the optimizer's (set_options, step keywords),
        each group's, this step's clipping and loss scale (Note [Clipping and loss scaling in
        memplan.torch]). `preparing`: before backward, when the loss scale is the GradScaler's."""
        options = dict(self.optimizer_options)
        if self._options_source is not None:  # an OffloadOptimizer's param_groups, as they are now
            self.group_options = self._options_source()
        if any(self.group_options):
            options["groups"] = [dict(g) for g in self.group_options]
        if self._clip is not None:
            options["max_grad_norm"], options["norm_type"] = self._clip
        scale = self._loss_scale
        if (scale is None and preparing and self.grad_scaler is not None and
                self.grad_scaler.is_enabled()):
            scale = float(self.grad_scaler.get_scale())
        if scale is not None:
            options["grad_scale"] = scale * float(options.get("grad_scale", 1.0))
        if self._coefficient is not None and self._coefficient != 1.0:
            options["grad_scale"] = float(options.get("grad_scale", 1.0)) / self._coefficient
        return options

    def _prepare(self):
        """overlap_optimizer: the step's options to the engine before its first gradient."""
        if self.overlap_optimizer and self._prepared is None:
            options = self._step_options(preparing=True)
            self.engine.prepare_step(**options)
            self._prepared = options

    def _flush_pending(self):
        """Gives the engine what this step's backward left in Python: the summed gradients of
        parameters without one in the last micro-batch, and "no gradient" for those without any
        (skipped as torch's optimizers skip a parameter whose grad is None)."""
        if self._micro < self.accumulation:
            raise RuntimeError(f"memplan: step() after {self._micro} backward passes; "
                               f"gradient_accumulation_steps is {self.accumulation}")
        self._prepare()
        for entry in self.params:
            if entry.id not in self._grads_given and not entry.frozen:
                grad = self._grad_sums.pop(entry.id, None)
                if grad is None:
                    self.engine.no_gradient(entry.id)
                else:
                    self.engine.grad_ready(entry.id, grad.contiguous().reshape(-1),
                                           stream=self._stream())
                self._grads_given.add(entry.id)

    def set_options(self, **options):
        """Overrides optimizer options (lr, grad_scale, max_grad_norm, norm_type, ...) for the
        coming steps; ``groups=[{...}, ...]`` replaces the per-group options (one dict per
        parameter group, torch.optim's keys: lr, weight_decay, betas, eps). With
        overlap_optimizer a step's options are taken when its backward hands the first gradient
        over: call this before the backward of the first step they are for."""
        self._check_open()
        if "groups" in options:
            groups = options.pop("groups")
            if len(groups) != len(self.group_options):
                raise ValueError(f"memplan.torch: {len(groups)} groups given; the parameters are "
                                 f"in {len(self.group_options)}")
            self.group_options = [_engine_group_options(dict(g), self.optimizer_kind,
                                                        f"groups[{i}]")
                                  for i, g in enumerate(groups)]
        if options.get("max_grad_norm") == 0:
            options.pop("max_grad_norm")
            self.optimizer_options.pop("max_grad_norm", None)
        self.optimizer_options.update(options)

    def gradient_norm(self, norm_type=2.0):
        """The global norm of this step's gradients (after the step's last backward, every rank
        calling it: a collective), divided by the loss scale a GradScaler's unscale_ reported."""
        self._check_open()
        if self._overflow_norm is not None:
            return self._overflow_norm
        self._flush_pending()
        return self.engine.gradient_norm(float(norm_type), self._loss_scale or 1.0)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ over the module's parameters (what the patched
        torch.nn.utils.clip_grad_norm_ calls for them): returns the gradients' global norm (over
        every rank; a collective) as a float32 tensor, and clips this step's gradients by
        min(1, max_norm / (norm + 1e-6)) in its step(), as torch would have clipped them. After
        the step's last backward, before step(). max_norm inf: the norm only, nothing clipped.
        With overlap_optimizer, clipping must be declared before backward
        (``offload(..., max_grad_norm=...)`` or ``set_options(max_grad_norm=...)``)."""
        norm = self.gradient_norm(norm_type)
        self.last_grad_norm = norm
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        if self._overflow_norm is None and float(max_norm) != float("inf"):
            self._clip = (float(max_norm), float(norm_type))
            if self._prepared is not None:
                declared = (self._prepared.get("max_grad_norm"), self._prepared.get("norm_type", 2))
                if declared[0] is None or (float(declared[0]), float(declared[1])) != self._clip:
                    self._abandon()
                    raise ValueError(
                        f"memplan.torch: clip_grad_norm_({max_norm}, norm_type={norm_type}) after "
                        "a backward that ran the optimizer beside it (overlap_optimizer=True) "
                        f"without that clipping declared (max_grad_norm={declared[0]}); the step "
                        "was dropped. Declare it before backward: offload(..., max_grad_norm=...) "
                        "or trainer.set_options(max_grad_norm=...)")
        return torch.tensor(norm, dtype=torch.float32)

    def _check_clip_parameters(self, given):
        """clip_grad_norm_ on this module's parameters must name all of them that train (the
        engine's norm is over all)."""
        ids = {id(p) for p in given}
        left_out = [e.name for e in self.params if not e.frozen and id(e.param) not in ids]
        if left_out:
            raise ValueError(
                f"memplan.torch: clip_grad_norm_ over part of an offloaded module's parameters "
                f"({left_out[0]} and {len(left_out) - 1} more left out); the engine clips all of "
                "them together: pass model.parameters()")

    def _clip_by(self, coefficient):
        """Clipping beside parameters the engine does not hold: this step's coefficient, computed
        over all of them."""
        if self._prepared is not None and coefficient != 1.0:
            self._abandon()
            raise ValueError("memplan.torch: clip_grad_norm_ over engine and other parameters "
                             "together needs the optimizer after backward (overlap_optimizer="
                             "False); the step was dropped")
        self._coefficient = float(coefficient)

    def _unscale(self, scale, scaler):
        """A GradScaler's unscale_ (Note [What memplan.torch patches]): this step's gradients carry
        loss scale `scale`; returns whether one of them overflowed (inf or NaN), in which case the
        step is dropped now (the scaler skips step() and lowers its scale)."""
        self._check_open()
        if self.grad_scaler is None:
            self.grad_scaler = scaler  # its scale is known before the next backward
        self._flush_pending()
        norm = self.engine.gradient_norm(2.0, scale)
        self._loss_scale = scale
        if math.isfinite(norm):
            return False
        self._abandon()
        self._overflow_norm = norm
        return True

    def use_grad_scaler(self, scaler):
        """The torch GradScaler whose scale the coming steps' losses are multiplied by: with
        overlap_optimizer, the engine is then given that scale before backward (without it the
        first step's scale is learnt only at unscale_)."""
        self.grad_scaler = scaler

    def _abandon(self):
        """Drops the step in progress (Note [A step that raised]): the engine's gradients and
        prepared work, what backward still holds fetched, this step's bookkeeping."""
        while self._view_checks:
            self._view_checks.pop().__exit__(None, None, None)
        for unit in self.units:
            unit.pending = 0
            self._release_backward(unit)
        self._callback_queued = False
        if not self._closed:
            self.engine.abandon_step()
        self._end_step()

    def step(self, **options):
        """One optimizer step with the schedule's optimizer; keywords override the options given
        at creation for this and later steps (lr for a schedule, grad_scale for loss scaling).
        This step's clip_grad_norm_ and a GradScaler's loss scale apply too. With
        overlap_optimizer the step was prepared with the options in effect when its backward
        began: keywords that change them raise ValueError, and the step is dropped (weights,
        states and step counts as before it; run its forward and backward again)."""
        self._check_open()
        if self._overflow_norm is not None:
            # A GradScaler found an overflow at unscale_: the step was dropped there.
            self._end_step()
            return
        self._flush_pending()
        self.optimizer_options.update(options)
        step_options = self._step_options()
        if self._prepared is not None and self._prepared != step_options:
            changed = sorted(k for k in set(self._prepared) | set(step_options)
                             if self._prepared.get(k) != step_options.get(k))
            try:
                self.engine.step(**step_options)  # refused: the engine drops the step
            except RuntimeError:
                pass
            self._end_step()
            raise ValueError(
                f"memplan.torch: step() changed {', '.join(changed)} after the step's backward "
                "had begun with the old values (overlap_optimizer=True); the step was dropped. "
                "Give new options before the backward: trainer.set_options(...)")
        try:
            self.engine.step(**step_options)
        finally:
            if self._prepared is not None:
                self._end_step()  # done, or failed and dropped by the engine
        if self._check_views:
            self._check_views = False  # the first step's forward saw every pattern
            self._view_storages.clear()
            while self._view_checks:  # left by a forward that raised
                self._view_checks.pop().__exit__(None, None, None)
        self._end_step()

    def _end_step(self):
        self._grads_given.clear()
        self._grad_sums.clear()
        self._micro = 0
        self._prepared = None
        self._clip = None
        self._loss_scale = None
        self._coefficient = None
        self._overflow_norm = None

    def zero_grad(self, set_to_none=True):
        """Gradients never stay on the parameters; a step in progress (gradients given since the
        last step) is dropped, as torch's zero_grad drops the gradients it would have used."""
        if self._closed:
            return
        if self._micro > 0 or self._grads_given or self._grad_sums or self._prepared is not None:
            self._abandon()
