"""memplan's Python package against the CLI: the same documents for the same questions, and
estimate_module against estimate for architectures built in torch."""
import json
import os
import subprocess
import unittest

import torch
from torch import nn

import memplan

MEMPLAN = os.environ["MEMPLAN_BINARY"]
SOURCE = os.environ["MEMPLAN_SOURCE_DIR"]


def cli(*args):
    out = subprocess.run([MEMPLAN, *args, "--format", "json"], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout)


class EstimateTest(unittest.TestCase):
    def test_builtin_model_matches_cli(self):
        self.assertEqual(memplan.estimate("llama-2-7b", gpus=4, nodes=2),
                         cli("estimate", "--model", "llama-2-7b", "--gpus", "4", "--nodes", "2"))

    def test_training_setup_matches_cli(self):
        ours = memplan.estimate("llama-2-7b", gpus=8, zero_stage=3, seq_len=4096,
                                checkpointing="full", offload_optimizer="cpu")
        theirs = cli("estimate", "--model", "llama-2-7b", "--gpus", "8", "--zero-stage", "3",
                     "--seq-len", "4096", "--checkpointing", "full", "--offload-optimizer", "cpu")
        self.assertEqual(ours, theirs)
        self.assertGreater(ours["peak"]["gpu_bytes"], 0)

    def test_json_files_with_a_repeated_key_are_refused(self):
        # Issue 30 L5's class: the package reads files as the library does.
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "config.json")
            with open(path, "w") as f:
                f.write('{"model_type": "gpt2", "n_layer": 12, "n_layer": 48}')
            with self.assertRaisesRegex(ValueError, "key 'n_layer' appears twice"):
                memplan.estimate(config=path)
            with open(path, "w") as f:
                f.write('{"version": 1, "params": {"tier": "nvme", "tier": "gpu"}}')
            with self.assertRaisesRegex(ValueError, "key 'tier' appears twice"):
                memplan.Engine(path, runtime="host")
            # The request path, too: the library refuses it (a dict cannot repeat a key, but the
            # native JSON reader is shared).
            with self.assertRaisesRegex(Exception, "appears twice"):
                memplan._native.estimate_json('{"model": "gpt2", "model": "gpt2"}')

    def test_config_dict_and_path_agree(self):
        path = os.path.join(SOURCE, "estimator/models/gpt2.json")
        with open(path) as f:
            config = json.load(f)
        by_dict = memplan.estimate(config=config, name="gpt2", gpus=2)
        by_path = memplan.estimate(path, gpus=2)
        self.assertEqual(by_dict["deepspeed"], by_path["deepspeed"])
        self.assertEqual(by_dict["model"]["params_total"], 124439808)

    def test_bad_input_raises_with_the_cli_message(self):
        with self.assertRaisesRegex(ValueError, "unknown key 'bogus'"):
            memplan.estimate("llama-2-7b", bogus=1)
        with self.assertRaisesRegex(ValueError, "exactly one"):
            memplan.estimate()
        # A model not found: ValueError as the README promises, still a KeyError as before
        # (memplan.NotFoundError), printed without KeyError's quotes (issue 31 item 10).
        with self.assertRaises(ValueError) as caught:
            memplan.estimate("no-such-model-anywhere")
        self.assertIsInstance(caught.exception, KeyError)
        self.assertIsInstance(caught.exception, memplan.NotFoundError)
        self.assertTrue(str(caught.exception).startswith("model 'no-such-model-anywhere'"),
                        str(caught.exception))
        with self.assertRaisesRegex(ValueError, "gpus"):
            memplan.estimate("llama-2-7b", gpus=0)


