"""One request, three doors (issue 32): the same plan, estimate and capacity request through the
CLI (`--format json`), the C API (memplan_*_json through ctypes on libmemplan_c.so) and the Python
package gives the same JSON: the C API's text is the CLI's byte for byte (less its final newline),
and the package's dict is the CLI's document. The requests lean on the defaults that each door once
decided for itself (Note [Plan defaults] in planner/plan_request.h): no precision on a GPU without
bf16, tokens instead of samples, memlock "unlimited", a cluster file, LoRA, no optimizer."""
import ctypes
import json
import os
import subprocess
import tempfile
import unittest

import memplan

MEMPLAN = os.environ["MEMPLAN_BINARY"]
LIBRARY = os.environ.get("MEMPLAN_C_LIBRARY")


def cli_text(*args):
    return subprocess.run([MEMPLAN, *args, "--format", "json"], check=True, capture_output=True,
                          text=True).stdout


class CApi:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.memplan_last_error.restype = ctypes.c_char_p
        self.lib.memplan_string_free.argtypes = [ctypes.c_void_p]

    def call(self, function, request):
        out = ctypes.c_void_p()
        status = getattr(self.lib, function)(json.dumps(request).encode(), ctypes.byref(out))
        if status != 0:
            raise AssertionError(f"{function}: {self.lib.memplan_last_error().decode()}")
        try:
            return ctypes.string_at(out.value).decode()
        finally:
            self.lib.memplan_string_free(out)


class DoorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c_api = CApi(LIBRARY) if LIBRARY else None
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def same(self, cli_args, c_function, python_call, request):
        """The CLI's text, the C API's text + newline and the package's dict agree."""
        text = cli_text(*cli_args)
        document = json.loads(text)
        self.assertNotIn("deprecations", document)
        self.assertEqual(python_call(), document)
        if self.c_api is None:
            self.skipTest("no C library (MEMPLAN_C_LIBRARY)")
        self.assertEqual(self.c_api.call(c_function, request) + "\n", text)
        return document

    def test_plan_defaults_on_a_gpu_without_bf16(self):
        # No precision (fp16-mixed on a T4), no optimizer (8-bit AdamW tried), tokens, memlock.
        args = ["plan", "--model", "llama-2-7b", "--gpu", "t4", "--gpus", "4",
                "--global-batch-tokens", "65536", "--cpu-mem", "256GiB", "--memlock", "unlimited",
                "--top", "3"]
        request = {"model": "llama-2-7b", "gpu": "t4", "gpus": 4, "global_batch_tokens": 65536,
                   "cpu_mem": "256GiB", "memlock": "unlimited", "top": 3}
        doc = self.same(args, "memplan_plan_json", lambda: memplan.plan(**request), request)
        self.assertEqual(doc["job"]["precision"], "fp16-mixed")
        self.assertEqual(doc["job"]["global_batch"], 65536 // doc["job"]["seq_len"])

    def test_plan_with_a_cluster_file_lora_and_a_nested_setup(self):
        cluster = {"gpu": "a100-80", "gpus_per_node": 8, "cpu_memory_bytes": 1 << 40,
                   "memlock_bytes": 64 << 30}
        path = os.path.join(self.tmp.name, "cluster.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cluster, f)
        args = ["plan", "--model", "llama-2-7b", "--cluster", path, "--nodes", "2",
                "--global-batch", "64", "--seq-len", "1024", "--lora-rank", "16", "--qlora",
                "--memlock", "unlimited", "--framework", "torchtune"]
        request = {"model": "llama-2-7b", "cluster": cluster, "nodes": 2, "global_batch": 64,
                   "memlock": "unlimited",
                   "setup": {"seq_len": 1024, "lora_rank": 16, "qlora": True,
                             "framework": "torchtune"}}
        doc = self.same(args, "memplan_plan_json", lambda: memplan.plan(**request), request)
        self.assertEqual(doc["job"]["precision"], "bf16-mixed")
        self.assertEqual(doc["job"]["lora_rank"], 16)

    def test_plan_what_if(self):
        args = ["plan", "--model", "llama-2-7b", "--gpu", "h100-80", "--global-batch", "8",
                "--zero-stage", "3", "--offload-optimizer", "cpu", "--cpu-mem", "512GiB",
                "--optimizer", "adamw"]
        request = {"model": "llama-2-7b", "gpu": "h100-80", "global_batch": 8, "zero_stage": 3,
                   "offload_optimizer": "cpu", "cpu_mem": "512GiB",
                   "setup": {"optimizer": "adamw"}}
        doc = self.same(args, "memplan_plan_json", lambda: memplan.plan(**request), request)
        self.assertTrue(all(p["zero_stage"] == 3 for p in doc["plans"]))

    def test_plan_notes_name_the_request_fields(self):
        # A GPU alias and 16 GPUs on one node: the CLI says the flags, the JSON doors the keys
        # (Note [Field names in errors]); otherwise the same document.
        args = ["plan", "--model", "llama-2-7b", "--gpu", "h100", "--gpus", "16",
                "--global-batch", "64"]
        request = {"model": "llama-2-7b", "gpu": "h100", "gpus": 16, "global_batch": 64}
        document = json.loads(cli_text(*args))
        ours = memplan.plan(**request)
        self.assertIn("--gpu h100 is the h100-80 preset", " ".join(document["assumptions"]))
        self.assertIn("`gpu` h100 is the h100-80 preset", " ".join(ours["assumptions"]))
        self.assertIn("give `gpus` 8 `nodes` 2", " ".join(ours["assumptions"]))
        flags = json.dumps(document).replace("--gpus", "`gpus`").replace("--gpu", "`gpu`")
        self.assertEqual(json.loads(flags.replace("--nodes", "`nodes`")), ours)

    def test_estimate(self):
        args = ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--zero-stage", "3",
                "--micro-batch", "2", "--seq-len", "2048", "--lora-rank", "8"]
        setup = {"zero_stage": 3, "micro_batch": 2, "seq_len": 2048, "lora_rank": 8}
        request = {"model": "llama-2-7b", "gpus": 8, "setup": setup}
        self.same(args, "memplan_estimate_json",
                  lambda: memplan.estimate("llama-2-7b", gpus=8, **setup), request)

    def test_capacity(self):
        args = ["capacity", "--model", "llama-2-7b", "--gpu", "a100-80,t4", "--gpus", "1-16",
                "--tokens", "1T", "--global-batch-tokens", "4194304", "--seq-len", "4096",
                "--memlock", "unlimited", "--cpu-mem", "1TiB", "--price", "a100-80=1.8",
                "--threads", "2"]
        request = {"model": "llama-2-7b", "gpu": ["a100-80", "t4"], "gpus": "1-16",
                   "tokens": "1T", "global_batch_tokens": 4194304, "setup": {"seq_len": 4096},
                   "memlock": "unlimited", "cpu_mem": "1TiB", "price": {"a100-80": 1.8},
                   "threads": 2}
        doc = self.same(args, "memplan_capacity_json", lambda: memplan.capacity(**request),
                        request)
        self.assertIsNotNone(doc["fastest"])

    def test_capacity_lora_with_a_cluster_document(self):
        offers = {"gpus": ["l4", {"preset": "a100-80", "price_per_gpu_hour": 1.5}],
                  "cpu_memory_bytes": 512 << 30}
        path = os.path.join(self.tmp.name, "offers.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(offers, f)
        args = ["capacity", "--model", "llama-2-7b", "--cluster", path, "--gpus", "8,16",
                "--tokens", "5B", "--global-batch", "64", "--lora-rank", "8", "--threads", "1"]
        request = {"model": "llama-2-7b", "cluster": offers, "gpus": [8, 16], "tokens": 5e9,
                   "global_batch": 64, "setup": {"lora_rank": 8}, "threads": 1}
        self.same(args, "memplan_capacity_json", lambda: memplan.capacity(**request), request)

    def test_flattened_setup_keys_still_work_with_a_deprecation(self):
        # The JSON door (C API, _native) reads the old top-level setup keys for one release and
        # says so; the package's keywords go into "setup" (no deprecation).
        def plan_json(request):
            return json.loads(memplan._native.plan_json(json.dumps(request)))
        base = {"model": "llama-2-7b", "gpu": "a100-80", "global_batch": 8}
        nested = plan_json({**base, "setup": {"seq_len": 1024, "precision": "bf16-mixed"}})
        flat = plan_json({**base, "seq_len": 1024, "precision": "bf16-mixed"})
        notes = flat.pop("deprecations")
        self.assertEqual(flat, nested)
        self.assertEqual(len(notes), 2)
        self.assertIn('the top-level "seq_len" is deprecated', " ".join(notes))
        self.assertIn('write "setup": {"precision": ...}', " ".join(notes))
        self.assertEqual(memplan.plan(**base, seq_len=1024, precision="bf16-mixed"), nested)
        with self.assertRaisesRegex(ValueError, "given both at the top level and in"):
            plan_json({**base, "seq_len": 1024, "setup": {"seq_len": 2048}})
        with self.assertRaisesRegex(ValueError, "chosen by the plan search"):
            memplan.plan(**base, setup={"zero_stage": 3})

    def test_capacity_errors_name_the_request_keys(self):
        base = {"model": "llama-2-7b", "gpu": "a100-80", "gpus": 8, "global_batch": 64}
        for bad, key in (({}, "tokens"), ({"tokens": "lots"}, "tokens"),
                         ({"tokens": "1T", "threads": 10 ** 12}, "threads"),
                         ({"tokens": "1T", "price": "cheap"}, "price"),
                         ({"tokens": "1T", "gpu": 7}, "gpu"),
                         ({"tokens": "1T", "colour": 1}, "colour"),
                         ({"tokens": "1T", "max_days": -1}, "max_days"),
                         ({"tokens": "1T", "gpus_per_node": 0}, "gpus_per_node"),
                         ({"tokens": "1T", "memlock": "lots"}, "memlock"),
                         ({"tokens": "1T", "setup": {"zero_stage": 3}}, "zero_stage"),
                         ({"tokens": "1T", "global_batch_tokens": 4096}, "global_batch")):
            with self.subTest(key=key), self.assertRaisesRegex(ValueError, key):
                memplan.capacity(**{**base, **bad})

if __name__ == "__main__":
    unittest.main()
