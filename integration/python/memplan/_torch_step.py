"""OffloadedModule's gradients and optimizer step (a private module of memplan.torch): handing
gradients to the engine, the step's options, clipping, loss scaling, step() and zero_grad(), as a
mixin class memplan.torch.OffloadedModule inherits (it uses the fields OffloadedModule.__init__
sets)."""

import logging
import math

import torch

from ._torch_common import _engine_group_options

_log = logging.getLogger("memplan.torch")

# Note [The overlapped optimizer by default]
# offload(overlap_optimizer="auto"), the default, overlaps the optimizer with backward wherever
# that gives the serial step's results, without the loop saying so. A prepared step takes its
# options when its backward hands over the first gradient; a loop may instead decide them after
# backward (clip_grad_norm_, step(lr=...), set_options, a scheduler stepped before the
# optimizer). So "auto" begins "watching": its steps run after backward, and at each one's first
# gradient it records the options a prepared step would have had (_watched). At step() it compares
# them with the options the step is run with (_auto_verdict): equal, or differing only by a
# clip_grad_norm_(X, p) call, it overlaps from the next step on ("overlapping"), declaring the
# clipping (max_grad_norm=X, norm_type=p: the speculated step of the engine's Note [Clipping by the
# global norm]), so that later calls with (X, p) return the norm the overlapped step measured and
# clip as declared. Anything else (keywords to step(), other options, clipping beside parameters
# the engine does not hold) turns it "off": the step after backward, as before. A clip_grad_norm_
# that appears, or changes its arguments, once overlapping began is the same step when neither
# its clipping nor the prepared one changes it (both coefficients 1): the step runs and the new
# clipping is declared from the next (_auto_adapt_clip). What overlapping cannot take, discovered
# after a step was prepared (step() keywords that change an option, other clip_grad_norm_
# arguments where either clipping bites, a step without the declared clipping whose norm would
# clip), drops
# that step (weights, states and step counts as before it), raises ValueError saying to pass
# overlap_optimizer=False, and turns "auto" off. A GradScaler's loss scale is given before
# backward once its first unscale_ named the scaler, so it does not count as a change. The
# optimizer in host memory steps after backward anyway: "auto" is off there from the start.


