"""From plan to run (issue 19, item 6): `memplan plan --emit-schedule` writes a Schedule for a
Llama-shaped Transformers model with parameters and optimizer on NVMe; memplan.torch trains the
model with exactly that file (and the C API opens the same file); the engine's measured pinned
bytes, NVMe bytes per step and peak live parameter bytes are each within 10% of what plan
predicted for that schedule (planner/engine_model.h). The loop the project exists for."""
import ctypes
import json
import os
import subprocess
import tempfile
import unittest

import torch

import memplan.torch

MEMPLAN = os.environ.get("MEMPLAN_BINARY", "memplan")
STEPS = 6
TOLERANCE = 0.10


def llama():
    """A Llama-shaped causal LM large enough that its decoder layers are fetched, not resident:
    1.3M parameters (hidden 256, two layers), random init, no download."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, vocab_size=256, use_cache=False)
    config.architectures = ["LlamaForCausalLM"]
    return transformers.LlamaForCausalLM(config)


def plan(tmp, model, extra=()):
    """`memplan plan` for the model's config.json on one GPU, both tiers on NVMe under tmp."""
    model.config.to_json_file(os.path.join(tmp, "config.json"))
    nvme = os.path.join(tmp, "nvme")
    os.makedirs(nvme)
    schedule = os.path.join(tmp, "s.json")
    out = subprocess.run(
        [MEMPLAN, "plan", "--model", os.path.join(tmp, "config.json"), "--gpu", "rtx4090",
         "--gpus", "1", "--cpu-mem", "64GiB", "--global-batch", "2", "--seq-len", "16",
         "--zero-stage", "3", "--offload-optimizer", "nvme", "--offload-param", "nvme",
         "--nvme-path", nvme, "--emit-schedule", schedule, "--format", "json", *extra],
        check=True, capture_output=True, text=True)
    return schedule, json.loads(out.stdout)["schedule_prediction"]


