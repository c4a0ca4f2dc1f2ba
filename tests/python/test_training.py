"""A trainer author's day with memplan.torch (issue 31) and the adapter's reliability (issue 30):
clipping by the global norm (torch's clip_grad_norm_, on and off the overlapped optimizer),
parameter groups, mixed precision, the module's state_dict and load_state_dict, the optimizer's
state in torch's form and in checkpoint files, a step that raised, and the inputs and stores the
engine refuses. Each test holds the engine to plain torch on the same model and data."""
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
import warnings

import torch
from torch import nn

import memplan
import memplan.torch
from training_fixtures import data, loss_of, mlp


def reference(model, batches, groups=None, max_norm=None, norm_type=2.0, lr=1e-2,
              weight_decay=0.01, lrs=None):
    """torch.optim.AdamW (with torch's clip_grad_norm_) over `batches`: (losses, norms)."""
    params = groups if groups is not None else model.parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses, norms = [], []
    for i, batch in enumerate(batches):
        if lrs is not None:
            for group, group_lr in zip(opt.param_groups, lrs[i]):
                group["lr"] = group_lr
        loss = loss_of(model, batch)
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                                               norm_type)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class ClippingTest(unittest.TestCase):
    """Issue 31 item 3: clip_grad_norm_ works (torch's semantics, global norm) or raises."""

    def check_against_torch(self, norm_type, path=None, overlap=False, declared=False):
        batches = data(8, scale=3.0)
        ref = mlp()
        # Between the middle two unclipped norms as max_norm: clipping is active on some steps,
        # not on others.
        probe = mlp()
        _, probe_norms = reference(probe, batches, max_norm=float("inf"), norm_type=norm_type)
        middle = sorted(probe_norms)[len(probe_norms) // 2 - 1:len(probe_norms) // 2 + 1]
        max_norm = sum(middle) / 2
        ref_losses, ref_norms = reference(ref, batches, max_norm=max_norm, norm_type=norm_type)
        model = mlp()
        kwargs = dict(lr=1e-2, weight_decay=0.01, direct=False, sub_group_elements=1024,
                      overlap_optimizer=overlap)
        if declared:
            kwargs.update(max_grad_norm=max_norm, norm_type=norm_type)
        trainer = memplan.torch.offload(model, path, **kwargs)
        losses, norms, clipping = [], [], []
        for batch in batches:
            loss = loss_of(model, batch)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                                               norm_type)))
            trainer.step()
            losses.append(loss.item())
            clipping.append(trainer.stats()["step_profile"]["clipping"])
        got = trainer.master_weights()
        trainer.close()
        active = sum(n + 1e-6 > max_norm for n in ref_norms)
        self.assertTrue(0 < active < len(ref_norms), ref_norms)
        for a, b in zip(norms, ref_norms):
            self.assertAlmostEqual(a, b, delta=1e-5 * max(1.0, b))
        self.assertLess(max(abs(a - b) for a, b in zip(losses, ref_losses)), 1e-5)
        for name, p in ref.named_parameters():
            self.assertLess((got[name] - p.detach()).abs().max().item(), 1e-5, name)
        return clipping, ref_norms, max_norm

    def test_clip_grad_norm_matches_torch_in_host_memory(self):
        for norm_type in (2.0, 1.0, float("inf")):
            with self.subTest(norm_type=norm_type):
                self.check_against_torch(norm_type)

    def test_overlapped_optimizer_with_clipping_speculates_and_redoes(self):
        # Note [Clipping by the global norm]: a step that may clip runs beside backward
        # unclipped; when its norm says it must clip it is redone from the kept gradients, and
        # the step after a clipped one waits for the norm. Results: torch's.
        with tempfile.TemporaryDirectory() as tmp:
            clipping, norms, max_norm = self.check_against_torch(
                2.0, path=os.path.join(tmp, "swap"), overlap=True, declared=True)
        for kind, norm, previous in zip(clipping, norms, [0.0] + norms[:-1]):
            # torch clips (by a coefficient < 1) when max_norm / (norm + 1e-6) < 1.
            if previous + 1e-6 > max_norm:
                self.assertEqual(kind, "deferred")
            else:
                self.assertEqual(kind, "redone" if norm + 1e-6 > max_norm else "speculated")
        self.assertIn("speculated", clipping)
        self.assertIn("redone", clipping)

    def test_declared_clipping_without_a_call_clips_every_step(self):
        batches = data(4, scale=3.0)
        ref = mlp()
        ref_losses, _ = reference(ref, batches, max_norm=0.5)
        model = mlp()
        trainer = memplan.torch.offload(model, lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
        losses = []
        for batch in batches:
            loss = loss_of(model, batch)
            loss.backward()
            trainer.step()
            losses.append(loss.item())
            self.assertGreater(trainer.stats()["last_grad_norm"], 0.5)
            self.assertLess(trainer.stats()["last_clip_coefficient"], 1.0)
        trainer.close()
        self.assertLess(max(abs(a - b) for a, b in zip(losses, ref_losses)), 1e-5)

    def test_a_non_finite_gradient_is_clipped_as_torch_clips_it_or_refused(self):
        model = mlp()
        trainer = memplan.torch.offload(model, lr=1e-2)
        x, y = data(1)[0]
        loss_of(model, (x, y * float("nan"))).backward()
        with self.assertRaisesRegex(RuntimeError, "non-finite"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.assertTrue(math.isnan(float(norm)))
        trainer.step()  # torch: every gradient times NaN, every weight NaN
        self.assertTrue(all(torch.isnan(w).all() for w in trainer.master_weights().values()))
        trainer.close()

    def test_clipping_part_of_the_parameters_is_refused_and_others_join_the_norm(self):
        model = mlp()
        extra = nn.Linear(4, 4)
        ref, ref_extra = mlp(), nn.Linear(4, 4)
        ref_extra.load_state_dict(extra.state_dict())
        trainer = memplan.torch.offload(model, lr=1e-2)
        x, y = data(1)[0]
        for m, e in ((model, extra), (ref, ref_extra)):
            nn.functional.mse_loss(e(m(x)), y).backward()
        with self.assertRaisesRegex(ValueError, "part of an offloaded module"):
            torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)
        got = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(extra.parameters()),
                                             0.1)
        want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()) +
                                              list(ref_extra.parameters()), 0.1)
        self.assertAlmostEqual(float(got), float(want), delta=1e-5 * float(want))
        self.assertTrue(torch.allclose(extra.weight.grad, ref_extra.weight.grad, atol=1e-7))
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt.step()
        trainer.step()
        for name, w in trainer.master_weights().items():
            self.assertLess((w - dict(ref.named_parameters())[name].detach()).abs().max(), 1e-5)
        trainer.close()


