"""offload()'s defaults (issue 33 item 1, "fast by default"): overlap_optimizer="auto" gives the
results of the step after backward, bit for bit, on the loops people write (it overlaps where every
option is known before backward, falls back where it is not, and refuses, naming the call, what it
finds only after a step was overlapped); and the schedule sizes chosen from the machine
(choose_sizes, a pure function with exact answers; the values reaching the engine)."""
import json
import logging
import math
import os
import tempfile
import unittest

import torch
from torch import nn

import memplan
import memplan.torch
from memplan._torch_sizing import machine_facts, optimizer_slot_bytes
from training_fixtures import data as fixture_data, loss_of, mlp

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def data(steps, batch=8, scale=3.0, seed=2):
    """training_fixtures.data with targets three times larger: clipping at 0.5-2 bites."""
    return fixture_data(steps, batch=batch, scale=scale, seed=seed)


def unclipped_norms(batches):
    """The gradient norms of plain AdamW training over `batches` without clipping."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    norms = []
    for batch in batches:
        loss_of(model, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
    return norms


class AutoOverlapTest(unittest.TestCase):
    """overlap_optimizer="auto" against False: the same losses, norms and weights, bit for bit."""

    def run_loop(self, overlap, path, batches, *, accumulation=1, before=None, after=None,
                 model=None, resume=False, **kwargs):
        """Trains mlp() over `batches` (one step per `accumulation` batches): before(trainer,
        step) runs before each step's backward passes, after(trainer, model, step) between the
        last backward and step() (its result recorded). Returns (losses, recorded, weights,
        overlapped flags of the steps, the trainer, closed)."""
        model = model or mlp()
        kwargs.setdefault("sub_group_elements", 1024)  # several sub-groups: a real overlap
        trainer = memplan.torch.offload(model, path, lr=1e-2, weight_decay=0.01, direct=False,
                                        gradient_accumulation_steps=accumulation,
                                        overlap_optimizer=overlap, resume=resume, **kwargs)
        losses, recorded, overlapped = [], [], []
        for i, batch in enumerate(batches):
            step = i // accumulation
            if i % accumulation == 0 and before is not None:
                before(trainer, step)
            loss = loss_of(model, batch) / accumulation
            loss.backward()
            losses.append(loss.item())
            if (i + 1) % accumulation == 0:
                if after is not None:
                    recorded.append(after(trainer, model, step))
                trainer.step()
                profile = trainer.stats()["step_profile"]
                overlapped.append(profile["overlapped"] or bool(profile["clipping"]))
        weights = trainer.master_weights()
        trainer.close()
        return losses, recorded, weights, overlapped, trainer

    def assertSameRuns(self, serial, auto):
        self.assertEqual(auto[0], serial[0], "losses")
        # repr: a NaN norm (an overflowed step) equals itself.
        self.assertEqual([repr(x) for x in auto[1]], [repr(x) for x in serial[1]],
                         "what the loop recorded (norms)")
        for name, w in serial[2].items():
            self.assertTrue(torch.equal(auto[2][name], w), name)

    def compare(self, batches, **kwargs):
        with tempfile.TemporaryDirectory() as tmp:
            serial = self.run_loop(False, os.path.join(tmp, "serial"), batches, **kwargs)
            auto = self.run_loop("auto", os.path.join(tmp, "auto"), batches, **kwargs)
        self.assertSameRuns(serial, auto)
        self.assertFalse(any(serial[3]), "overlap_optimizer=False overlapped")
        return serial, auto

    def test_plain_adamw_overlaps_from_the_second_step(self):
        _, auto = self.compare(data(6))
        self.assertEqual(auto[3], [False] + [True] * 5)
        self.assertTrue(auto[4].overlap_optimizer)
        self.assertIn("overlap_optimizer = True: on", auto[4].explain())

    def test_clip_grad_norm_after_backward_every_step_is_declared(self):
        batches = data(8)
        norms = sorted(unclipped_norms(batches))
        max_norm = (norms[3] + norms[4]) / 2  # clipping bites on some steps, not on others

        def clip(trainer, model, step):
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        serial, auto = self.compare(batches, after=clip)
        self.assertEqual(auto[3], [False] + [True] * 7)
        self.assertEqual(auto[4]._auto_clip, (max_norm, 2.0))
        self.assertIn(f"clip_grad_norm_({max_norm:g}, norm_type=2)", auto[4].explain())
        clipped = [n for n in serial[1] if n + 1e-6 > max_norm]
        self.assertTrue(0 < len(clipped) < len(serial[1]), serial[1])

    def test_the_module_method_clip_with_norm_type_1(self):
        batches = data(6)

        def clip(trainer, model, step):
            return float(trainer.clip_grad_norm_(1.5, norm_type=1.0))
        _, auto = self.compare(batches, after=clip)
        self.assertEqual(auto[3], [False] + [True] * 5)
        self.assertEqual(auto[4]._auto_clip, (1.5, 1.0))

    def test_declared_max_grad_norm(self):
        _, auto = self.compare(data(6), max_grad_norm=0.5)
        self.assertEqual(auto[3], [False] + [True] * 5)

    def test_parameter_groups_and_gradient_accumulation(self):
        def groups(model):
            decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
            rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
            return [{"params": decay, "weight_decay": 0.1, "lr": 2e-2},
                    {"params": rest, "weight_decay": 0.0}]
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for overlap in (False, "auto"):
                model = mlp()
                runs.append(self.run_loop(overlap, os.path.join(tmp, str(overlap)), data(12),
                                          accumulation=3, model=model,
                                          param_groups=groups(model)))
        self.assertSameRuns(*runs)
        self.assertEqual(runs[1][3], [False, True, True, True])

    def test_an_lr_schedule_through_set_options(self):
        lrs = [1e-2 / (1 + i) for i in range(6)]

        def schedule(trainer, step):
            trainer.set_options(lr=lrs[step])
        _, auto = self.compare(data(6), before=schedule)
        self.assertEqual(auto[3], [False] + [True] * 5)

    def test_an_offload_optimizer_under_a_torch_lr_scheduler(self):
        # The Trainer's pattern by hand: the scheduler sets param_groups' lr after each step,
        # before the next backward, where the overlapped step reads it.
        import memplan.hf
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for overlap in (False, "auto"):
                model = mlp()
                trainer = memplan.torch.offload(model, os.path.join(tmp, str(overlap)), lr=1e-2,
                                                direct=False, overlap_optimizer=overlap,
                                                sub_group_elements=1024)
                optimizer = memplan.hf.OffloadOptimizer(trainer)
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
                losses, overlapped = [], []
                for batch in data(6):
                    loss = loss_of(model, batch)
                    loss.backward()
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    losses.append(loss.item())
                    overlapped.append(trainer.stats()["step_profile"]["overlapped"])
                runs.append((losses, [], trainer.master_weights(), overlapped))
                trainer.close()
        self.assertSameRuns(*runs)
        self.assertEqual(runs[1][3], [False] + [True] * 5)

    def test_a_grad_scaler_with_clipping(self):
        # fp16 loss scaling by hand (torch 2's CPU GradScaler): unscale_ (the engine's overflow
        # check), clip, scaler.step, update; overflowed steps dropped at unscale_. The scaler is
        # named at the first unscale_, so from the second step its scale is known before backward.
        if not hasattr(torch, "amp") or not hasattr(torch.amp, "GradScaler"):
            self.skipTest("torch.amp.GradScaler('cpu') needs torch 2.3")
        import memplan.hf
        batches = data(8, scale=1.0)
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for overlap in (False, "auto"):
                model = mlp()
                trainer = memplan.torch.offload(model, os.path.join(tmp, str(overlap)), lr=1e-2,
                                                direct=False, overlap_optimizer=overlap,
                                                sub_group_elements=1024)
                optimizer = memplan.hf.OffloadOptimizer(trainer)
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
                losses, norms, scales, overlapped = [], [], [], []
                for batch in batches:
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = loss_of(model, batch)
                    scaler.scale(loss).backward()
                    scaler.unscale_(optimizer)
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                    losses.append(loss.item())
                    scales.append(scaler.get_scale())
                    overlapped.append(trainer.overlap_optimizer)
                runs.append((losses, norms + scales, trainer.master_weights(), overlapped))
                trainer.close()
        self.assertSameRuns(*runs)
        norms = runs[1][1][:8]
        self.assertLess(runs[1][1][-1], 2.0 ** 20)  # overflowed and backed off
        first = next(i for i, n in enumerate(norms) if math.isfinite(n))
        self.assertGreater(first, 0, norms)
        # An overflowed step is dropped at unscale_ and decides nothing; the first that steps
        # (after backward) does.
        self.assertEqual(runs[1][3], [False] * first + [True] * (8 - first))

    def test_resume_from_the_stores(self):
        batches = data(8)
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for overlap in (False, "auto"):
                path = os.path.join(tmp, str(overlap))
                first = self.run_loop(overlap, path, batches[:4])
                second = self.run_loop(overlap, path, batches[4:], model=mlp(seed=7),
                                       resume=True)
                self.assertEqual(second[4].resumed_step, 4)
                runs.append((first[0] + second[0], [], second[2], first[3] + second[3]))
        self.assertSameRuns(*runs)
        self.assertEqual(runs[1][3], [False, True, True, True, False, True, True, True])

    # ---- where "auto" does not overlap --------------------------------------------------------

    def test_options_given_to_step_keep_the_serial_step(self):
        lrs = [1e-2 / (1 + i) for i in range(5)]
        batches = data(5)
        with tempfile.TemporaryDirectory() as tmp:
            runs = []
            for overlap in (False, "auto"):
                model = mlp()
                trainer = memplan.torch.offload(model, os.path.join(tmp, str(overlap)), lr=1e-2,
                                                direct=False, overlap_optimizer=overlap,
                                                sub_group_elements=1024)
                losses = []
                for i, batch in enumerate(batches):
                    loss = loss_of(model, batch)
                    loss.backward()
                    trainer.step(lr=lrs[i])
                    losses.append(loss.item())
                    self.assertFalse(trainer.stats()["step_profile"]["overlapped"])
                runs.append((losses, [], trainer.master_weights()))
                trainer.close()
        self.assertSameRuns(*runs)
        self.assertIn("off: step() was given lr", trainer.explain())

    def test_the_optimizer_in_host_memory_does_not_overlap(self):
        trainer = memplan.torch.offload(mlp(), lr=1e-2)
        self.assertFalse(trainer.overlap_optimizer)
        self.assertIn("off: the optimizer is in host memory", trainer.overlap_reason)
        trainer.close()

    def test_clipping_beside_other_parameters_keeps_the_serial_step(self):
        batches = data(4)
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for overlap in (False, "auto"):
                model = mlp()
                extra = nn.Parameter(torch.ones(3))
                trainer = memplan.torch.offload(model, os.path.join(tmp, str(overlap)), lr=1e-2,
                                                direct=False, overlap_optimizer=overlap,
                                                sub_group_elements=1024)
                losses, norms = [], []
                for batch in batches:
                    loss = loss_of(model, batch) + extra.sum()
                    loss.backward()
                    params = list(model.parameters()) + [extra]
                    norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
                    trainer.step()
                    extra.grad = None
                    losses.append(loss.item())
                runs.append((losses, norms, trainer.master_weights()))
                self.assertFalse(trainer.overlap_optimizer)
                trainer.close()
        self.assertSameRuns(*runs)
        self.assertIn("other parameters together", trainer.overlap_reason)

    # ---- found only after a step was overlapped: refused, named, nothing applied ---------------

    def overlapped_trainer(self, tmp, **kwargs):
        model = mlp()
        trainer = memplan.torch.offload(model, os.path.join(tmp, "s"), lr=1e-2, direct=False,
                                        sub_group_elements=1024, **kwargs)
        return model, trainer

    def check_refused(self, model, trainer, batch, call, pattern):
        before = trainer.master_weights()
        steps = trainer.stats()["steps"]
        loss_of(model, batch).backward()
        with self.assertRaisesRegex(ValueError, pattern + r".*overlap_optimizer=False"):
            call()
        for name, w in trainer.master_weights().items():
            self.assertTrue(torch.equal(w, before[name]), name)
        self.assertEqual(trainer.stats()["steps"], steps)
        self.assertFalse(trainer.overlap_optimizer)
        self.assertIn("off: ", trainer.overlap_reason)
        # The loop goes on, the step after backward.
        loss_of(model, batch).backward()
        trainer.step()
        self.assertEqual(trainer.stats()["steps"], steps + 1)
        self.assertFalse(trainer.stats()["step_profile"]["overlapped"])

    def test_other_clip_arguments_after_an_overlapped_step_are_refused(self):
        batches = data(4)
        with tempfile.TemporaryDirectory() as tmp:
            model, trainer = self.overlapped_trainer(tmp)
            for batch in batches[:2]:
                loss_of(model, batch).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                trainer.step()
            self.assertTrue(trainer.overlap_optimizer)
            self.check_refused(
                model, trainer, batches[2],
                lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5),
                r"clip_grad_norm_\(0.5, norm_type=2\)")
            # The clipping "auto" declared is gone with it.
            self.assertNotIn("max_grad_norm", trainer.optimizer_options)
            trainer.close()

    def test_a_clip_that_appears_later_without_biting_is_taken_and_declared(self):
        # Overlapping began without clipping; a clip_grad_norm_ from step 3 on (and its max_norm
        # changed at step 5), never biting: the same steps as the serial run's, nothing refused.
        batches = data(6)

        def clip(trainer, model, step):
            if step < 2:
                return 0.0
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                        1e6 if step < 4 else 1e7))
        _, auto = self.compare(batches, after=clip)
        self.assertEqual(auto[3], [False] + [True] * 5)
        self.assertEqual(auto[4]._auto_clip, (1e7, 2.0))

    def test_a_step_without_the_declared_clip_is_refused_only_when_it_would_clip(self):
        batches = data(6)
        with tempfile.TemporaryDirectory() as tmp:
            model, trainer = self.overlapped_trainer(tmp)
            for batch in batches[:2]:
                loss_of(model, batch).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # never bites
                trainer.step()
            # No clip call, a norm far under 1e6: the same step as the serial one: it runs.
            loss_of(model, batches[2]).backward()
            trainer.step()
            self.assertTrue(trainer.overlap_optimizer)
            self.assertEqual(trainer.stats()["steps"], 3)
            trainer.close()
        with tempfile.TemporaryDirectory() as tmp:
            model, trainer = self.overlapped_trainer(tmp)
            for batch in batches[:2]:
                loss_of(model, batch).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # always bites
                trainer.step()
            self.check_refused(model, trainer, batches[2], trainer.step,
                               r"step\(\) without the clip_grad_norm_\(0.001, norm_type=2\)")
            trainer.close()

    def test_step_options_after_an_overlapped_step(self):
        batches = data(5)
        with tempfile.TemporaryDirectory() as tmp:
            model, trainer = self.overlapped_trainer(tmp)
            for batch in batches[:2]:
                loss_of(model, batch).backward()
                trainer.step()
            # The same lr as the step was prepared with: it runs, and "auto" stops overlapping.
            loss_of(model, batches[2]).backward()
            trainer.step(lr=1e-2)
            self.assertTrue(trainer.stats()["step_profile"]["overlapped"])
            self.assertFalse(trainer.overlap_optimizer)
            trainer.close()
        with tempfile.TemporaryDirectory() as tmp:
            model, trainer = self.overlapped_trainer(tmp)
            for batch in batches[:2]:
                loss_of(model, batch).backward()
                trainer.step()
            self.check_refused(model, trainer, batches[2], lambda: trainer.step(lr=5e-3),
                               r"step\(\) changed lr")
            trainer.close()

    def test_a_bad_value_is_refused_naming_it(self):
        with self.assertRaisesRegex(ValueError, "overlap_optimizer must be 'auto', True or False"):
            memplan.torch.offload(mlp(), overlap_optimizer="yes")


class ChooseSizesTest(unittest.TestCase):
    """choose_sizes(): exact answers for given facts (Note [Machine-sized defaults])."""
    # A 25.5 M-parameter GPT (hidden 512, 8 layers, vocabulary 512): its largest parameter is an
    # MLP weight of 512 x 2048.
    GPT = dict(elements=25_500_000, trainable=25_500_000, largest_param_elements=512 * 2048)

    def test_an_enforced_memlock_of_8_mib(self):
        got = memplan.torch.choose_sizes(**self.GPT, memlock_bytes=8 * MiB,
                                         available_bytes=16 * GiB, resident_bytes=100 * MiB)
        self.assertEqual(got["pinned_budget_bytes"], 8 * MiB)
        # 3 optimizer buffers within 4 MiB: 64 Ki elements (3 x 1,052,672 bytes).
        self.assertEqual(got["sub_group_elements"], 64 * KiB)
        self.assertEqual(3 * optimizer_slot_bytes(64 * KiB), 3 * 1_052_672)
        self.assertEqual(got["param_buffer_bytes"], 1 * MiB)  # 2 within a quarter of 8 MiB
        self.assertEqual(got["prefetch_bytes"], 64 * MiB)     # no bench result
        self.assertEqual(got["reasons"]["pinned_budget_bytes"], "RLIMIT_MEMLOCK (8 MiB)")
        self.assertIn("390 sub-groups: halved until", got["reasons"]["sub_group_elements"])
        self.assertIn("no bench result", got["reasons"]["prefetch_bytes"])

    def test_unlimited_memlock_and_a_measured_drive(self):
        got = memplan.torch.choose_sizes(**self.GPT, memlock_bytes=None,
                                         memlock_note="RLIMIT_MEMLOCK is unlimited",
                                         available_bytes=16 * GiB, resident_bytes=100 * MiB,
                                         read_bytes_per_s=2e9, bench_source="nvme.json")
        self.assertEqual(got["pinned_budget_bytes"], (16 * GiB - 100 * MiB) // 8)
        # 25.5 M / 16 = 1.59 M: 1 Mi elements, 25 sub-groups.
        self.assertEqual(got["sub_group_elements"], 1 * MiB)
        self.assertIn("25 sub-groups: about 16 per step", got["reasons"]["sub_group_elements"])
        self.assertEqual(got["param_buffer_bytes"], 4 * MiB)  # the 4 MiB MLP weight in one read
        # 2e9 B/s x 50 ms = 100,000,000 bytes, rounded up to 96 MiB.
        self.assertEqual(got["prefetch_bytes"], 96 * MiB)
        self.assertIn("2000 MB/s (nvme.json)", got["reasons"]["prefetch_bytes"])
        self.assertIn("RLIMIT_MEMLOCK is unlimited", got["reasons"]["pinned_budget_bytes"])

    def test_little_memory_available(self):
        got = memplan.torch.choose_sizes(**self.GPT, available_bytes=1 * GiB,
                                         resident_bytes=1 * GiB - 64 * MiB)
        self.assertEqual(got["pinned_budget_bytes"], 8 * MiB)  # an eighth of the 64 MiB left
        self.assertEqual(got["sub_group_elements"], 64 * KiB)
        self.assertEqual(got["param_buffer_bytes"], 1 * MiB)

    def test_a_large_model_and_a_fast_drive_hit_the_ceilings(self):
        got = memplan.torch.choose_sizes(elements=7_000_000_000, trainable=7_000_000_000,
                                         largest_param_elements=4096 * 32000, param_dtype_bytes=2,
                                         available_bytes=512 * GiB, read_bytes_per_s=2.5e10)
        self.assertEqual(got["pinned_budget_bytes"], 64 * GiB)
        self.assertEqual(got["sub_group_elements"], 4 * MiB)
        self.assertEqual(got["param_buffer_bytes"], 64 * MiB)
        self.assertEqual(got["prefetch_bytes"], 128 * MiB)

    def test_the_prefetch_stays_within_half_of_max_live_bytes(self):
        got = memplan.torch.choose_sizes(**self.GPT, read_bytes_per_s=2e9,
                                         max_live_bytes=64 * MiB)
        self.assertEqual(got["prefetch_bytes"], 32 * MiB)

    def test_a_tiny_model_is_one_sub_group_of_its_own_size(self):
        got = memplan.torch.choose_sizes(elements=1796, trainable=1796, largest_param_elements=1024)
        self.assertEqual(got["sub_group_elements"], 2048)
        self.assertEqual(got["pinned_budget_bytes"], 0)  # nothing known limits it
        self.assertEqual(got["param_buffer_bytes"], 1 * MiB)

    def test_a_memlock_below_the_smallest_buffers_is_not_the_budget(self):
        got = memplan.torch.choose_sizes(**self.GPT, memlock_bytes=64 * KiB,
                                         available_bytes=16 * GiB)
        self.assertEqual(got["pinned_budget_bytes"], 2 * GiB)
        self.assertIn("RLIMIT_MEMLOCK (64 KiB) is below what the smallest working buffers need",
                      got["reasons"]["pinned_budget_bytes"])

    def test_given_values_are_kept_and_the_rest_fit_them(self):
        got = memplan.torch.choose_sizes(**self.GPT, available_bytes=16 * GiB,
                                         given={"pinned_budget_bytes": 8 * MiB,
                                                "sub_group_elements": 128 * KiB})
        self.assertEqual(got["pinned_budget_bytes"], 8 * MiB)
        self.assertEqual(got["sub_group_elements"], 128 * KiB)
        self.assertEqual(got["reasons"]["sub_group_elements"], "given")
        self.assertEqual(got["param_buffer_bytes"], 1 * MiB)

    def test_ranks_share_the_states_and_host_memory_tiers_keep_defaults(self):
        got = memplan.torch.choose_sizes(**self.GPT, world_size=4, params_on_nvme=False,
                                         optimizer_on_nvme=True)
        self.assertEqual(got["sub_group_elements"], 256 * KiB)  # 6.4 M per rank / 16
        self.assertEqual(got["param_buffer_bytes"], 16 * MiB)
        self.assertEqual(got["prefetch_bytes"], 64 * MiB)
        got = memplan.torch.choose_sizes(**self.GPT, optimizer_on_nvme=False)
        self.assertEqual(got["sub_group_elements"], 1 * MiB)
        self.assertIn("host memory", got["reasons"]["sub_group_elements"])


class MachineSizedOffloadTest(unittest.TestCase):
    """offload() end to end: the chosen values are the engine's schedule."""

    def test_the_chosen_values_reach_the_engine(self):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 263,168 elements
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s")
            os.makedirs(path)
            with open(os.path.join(path, "nvme_bench.json"), "w") as f:
                json.dump({"best": {"read_bytes_per_s": 1e9, "write_bytes_per_s": 5e8}}, f)
            with self.assertLogs("memplan.torch", logging.INFO) as logged:
                trainer = memplan.torch.offload(model, path, lr=1e-3, direct=False)
            self.assertEqual(len(logged.records), 1)
            chosen = trainer.chosen_schedule
            facts = machine_facts()
            self.assertEqual(chosen["facts"]["memlock_bytes"], facts["memlock_bytes"])
            self.assertEqual(chosen["facts"]["elements"], 263_168)
            # 263,168 / 16 = 16,448: the 64 Ki floor, 5 sub-groups.
            self.assertEqual(chosen["sub_group_elements"], 64 * KiB)
            self.assertEqual(chosen["prefetch_bytes"], 48 * MiB)  # 1e9 B/s x 50 ms
            self.assertEqual(chosen["param_buffer_bytes"], 1 * MiB)
            self.assertIn("nvme_bench.json", chosen["reasons"]["prefetch_bytes"])
            schedule = trainer.schedule
            self.assertEqual(schedule["optimizer"]["sub_group_elements"], 64 * KiB)
            self.assertEqual(schedule["params"]["buffer_bytes"], 1 * MiB)
            self.assertEqual(schedule["params"]["prefetch_bytes"], 48 * MiB)
            self.assertEqual(schedule["pinned_budget_bytes"], chosen["pinned_budget_bytes"])
            self.assertIn("offload() chose:", logged.output[0])
            self.assertIn(trainer.explain().splitlines()[0], logged.output[0])
            x = torch.randn(4, 256)
            model(x).pow(2).mean().backward()
            trainer.step()
            stats = trainer.stats()
            # The engine's own view: 5 sub-groups, and pinned memory within the budget.
            self.assertEqual(stats["step_profile"]["sub_groups"], 5)
            if chosen["pinned_budget_bytes"]:
                self.assertLessEqual(stats["pinned_bytes"], chosen["pinned_budget_bytes"])
            trainer.close()

    def test_explicit_keywords_win_and_a_bad_bench_is_refused(self):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        with tempfile.TemporaryDirectory() as tmp:
            trainer = memplan.torch.offload(model, os.path.join(tmp, "s"), direct=False,
                                            sub_group_elements=1024, prefetch_bytes=3 * MiB,
                                            pinned_budget_bytes=16 * MiB)
            self.assertEqual(trainer.schedule["optimizer"]["sub_group_elements"], 1024)
            self.assertEqual(trainer.schedule["params"]["prefetch_bytes"], 3 * MiB)
            self.assertEqual(trainer.schedule["pinned_budget_bytes"], 16 * MiB)
            self.assertEqual(trainer.chosen_schedule["reasons"]["prefetch_bytes"], "given")
            trainer.close()
            bad = os.path.join(tmp, "bench.json")
            with open(bad, "w") as f:
                json.dump({"best": {"read_bytes_per_s": -1}}, f)
            with self.assertRaisesRegex(ValueError, r"best.read_bytes_per_s must be a positive"):
                memplan.torch.offload(model, os.path.join(tmp, "t"), nvme_bench=bad)
            with self.assertRaisesRegex(ValueError, "no 'best' result"):
                memplan.torch.offload(model, os.path.join(tmp, "t"), nvme_bench={"results": []})

    def test_a_whole_schedule_is_run_as_it_is(self):
        schedule = memplan.schedule(param_tier="cpu", optimizer_tier="cpu")
        trainer = memplan.torch.offload(mlp(), schedule=schedule)
        self.assertIsNone(trainer.chosen_schedule)
        self.assertIn("given whole", trainer.explain())
        self.assertEqual(trainer.schedule["optimizer"]["sub_group_elements"], 1 << 20)
        trainer.close()


if __name__ == "__main__":
    unittest.main()