class PlanTest(unittest.TestCase):
    def test_matches_cli(self):
        ours = memplan.plan("llama-2-7b", gpu="a100-80", gpus=8, cpu_mem="1TiB",
                            global_batch=64, seq_len=2048, top=3)
        theirs = cli("plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus", "8",
                     "--cpu-mem", "1TiB", "--global-batch", "64", "--seq-len", "2048", "--top",
                     "3")
        self.assertEqual(ours, theirs)
        self.assertEqual(len(ours["plans"]), 3)

    def test_errors_name_fields_not_flags(self):
        # Note [Field names in errors]: Python callers wrote micro_batch=, not --micro-batch.
        with self.assertRaisesRegex(ValueError, "`micro_batch` 3 does not divide") as caught:
            memplan.plan("llama-2-7b", gpu="a100-80", gpus=8, global_batch=64, micro_batch=3)
        self.assertNotIn("--", str(caught.exception))

    def test_emit(self):
        ours = memplan.plan("llama-2-7b", gpu="a100-80", gpus=8, global_batch=64, seq_len=2048,
                            emit=["deepspeed", "fsdp"])
        ds = ours["emitted"]["deepspeed"]
        best = ours["plans"][0]
        self.assertEqual(ds["zero_optimization"]["stage"], best["zero_stage"])
        self.assertEqual(ds["train_batch_size"], 64)
        self.assertIn("fsdp", ours["emitted"])
        # The offload engine's Schedule exists only for plans that offload: said so, while the
        # others are emitted (as the CLI's "not written" lines).
        both = memplan.plan("llama-2-7b", gpu="a100-80", gpus=8, global_batch=64, seq_len=2048,
                            emit=["schedule", "trainer"])
        self.assertIn("offloads nothing", both["not_emitted"]["schedule"])
        self.assertNotIn("schedule", both["emitted"])
        self.assertEqual(both["emitted"]["trainer"]["training_arguments"]["bf16"], True)
        # Nothing fits: nothing to emit.
        with self.assertRaisesRegex(ValueError, "nothing to emit"):
            memplan.plan("llama-2-70b", gpu="rtx4090", cpu_mem="16GiB", allow_nvme=False,
                         global_batch=8, emit=["deepspeed"])
        with self.assertRaisesRegex(ValueError, "emit"):
            memplan.plan("llama-2-7b", gpu="a100-80", global_batch=8, emit=["nonsense"])


class EstimateModuleTest(unittest.TestCase):
    def test_transformers_models_agree_with_their_configs(self):
        import transformers
        for name, auto in (("gpt2", transformers.AutoModelForCausalLM),
                           ("pythia-160m", transformers.AutoModelForCausalLM),
                           ("bert-base-uncased", transformers.AutoModelForMaskedLM)):
            with self.subTest(model=name):
                with open(os.path.join(SOURCE, "estimator/models", name + ".json")) as f:
                    config = json.load(f)
                model = auto.from_config(transformers.AutoConfig.for_model(**config))
                live = memplan.estimate_module(model, gpus=4)
                from_config = memplan.estimate(config=config, gpus=4)
                self.assertEqual(live["deepspeed"], from_config["deepspeed"])
                self.assertEqual(live["model"]["params_total"],
                                 from_config["model"]["params_total"])
                self.assertEqual(live["model"]["params_total"],
                                 sum(p.numel() for p in model.parameters()))

    def test_meta_device_and_shared_parameters(self):
        # Nothing is allocated on the meta device; the tied head counts once.
        emb = nn.Embedding(50000, 4096, device="meta")
        head = nn.Linear(4096, 50000, bias=False, device="meta")
        head.weight = emb.weight
        model = nn.ModuleDict({"emb": emb, "mlp": nn.Linear(4096, 16384, device="meta"),
                               "head": head})
        got = memplan.estimate_module(model, gpus=8)
        self.assertEqual(got["model"]["params_total"], 50000 * 4096 + 4096 * 16384 + 16384)
        self.assertEqual(got["model"]["num_tied_tensors"], 1)
        # The same model as a shape list through the CLI.
        shapes = {"tensors": [{"name": "emb.weight", "shape": [50000, 4096]},
                              {"name": "mlp.weight", "shape": [16384, 4096]},
                              {"name": "mlp.bias", "shape": [16384]},
                              {"name": "head.weight", "shape": [50000, 4096],
                               "tied_to": "emb.weight"}]}
        self.assertEqual(got["deepspeed"], memplan.estimate(shapes=shapes, gpus=8)["deepspeed"])


if __name__ == "__main__":
    unittest.main()