class GroupsTest(unittest.TestCase):
    """Issue 31 item 6: parameter groups as torch.optim takes them, in the engine."""

    def groups_of(self, model):
        decay = [p for n, p in model.named_parameters() if n.endswith("weight") and
                 not n.startswith("3.")]
        rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and
                                                               not n.startswith("3."))]
        return [{"params": decay, "weight_decay": 0.1, "lr": 2e-2},
                {"params": rest, "weight_decay": 0.0}]

    def test_groups_and_per_group_learning_rates_match_torch(self):
        batches = data(6)
        lrs = [(1e-2 * (i + 1), 5e-3 / (i + 1)) for i in range(6)]
        ref = mlp()
        ref_losses, _ = reference(ref, batches, groups=self.groups_of(ref), lrs=lrs)
        for path in (None, "nvme"):
            with self.subTest(path=path), tempfile.TemporaryDirectory() as tmp:
                model = mlp()
                trainer = memplan.torch.offload(
                    model, path and os.path.join(tmp, path), lr=1e-2, weight_decay=0.01,
                    param_groups=self.groups_of(model), direct=False, sub_group_elements=1024)
                self.assertEqual(trainer.stats()["groups"], 2)
                losses = []
                for batch, (lr0, lr1) in zip(batches, lrs):
                    trainer.set_options(groups=[{"lr": lr0, "weight_decay": 0.1},
                                                {"lr": lr1, "weight_decay": 0.0}])
                    loss = loss_of(model, batch)
                    loss.backward()
                    trainer.step()
                    losses.append(loss.item())
                got = trainer.master_weights()
                trainer.close()
                self.assertLess(max(abs(a - b) for a, b in zip(losses, ref_losses)), 1e-6)
                for name, p in ref.named_parameters():
                    self.assertLess((got[name] - p.detach()).abs().max().item(), 1e-6, name)

    def test_bad_groups_are_refused_naming_the_parameter(self):
        model = mlp()
        params = list(model.parameters())
        with self.assertRaisesRegex(ValueError, "in no param group"):
            memplan.torch.offload(model, param_groups=[{"params": params[:-1]}])
        with self.assertRaisesRegex(ValueError, "one group"):
            memplan.torch.offload(model, param_groups=[{"params": params},
                                                       {"params": params[:1]}])
        with self.assertRaisesRegex(ValueError, "unknown option 'momentum'"):
            memplan.torch.offload(model, param_groups=[{"params": params, "momentum": 0.9}])
        with self.assertRaisesRegex(ValueError, "amsgrad"):
            memplan.torch.offload(model, param_groups=[{"params": params, "amsgrad": True}])
        # Nothing was left half offloaded: the module trains normally.
        self.assertEqual(params[0].numel(), 16 * 32)