def _clip_coefficient(max_norm, norm):
    """The engine's ClipCoefficient (torch's clip_grad_norm_ in fp32: reciprocal(norm + 1e-6) *
    max_norm, at most 1; NaN stays NaN)."""
    denominator = torch.tensor(norm, dtype=torch.float32) + 1e-6
    return float(torch.clamp((1.0 / denominator) * float(max_norm), max=1.0))


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
            raise RuntimeError(self._twice_message(entry.name))
        grad = grad.contiguous().reshape(-1)
        self._prepare()
        # The engine's copy waits for torch's stream, where the gradient is being computed.
        self.engine.grad_ready(entry.id, grad, stream=self._stream())
        self._grads_given.add(entry.id)

    @staticmethod
    def _twice_message(name):
        return (f"memplan: gradient of {name} produced twice in one step (a second backward "
                "before step(): call step() after each backward, or set "
                "gradient_accumulation_steps); the step was dropped, run its forward and backward "
                "again")

    def _step_options(self, preparing=False, loss_scale=True):
        """The engine's options of the coming step: the optimizer's (set_options, step keywords),
        each group's, this step's clipping and loss scale (Note [Clipping and loss scaling in
        memplan.torch]). `preparing`: before backward, when the loss scale is the GradScaler's.
        loss_scale=False: without the loss scale (Note [The overlapped optimizer by default])."""
        options = dict(self.optimizer_options)
        if self._options_source is not None:  # an OffloadOptimizer's param_groups, as they are now
            self.group_options = self._options_source()
        if any(self.group_options):
            options["groups"] = [dict(g) for g in self.group_options]
        if self._clip is not None:
            options["max_grad_norm"], options["norm_type"] = self._clip
        scale = self._loss_scale if loss_scale else None
        if (loss_scale and scale is None and preparing and self.grad_scaler is not None and
                self.grad_scaler.is_enabled()):
            scale = float(self.grad_scaler.get_scale())
        if scale is not None:
            options["grad_scale"] = scale * float(options.get("grad_scale", 1.0))
        if self._coefficient is not None and self._coefficient != 1.0:
            options["grad_scale"] = float(options.get("grad_scale", 1.0)) / self._coefficient
        return options

    def _prepare(self):
        """overlap_optimizer: the step's options to the engine before its first gradient; "auto"
        watching: the options such a step would have had (Note [The overlapped optimizer by
        default])."""
        if self.overlap_optimizer and self._prepared is None:
            options = self._step_options(preparing=True)
            self.engine.prepare_step(**options)
            self._prepared = options
        elif self._auto == "watching" and self._watched is None:
            self._watched = self._step_options(preparing=True, loss_scale=False)

    def _auto_verdict(self, step_keywords):
        """"auto" watching, at step(): (True, clipping to declare or None) when this step could
        have been prepared before its backward with the same results, else (False, why)."""
        if step_keywords:
            return False, (f"step() was given {', '.join(sorted(step_keywords))}: options known "
                           "only after backward")
        if self._coefficient is not None:
            return False, ("clip_grad_norm_ over the engine's and other parameters together: "
                           "its coefficient is known only after backward")
        if self._watched is None:
            return None
        watched = dict(self._watched)
        actual = self._step_options(loss_scale=False)
        clip = self._clip
        if clip is not None:
            base = self.optimizer_options.get("max_grad_norm")
            if base is not None and (float(base), float(self.optimizer_options.get(
                    "norm_type", 2.0))) != clip:
                return False, (f"clip_grad_norm_({clip[0]:g}, norm_type={clip[1]:g}) other than "
                               f"the declared max_grad_norm={base:g}")
            watched["max_grad_norm"], watched["norm_type"] = clip
        if watched != actual:
            changed = sorted(k for k in set(watched) | set(actual)
                             if watched.get(k) != actual.get(k))
            return False, f"{', '.join(changed)} changed between backward and step()"
        return True, clip

    def _auto_apply(self, verdict):
        """Acts on _auto_verdict's answer for the steps to come."""
        if verdict is None:
            return
        if not verdict[0]:
            self._auto_off(verdict[1])
            return
        clip = verdict[1]
        self._auto = "overlapping"
        self.overlap_optimizer = True
        if clip is not None and self.optimizer_options.get("max_grad_norm") is None:
            self._auto_declare(clip)
        else:
            self.overlap_reason = "on: every option of a step was known before its backward"
        _log.info("memplan.torch: overlap_optimizer='auto': the optimizer runs beside backward "
                  "from the next step (%s)", self.overlap_reason)

    def _auto_declare(self, clip):
        """"auto": clip_grad_norm_(*clip) after backward declared as the steps' clipping."""
        self.optimizer_options["max_grad_norm"], self.optimizer_options["norm_type"] = clip
        self._auto_clip = clip
        self.overlap_reason = (f"on: every option of a step was known before its backward; "
                               f"clip_grad_norm_({clip[0]:g}, norm_type={clip[1]:g}) after "
                               "backward is declared (max_grad_norm)")

    def _auto_off(self, why):
        """"auto": the coming steps run after backward (the clipping it declared undone)."""
        if self._auto_clip is not None:
            if self.optimizer_options.get("max_grad_norm") == self._auto_clip[0]:
                self.optimizer_options.pop("max_grad_norm", None)
                self.optimizer_options.pop("norm_type", None)
            self._auto_clip = None
        self._auto = "off"
        self.overlap_optimizer = False
        self.overlap_reason = f"off: {why}"
        _log.info("memplan.torch: overlap_optimizer='auto': the optimizer runs after backward "
                  "(%s)", why)

    def _auto_refuse(self, what):
        """"auto" overlapping met what only the step after backward can do: the step is dropped,
        "auto" turned off, and ValueError raised naming `what`."""
        self._abandon()
        self._auto_off(what)
        raise ValueError(
            f"memplan.torch: {what}, after a backward that ran the optimizer beside it: "
            "overlap_optimizer='auto' overlapped this step because the earlier ones gave every "
            "option before backward. The step was dropped (weights and states as before it; run "
            "its forward and backward again, the coming steps run after backward). Pass "
            "overlap_optimizer=False to offload() for this loop, or give the options before "
            "backward (offload(..., max_grad_norm=...), trainer.set_options(...))")

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
        if "max_grad_norm" in options or "norm_type" in options:
            self._auto_clip = None  # the caller's clipping from now on, not "auto"'s
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
                    if self._auto == "overlapping" and self._auto_adapt_clip(norm, declared):
                        return torch.tensor(norm, dtype=torch.float32)
                    if self._auto == "overlapping":
                        self._auto_refuse(f"clip_grad_norm_({float(max_norm):g}, norm_type="
                                          f"{float(norm_type):g}) other than the clipping "
                                          f"declared for the step (max_grad_norm={declared[0]})")
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
            if self._auto == "overlapping":
                self._auto_refuse("clip_grad_norm_ over the engine's and other parameters "
                                  "together")
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
        try:
            if not self._closed:
                self.engine.abandon_step()
        finally:  # the bookkeeping is reset even when the engine's clean-up fails
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
        if self._auto == "overlapping" and self._prepared is not None:
            self._auto_check_clipping()
        self.optimizer_options.update(options)
        step_options = self._step_options()
        verdict = self._auto_verdict(options) if self._auto == "watching" else None
        if self._prepared is not None and self._prepared != step_options:
            changed = sorted(k for k in set(self._prepared) | set(step_options)
                             if self._prepared.get(k) != step_options.get(k))
            if self._auto == "overlapping":
                self._auto_refuse(f"step() changed {', '.join(changed)}")
            try:
                self.engine.step(**step_options)  # refused: the engine drops the step
            except RuntimeError:
                pass
            self._end_step()
            raise ValueError(
                f"memplan.torch: step() changed {', '.join(changed)} after the step's backward "
                "had begun with the old values (overlap_optimizer=True); the step was dropped. "
                "Give new options before the backward: trainer.set_options(...)")
        next_clip = self._auto_next_clip
        try:
            self.engine.step(**step_options)
        finally:
            if self._prepared is not None:
                self._end_step()  # done, or failed and dropped by the engine
        if next_clip is not None and self._auto == "overlapping":
            self._auto_declare(next_clip)
        if self._auto == "overlapping" and options:
            # Equal to the prepared ones this time; a loop that gives step() options may change
            # them at any step, which only the step after backward takes.
            self._auto_off(f"step() was given {', '.join(sorted(options))}: options known only "
                           "after backward")
        self._auto_apply(verdict)
        if self._check_views:
            self._check_views = False  # the first step's forward saw every pattern
            self._view_storages.clear()
            while self._view_checks:  # left by a forward that raised
                self._view_checks.pop().__exit__(None, None, None)
        self._end_step()

    def _auto_adapt_clip(self, norm, declared):
        """"auto" overlapping, a clip_grad_norm_(X, p) other than the clipping the step was
        prepared with (`declared`, (None, ...) for none): when neither changes this step (both
        coefficients 1, so the step is the same bit for bit), the step runs as prepared and (X, p)
        is declared from the next step on; returns whether so. Not over the caller's own
        max_grad_norm, by which steps without a call clip."""
        if self._auto_clip is None and self.optimizer_options.get("max_grad_norm") is not None:
            return False
        if _clip_coefficient(self._clip[0], norm) != 1.0:
            return False
        if declared[0] is not None:
            scale = float(self._step_options().get("grad_scale", 1.0))
            before = self.engine.gradient_norm(float(declared[1]), scale)
            if _clip_coefficient(float(declared[0]), before) != 1.0:
                return False
        self._auto_next_clip = self._clip
        self._clip = None if declared[0] is None else (float(declared[0]), float(declared[1]))
        return True

    def _auto_check_clipping(self):
        """"auto" overlapping, a step without the clip_grad_norm_ call whose clipping "auto"
        declared: the serial step would not clip, so the prepared one may finish only when its
        norm does not clip either (coefficient 1: the same step, bit for bit)."""
        if self._auto_clip is None or self._clip is not None or self._coefficient is not None:
            return
        max_norm, norm_type = self._auto_clip
        scale = float(self._step_options().get("grad_scale", 1.0))
        norm = self.engine.gradient_norm(norm_type, scale)
        if _clip_coefficient(max_norm, norm) != 1.0:
            self._auto_refuse(f"step() without the clip_grad_norm_({max_norm:g}, norm_type="
                              f"{norm_type:g}) of the earlier steps, whose norm ({norm:g}) that "
                              "clipping would have changed")

    def _end_step(self):
        self._watched = None
        self._auto_next_clip = None
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