class PlanToRunTest(unittest.TestCase):
    def assertNear(self, measured, predicted, what):
        self.assertGreater(predicted, 0, what)
        error = (measured - predicted) / predicted
        print(f"{what:28s} measured {measured:>14,.0f} predicted {predicted:>14,} "
              f"error {100 * error:+.2f}%")
        self.assertLessEqual(abs(error), TOLERANCE, f"{what}: {measured} vs {predicted}")

    def test_the_engine_runs_the_emitted_schedule_as_predicted(self):
        model = llama()
        with tempfile.TemporaryDirectory() as tmp:
            schedule, predicted = plan(tmp, model)
            with open(schedule) as f:
                emitted = json.load(f)
            self.assertEqual(emitted["params"]["tier"], "nvme")
            self.assertEqual(emitted["optimizer"]["tier"], "nvme")
            self.assertEqual(emitted["pinned_budget_bytes"], predicted["pinned_bytes"])
            # The host-only runtime pins no gradient staging (it has no GPU to copy from).
            pinned = predicted["pinned_bytes"] - predicted["pinned"]["gradient_staging_bytes"]

            # The file exactly as written: the engine starts within its pinned budget.
            trainer = memplan.torch.offload(model, schedule=schedule, lr=1e-3, runtime="host")
            self.assertEqual(trainer.dtype, torch.bfloat16)
            started = trainer.stats()
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, 256, (2, 16), generator=g)
            stats, losses = [], []
            for _ in range(STEPS):
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                trainer.step()
                losses.append(loss.item())
                stats.append(trainer.stats())
            trainer.close()
            # It trains (one batch, over and over).
            self.assertLess(losses[-1], losses[0] - 0.1, losses)

            # The first step records the module order; from the second the engine prefetches
            # along it: the per-step figures are those of steps 2..STEPS.
            first, last = stats[0], stats[-1]
            steps = STEPS - 1
            self.assertEqual(last["steps"], STEPS)
            self.assertNear(last["pinned_bytes"], pinned, "pinned bytes")
            self.assertNear((last["nvme_read_bytes"] - first["nvme_read_bytes"]) / steps,
                            predicted["nvme_read_bytes_per_step"], "NVMe read bytes per step")
            self.assertNear((last["nvme_write_bytes"] - first["nvme_write_bytes"]) / steps,
                            predicted["nvme_write_bytes_per_step"], "NVMe written bytes per step")
            self.assertNear(last["param"]["peak_live_bytes"], predicted["peak_live_param_bytes"],
                            "peak live parameter bytes")
            self.assertNear(first["param"]["nvme_read_bytes"] - started["param"]["nvme_read_bytes"],
                            predicted["nvme"]["first_step_param_read_bytes"],
                            "first step's parameter reads")
            self.assertGreater(predicted["peak_live_param_bytes"],
                               predicted["resident_param_bytes"])  # the layers are fetched

            # The C API with the same file: it starts and pins what plan predicted.
            library = os.environ.get("MEMPLAN_C_LIBRARY")
            if library:
                self.check_c_api(library, schedule, llama(), pinned)

    def test_a_lion_plan_runs_as_predicted(self):
        # `plan --optimizer lion` emits a Lion schedule: one optimizer state, Lion's step options.
        model = llama()
        with tempfile.TemporaryDirectory() as tmp:
            schedule, predicted = plan(tmp, model, ["--optimizer", "lion"])
            with open(schedule) as f:
                self.assertEqual(json.load(f)["optimizer"]["name"], "lion")
            trainer = memplan.torch.offload(model, schedule=schedule, lr=1e-4, runtime="host")
            tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
            losses, stats = [], []
            for _ in range(3):
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                trainer.step()
                losses.append(loss.item())
                stats.append(trainer.stats())
            trainer.close()
            self.assertLess(losses[-1], losses[0], losses)
            pinned = predicted["pinned_bytes"] - predicted["pinned"]["gradient_staging_bytes"]
            self.assertNear(stats[-1]["pinned_bytes"], pinned, "pinned bytes (Lion)")
            self.assertNear((stats[-1]["nvme_write_bytes"] - stats[0]["nvme_write_bytes"]) / 2,
                            predicted["nvme_write_bytes_per_step"], "NVMe written (Lion)")

    def check_c_api(self, library, schedule, model, pinned):
        c = ctypes.CDLL(library)
        c.memplan_last_error.restype = ctypes.c_char_p
        engine = ctypes.c_void_p()
        with open(schedule, "rb") as f:
            text = f.read()
        # A fresh store: the first run's is kept for a resume.
        doc = json.loads(text)
        doc["nvme"]["path"] += "-c"
        text = json.dumps(doc).encode()

        def ok(status):
            self.assertEqual(status, 0, c.memplan_last_error())

        ok(c.memplan_engine_open(text, b'{"runtime": "host"}', ctypes.byref(engine)))
        keep = []
        for name, p in model.named_parameters():
            module = name.rsplit(".", 1)[0]
            if module.startswith("model.layers."):
                module = ".".join(module.split(".")[:3])  # one unit per decoder layer
            shape = (ctypes.c_int64 * p.dim())(*p.shape)
            init = p.detach().float().contiguous()
            keep.append(init)
            pid = ctypes.c_uint32()
            ok(c.memplan_engine_register(engine, name.encode(), module.encode(), shape, p.dim(),
                                         ctypes.c_void_p(init.data_ptr()), ctypes.byref(pid)))
        ok(c.memplan_engine_start(engine))
        out = ctypes.c_void_p()
        ok(c.memplan_engine_stats_json(engine, ctypes.byref(out)))
        stats = json.loads(ctypes.cast(out, ctypes.c_char_p).value)
        c.memplan_string_free(out)
        ok(c.memplan_engine_close(engine))
        self.assertEqual(stats["pinned_bytes"], pinned)


if __name__ == "__main__":
    unittest.main()