class MixedPrecisionTest(unittest.TestCase):
    """Issue 31 item 1: torch.autocast through the engine's parameters, forward and backward."""

    def test_bf16_autocast_matches_plain_torch(self):
        batches = data(5)

        def mlp():  # torch 1.13's CPU autocast has no bf16 layer_norm
            torch.manual_seed(1)
            return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Linear(32, 4))

        def run(model, step):
            losses = []
            for batch in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_of(model, batch)
                loss.backward()
                step()
                losses.append(loss.item())
            return losses

        ref = mlp()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

        def ref_step():
            opt.step()
            opt.zero_grad()

        want = run(ref, ref_step)
        model = mlp()
        trainer = memplan.torch.offload(model, lr=1e-2)
        got = run(model, trainer.step)
        trainer.close()
        self.assertLess(max(abs(a - b) for a, b in zip(got, want)), 2e-3)
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            self.assertEqual(q.dtype, torch.float32)
            self.assertLess((p.detach() - q.detach()).abs().max().item(), 2e-2, name)


class StateDictTest(unittest.TestCase):
    """Issue 31 items 2 and 7: real tensors or an error, loading into a running engine, torch's
    optimizer state, checkpoint files and their consolidation."""

    def trained(self, path=None, steps=3):
        model = mlp()
        trainer = memplan.torch.offload(model, path, lr=1e-2, direct=False,
                                        sub_group_elements=1024)
        for batch in data(steps):
            loss_of(model, batch).backward()
            trainer.step()
        return model, trainer

    def test_the_modules_own_state_dict_holds_the_weights(self):
        model, trainer = self.trained()
        state = model.state_dict()
        master = trainer.master_weights()
        for name, t in state.items():
            self.assertEqual(tuple(t.shape), tuple(master[name].shape), name)
            self.assertTrue(torch.equal(t, master[name]), name)
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(model.state_dict(), os.path.join(tmp, "m.pt"))
            fresh = mlp(seed=5)
            fresh.load_state_dict(torch.load(os.path.join(tmp, "m.pt")))
            x = data(1)[0][0]
            self.assertTrue(torch.allclose(fresh(x), model(x)))
        trainer.close()

    def test_load_state_dict_into_a_running_engine_keeps_the_optimizer(self):
        model, trainer = self.trained()
        other = mlp(seed=9)
        moments = trainer.optimizer_state_dict()["state"]
        result = model.load_state_dict(other.state_dict())  # the module's own, into the engine
        self.assertEqual((result.missing_keys, result.unexpected_keys), ([], []))
        for name, w in trainer.master_weights().items():
            self.assertTrue(torch.equal(w, dict(other.named_parameters())[name].detach()), name)
        after = trainer.optimizer_state_dict()["state"]
        for i in moments:
            self.assertTrue(torch.equal(moments[i]["exp_avg"], after[i]["exp_avg"]))
        x, y = data(1)[0]
        self.assertTrue(torch.allclose(model(x), other(x)))
        bad = other.state_dict()
        bad["0.weight"] = torch.zeros(3, 3)
        with self.assertRaisesRegex(RuntimeError, "size mismatch for 0.weight"):
            model.load_state_dict(bad)
        partial = {"0.bias": torch.ones(32)}
        with self.assertRaisesRegex(RuntimeError, "Missing key"):
            trainer.load_state_dict(partial)
        result = trainer.load_state_dict(partial, strict=False)
        self.assertIn("0.weight", result.missing_keys)
        self.assertTrue(torch.equal(trainer.master_weights()["0.bias"], torch.ones(32)))
        self.assertTrue(torch.equal(trainer.master_weights()["0.weight"],
                                    other.state_dict()["0.weight"]))
        trainer.close()

    def test_optimizer_state_is_torchs_and_loads_into_a_fresh_engine(self):
        for path in (None, "nvme"):
            with self.subTest(path=path), tempfile.TemporaryDirectory() as tmp:
                where = path and os.path.join(tmp, path)
                ref = mlp()
                opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
                batches = data(5)
                for batch in batches[:3]:
                    loss_of(ref, batch).backward()
                    opt.step()
                    opt.zero_grad()
                model, trainer = self.trained(where)
                state = trainer.optimizer_state_dict()
                torch_state = opt.state_dict()
                self.assertEqual(sorted(state["state"]), sorted(torch_state["state"]))
                for i, item in torch_state["state"].items():
                    self.assertEqual(float(state["state"][i]["step"]), float(item["step"]))
                    for key in ("exp_avg", "exp_avg_sq"):
                        self.assertLess((state["state"][i][key] - item[key]).abs().max(), 1e-6)
                # A torch AdamW state (and weights) continue in a fresh engine as in torch.
                fresh = mlp(seed=3)
                trainer.close()
                again = memplan.torch.offload(fresh, where and where + "2", lr=1e-2,
                                              direct=False)
                again.load_state_dict(ref.state_dict())
                again.load_optimizer_state_dict(torch_state)
                for batch in batches[3:]:
                    loss_of(fresh, batch).backward()
                    again.step()
                    loss_of(ref, batch).backward()
                    opt.step()
                    opt.zero_grad()
                for name, w in again.master_weights().items():
                    self.assertLess((w - dict(ref.named_parameters())[name].detach()).abs().max(),
                                    1e-6)
                again.close()

    def test_checkpoint_files_resume_exactly_and_consolidate(self):
        batches = data(6)
        for path in (None, "nvme"):
            with self.subTest(path=path), tempfile.TemporaryDirectory() as tmp:
                where = path and os.path.join(tmp, path)
                whole, trainer = self.trained(where, steps=0)
                for batch in batches:
                    loss_of(whole, batch).backward()
                    trainer.step()
                want = trainer.master_weights()
                trainer.close()
                model, trainer = self.trained(where and where + "a", steps=0)
                for batch in batches[:3]:
                    loss_of(model, batch).backward()
                    trainer.step()
                ckpt = os.path.join(tmp, "missing", "parents", "ckpt")
                trainer.save_checkpoint(ckpt)
                self.assertEqual(sorted(os.listdir(ckpt)),
                                 ["memplan-checkpoint.json", "rank0-of-1.safetensors"])
                trainer.close()
                fresh = mlp(seed=4)
                again = memplan.torch.offload(fresh, where and where + "b", lr=1e-2,
                                              direct=False, sub_group_elements=1024)
                again.load_checkpoint(ckpt)
                for batch in batches[3:]:
                    loss_of(fresh, batch).backward()
                    again.step()
                got = again.master_weights()
                again.close()
                for name in want:
                    self.assertTrue(torch.equal(got[name], want[name]), name)
                whole16 = memplan.torch.consolidate_checkpoint(ckpt, os.path.join(tmp, "out"),
                                                               dtype=torch.bfloat16)
                self.assertEqual(whole16["0.weight"].dtype, torch.bfloat16)
                self.assertTrue(os.path.exists(os.path.join(tmp, "out", "model.safetensors")))

    def test_checkpoint_of_another_model_is_refused_before_loading(self):
        model, trainer = self.trained()
        with tempfile.TemporaryDirectory() as tmp:
            trainer.save_checkpoint(tmp)
            trainer.close()
            other = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
            fresh = memplan.torch.offload(other, lr=1e-2)
            before = fresh.master_weights()
            with self.assertRaisesRegex(ValueError, "2.weight is"):
                fresh.load_checkpoint(tmp)
            for name, w in fresh.master_weights().items():
                self.assertTrue(torch.equal(w, before[name]))
            with self.assertRaises(FileNotFoundError):
                fresh.load_checkpoint(os.path.join(tmp, "nothing-here"))
            fresh.close()

    def test_sixteen_bit_export(self):
        model, trainer = self.trained()
        with tempfile.TemporaryDirectory() as tmp:
            trainer.save(tmp, dtype=torch.bfloat16)
            from safetensors.torch import load_file
            saved = load_file(os.path.join(tmp, "model.safetensors"))
            self.assertEqual(saved["0.weight"].dtype, torch.bfloat16)
            self.assertTrue(torch.equal(saved["0.weight"],
                                        trainer.master_weights()["0.weight"].bfloat16()))
        trainer.close()


class RaisedStepTest(unittest.TestCase):
    """Issue 31 item 5: an exception in one step leaves the engine usable for the next."""

    def test_a_second_backward_drops_the_step_and_the_next_is_healthy(self):
        batches = data(4)
        ref = mlp()
        # The reference never sees batch 1 (its step was dropped).
        ref_losses, _ = reference(ref, [batches[0]] + batches[2:])
        for path in (None, "nvme"):
            with self.subTest(path=path), tempfile.TemporaryDirectory() as tmp:
                model = mlp()
                trainer = memplan.torch.offload(model, path and os.path.join(tmp, path), lr=1e-2,
                                                weight_decay=0.01, direct=False)
                losses = []
                for i, batch in enumerate(batches):
                    loss = loss_of(model, batch)
                    if i == 1:
                        loss.backward(retain_graph=True)
                        with self.assertRaisesRegex(RuntimeError, "produced twice.*dropped"):
                            loss.backward()
                        continue
                    loss.backward()
                    trainer.step()
                    losses.append(loss.item())
                trainer.close()
                self.assertLess(max(abs(a - b) for a, b in zip(losses, ref_losses)), 1e-6)

    def test_a_forward_that_raised_and_zero_grad_leave_nothing_behind(self):
        batches = data(3)
        ref = mlp()
        ref_losses, _ = reference(ref, batches)
        model = mlp()
        trainer = memplan.torch.offload(model, lr=1e-2, weight_decay=0.01)
        with self.assertRaises(RuntimeError):
            model(torch.randn(2, 5))  # a bad batch: the first Linear raises
        loss_of(model, batches[0]).backward()
        trainer.zero_grad()  # drops that step, as torch drops the gradients
        losses = []
        for batch in batches:
            loss = loss_of(model, batch)
            loss.backward()
            trainer.step()
            losses.append(loss.item())
        self.assertLess(max(abs(a - b) for a, b in zip(losses, ref_losses)), 1e-6)
        self.assertEqual(trainer.stats()["param"]["live_bytes"], 0)
        trainer.close()


class RefusedTest(unittest.TestCase):
    """Issue 30 M1, M2, L3, L4: what the engine cannot represent is refused naming the parameter,
    or kept exact; misuse says what to do."""

    def test_frozen_integer_and_bool_parameters_stay_exact(self):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model.register_parameter("ids", nn.Parameter(torch.tensor([2 ** 24 + 1, 7]),
                                                     requires_grad=False))
        model.register_parameter("q", nn.Parameter(torch.tensor([1, 2, 255], dtype=torch.uint8),
                                                   requires_grad=False))
        model.register_parameter("mask", nn.Parameter(torch.tensor([True, False]),
                                                      requires_grad=False))
        trainer = memplan.torch.offload(model, lr=1e-2)
        self.assertEqual([n for n, _ in trainer.kept], ["ids", "q", "mask"])
        model(torch.randn(2, 8)).sum().backward()
        trainer.step()
        self.assertEqual(model.ids.dtype, torch.int64)
        self.assertEqual(int(model.ids[0]), 2 ** 24 + 1)
        self.assertEqual(model.q.tolist(), [1, 2, 255])
        self.assertIn("ids", model.state_dict())
        trainer.close()
        self.assertEqual(int(model.ids[0]), 2 ** 24 + 1)
        self.assertEqual(model.q.dtype, torch.uint8)

    def test_unrepresentable_trainable_parameters_are_refused_naming_them(self):
        cases = []
        m = nn.Linear(4, 4)
        m.register_parameter("z", nn.Parameter(torch.zeros(3, dtype=torch.complex64)))
        cases.append((m, "z is a complex parameter"))
        m = nn.Linear(4, 4).double()
        cases.append((m, "weight is a float64 parameter"))
        cases.append((nn.Embedding(10, 4, sparse=True), "sparse=True"))
        cases.append((nn.EmbeddingBag(10, 4, sparse=True), r"nn.EmbeddingBag\(sparse=True\)"))
        for module, message in cases:
            with self.subTest(message=message):
                with self.assertRaisesRegex(ValueError, message):
                    memplan.torch.offload(module)
                # Refused before anything changed.
                self.assertNotEqual(next(module.parameters()).numel(), 0)

    def test_parameters_replaced_or_reassigned_after_offload_are_refused(self):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        trainer = memplan.torch.offload(model, lr=1e-2)
        model(torch.randn(2, 8)).sum().backward()
        trainer.step()
        model[2].weight = nn.Parameter(torch.randn(4, 16))
        with self.assertRaisesRegex(RuntimeError, "2.weight was replaced after offload"):
            model(torch.randn(2, 8))
        trainer.close()
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        trainer = memplan.torch.offload(model, lr=1e-2)
        model[0].weight.data = torch.randn(16, 8) * 100
        with self.assertRaisesRegex(RuntimeError, r"0.weight.data was assigned.*load_state_dict"):
            model(torch.randn(2, 8))
        model[0].weight.data = torch.empty(0)
        trainer.close()
        # A whole submodule replaced, or one added, holds Parameters no hook of the engine sees:
        # refused at the root's next forward, naming it; a frozen one added is let be.
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        trainer = memplan.torch.offload(model, lr=1e-2)
        model[2] = nn.Linear(16, 4)
        with self.assertRaisesRegex(RuntimeError, r"module 2 \(Linear\) was replaced or added "
                                                  r"after offload\(\); 2.weight is not the engine"):
            model(torch.randn(2, 8))
        trainer.close()
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        trainer = memplan.torch.offload(model, lr=1e-2)
        model[1].scale = nn.Parameter(torch.ones(16))
        with self.assertRaisesRegex(RuntimeError, "parameter 1.scale was added or replaced"):
            model(torch.randn(2, 8))
        model[1].scale.requires_grad_(False)
        model(torch.randn(2, 8)).sum().backward()  # frozen: nothing would have trained it
        trainer.step()
        trainer.close()

    def test_misuse_messages_say_what_happened(self):
        model = mlp()
        trainer = memplan.torch.offload(model, lr=1e-2)
        with self.assertRaisesRegex(ValueError, "offloaded already"):
            memplan.torch.offload(model)
        trainer.close()
        with self.assertRaisesRegex(RuntimeError, "closed"):
            trainer.step()
        with self.assertRaisesRegex(ValueError, "path is empty"):
            memplan.torch.offload(mlp(), path="")
        with self.assertRaisesRegex(ValueError, "^schedule: nvme.path"):
            memplan.Engine({"version": 1, "params": {"tier": "nvme"}})

    def test_a_schedule_for_sgd_trains_sgd_with_momentum(self):
        batches = data(4)
        ref = mlp()
        opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
        for batch in batches:
            loss_of(ref, batch).backward()
            opt.step()
            opt.zero_grad()
        model = mlp()
        schedule = memplan.schedule(param_tier="cpu", optimizer_tier="cpu", optimizer="sgd")
        trainer = memplan.torch.offload(model, schedule=schedule, lr=1e-2, weight_decay=0.0)
        for batch in batches:
            loss_of(model, batch).backward()
            trainer.step()
        for name, w in trainer.master_weights().items():
            self.assertLess((w - dict(ref.named_parameters())[name].detach()).abs().max(), 1e-6)
        trainer.close()
        with self.assertRaisesRegex(ValueError, "sgd, which has no betas"):
            memplan.torch.offload(mlp(), schedule=schedule, betas=(0.9, 0.99))
        # A schedule file is read as the library reads JSON: a repeated key is refused, naming it
        # (issue 30 L5: Python's json kept the last "name", and trained Adam).
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.json")
            with open(path, "w") as f:
                f.write('{"version":1,"params":{"tier":"cpu"},'
                        '"optimizer":{"tier":"cpu","name":"sgd","name":"adam"}}')
            with self.assertRaisesRegex(ValueError, "s.json: key 'name' appears twice"):
                memplan.torch.offload(mlp(), schedule=path)


class Net(nn.Module):
    def __init__(self, order, sizes=None):
        super().__init__()
        for n in order:
            setattr(self, n, nn.Linear(*(sizes or {}).get(n, (8, 8))))

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(x)))


class StoresTest(unittest.TestCase):
    """Issue 30 H3 and L2, issue 31 item 9: a store records what it holds; I/O errors are
    OSError with their errno; paths are created; one process reuses a path."""

    def train(self, model, path, steps=2, **kwargs):
        trainer = memplan.torch.offload(model, path, lr=1e-2, direct=False, **kwargs)
        for _ in range(steps):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            trainer.step()
        return trainer

    def test_a_resume_with_another_registration_is_refused_naming_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "st")
            self.train(Net(["enc", "dec"]), path).close()
            cases = [
                (Net(["dec", "enc"]), r"#0 is 'enc.weight'.*and 'dec.weight'"),   # reordered
                (nn.Sequential(nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 8)),
                 r"#0 is 'enc.weight'.* and '0.weight'"),                            # renamed
                (Net(["enc", "dec"], {"enc": (8, 4)}), r"shape \[8, 8\].*shape \[4, 8\]"),
                (Net(["enc", "dec"]).half(), "torch.float32.*torch.float16"),       # dtype
            ]
            frozen = Net(["enc", "dec"])
            frozen.enc.bias.requires_grad_(False)
            cases.append((frozen, "trainable.*frozen"))
            single = nn.Linear(17, 8)  # 144 elements, as Net's two layers
            cases.append((single, r"#0 is 'enc.weight' \(shape \[8, 8\].*'weight' \(shape \[8, 17\]"))
            more = Net(["enc", "dec", "extra"])
            cases.append((more, "holds 4 parameters; this model registers 6, the first extra one "
                                "'extra.weight'"))
            for model, message in cases:
                with self.subTest(message=message):
                    with self.assertRaisesRegex(ValueError, "resume refused: .*" + message):
                        memplan.torch.offload(model, path, lr=1e-2, direct=False, resume=True)
            # The same registration resumes (the neighbour that must keep working).
            trainer = memplan.torch.offload(Net(["enc", "dec"]), path, lr=1e-2, direct=False,
                                            resume=True)
            self.assertEqual(trainer.resumed_step, 2)
            trainer.close()

    def test_io_failures_are_os_errors_with_their_errno(self):
        import shutil
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "st")
            model = Net(["enc", "dec"])
            trainer = self.train(model, path, steps=1)
            self.assertTrue(trainer.overlap_optimizer)  # "auto" overlaps from the second step
            shutil.rmtree(os.path.join(path, "optimizer"))
            with self.assertRaises(OSError) as caught:
                # The overlapped step begins at backward's first gradient: its I/O error surfaces
                # there (with overlap_optimizer=False, at step()).
                model(torch.randn(4, 8)).pow(2).mean().backward()
                trainer.step()
            self.assertNotIsInstance(caught.exception, (KeyError, ValueError))
            with self.assertRaises(OSError):  # the weights cannot be read back either
                trainer.close()
            self.assertTrue(trainer._closed)
        with tempfile.TemporaryDirectory() as tmp:
            # The parameter store's directory removed: its open files still serve the steps, and
            # close() says the directory is gone with its errno (FileNotFoundError), not a
            # RuntimeError.
            path = os.path.join(tmp, "st")
            model = Net(["enc", "dec"])
            trainer = self.train(model, path, steps=1)
            shutil.rmtree(os.path.join(path, "params"))
            model(torch.randn(4, 8)).pow(2).mean().backward()
            trainer.step()
            with self.assertRaisesRegex(FileNotFoundError, "params: the directory was removed"):
                trainer.close()
            self.assertTrue(trainer._closed)
        with tempfile.TemporaryDirectory() as tmp:
            # The parameters' data file truncated between steps: data lost, an OSError.
            path = os.path.join(tmp, "st")
            model = Net(["enc", "dec"])
            trainer = self.train(model, path, steps=1)
            os.truncate(os.path.join(path, "params", "memplan-swap.data"), 0)
            with self.assertRaisesRegex(OSError, "truncated"):
                model(torch.randn(4, 8))
            trainer.close()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "st")
            self.train(Net(["enc", "dec"]), path).close()
            os.unlink(os.path.join(path, "optimizer", "memplan-swap.data"))
            with self.assertRaises(FileNotFoundError) as caught:
                memplan.torch.offload(Net(["enc", "dec"]), path, direct=False, resume=True)
            self.assertIn("memplan-swap.data", str(caught.exception))

    def test_missing_parents_are_created_and_one_process_reuses_a_path(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "a", "b", "c")
            first = self.train(Net(["enc", "dec"]), path)
            self.assertTrue(os.path.isdir(os.path.join(path, "optimizer")))
            # A second offload() in this process on the same path while the first still holds
            # it (a notebook's next trainer): the first is closed, with a warning.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                second = memplan.torch.offload(Net(["enc", "dec"]), path + "/", lr=1e-2,
                                               direct=False, resume=True)
            self.assertTrue(first._closed)
            self.assertTrue(any("earlier OffloadedModule" in str(w.message) for w in caught))
            self.assertEqual(second.resumed_step, 2)
            second.close()

    def test_a_store_in_use_by_another_process_names_it(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "st")
            trainer = self.train(Net(["enc", "dec"]), path)
            script = textwrap.dedent(f"""
                import sys, torch, memplan.torch
                sys.path.insert(0, {os.path.dirname(__file__)!r})
                from test_training import Net
                try:
                    memplan.torch.offload(Net(["enc", "dec"]), {path!r}, direct=False)
                except RuntimeError as e:
                    print("ERROR", e)
            """)
            done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=120, check=False)
            self.assertIn(f"in use by pid {os.getpid()}", done.stdout)
            self.assertNotIn("earlier run", done.stdout)
            trainer.close()


class ImportOrderTest(unittest.TestCase):
    def test_memplan_imported_before_torch(self):
        # A trainer's script may import memplan first. The extension links the system's CUDA
        # runtime and NCCL by soname, and a PyPI torch that loaded after it got the system's NCCL
        # and failed ("undefined symbol: ncclCommResume"; Note [torch before the extension] in
        # memplan/__init__.py). In a fresh interpreter, as a script would run.
        script = ("import memplan, memplan.torch, torch\n"
                  "print(float(torch.ones(3).sum()), memplan.__version__)")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=dict(os.environ), timeout=300)
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        self.assertEqual(done.stdout.split()[0], "3.0")


if __name__ == "__main__":
    unittest.main()
