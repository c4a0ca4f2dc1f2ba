"""bench/larger_than_ram.py at a toy size (issue 33 item 2): its output and the invariants that hold
at any size. The bench itself (a model whose states exceed RAM) is a documented command
(docs/bench.md), not a suite test."""
import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.environ["MEMPLAN_SOURCE_DIR"], "bench"))
import larger_than_ram as bench  # noqa: E402


class LargerThanRamSmokeTest(unittest.TestCase):
    def test_a_toy_run_reports_equal_losses_and_the_bytes_a_step_must_move(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "report.json")
            store = os.path.join(tmp, "drive")
            os.mkdir(store)
            params = bench.n_params(64, 2, 512)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                # A "RAM" of a third of the states, so that the ratio is checked too.
                status = bench.main(["--path", store, "--size", "64x2", "--vocab", "512",
                                     "--slice", "64x2", "--steps", "3",
                                     "--arms", "reference,compute,memplan",
                                     "--bw-bytes", str(8 << 20), "--min-free", "0",
                                     "--state-slots", "1",
                                     "--ram-bytes", str(16 * params // 3), "--json", out])
            self.assertEqual(status, 0)
            with open(out, encoding="utf-8") as f:
                report = json.load(f)
            self.assertEqual(os.listdir(store), [], "the bench left files on the drive")
        text = printed.getvalue()
        s = report["summary"]
        self.assertEqual(report["model"]["params"], params)
        # The run of record's one state slot, said and used (the drive's bytes: one copy of the
        # states, Note [One slot per sub-group]).
        self.assertEqual(report["state_slots"], 1)
        self.assertIn("giving up the torn-step safety", text)
        mp = report["parts"]["memplan"]["result"]
        self.assertEqual(mp["state_slots"], 1)
        self.assertIn("state_slots = 1: each step rewrites", mp["chosen"])
        self.assertGreater(mp["drive_need"]["states_copy"], 12 * params)
        # What the stores took on the drive is what offload() said they would (preallocated),
        # within the index and lock files.
        self.assertLess(abs(mp["drive_bytes"] - mp["drive_need"]["total"]), 1 << 20)
        self.assertEqual(s["states_bytes"], 16 * params)
        self.assertAlmostEqual(s["states_over_ram"], 3.0, places=3)
        # Losses: the slice on the drive against torch in memory, fp32 on the same batches.
        ref = report["parts"]["reference"]["result"]
        self.assertEqual(len(ref["memplan_losses"]), 3)
        self.assertEqual(s["losses"], "PASS")
        self.assertLessEqual(s["max_loss_diff"], 1e-5)
        self.assertIn("PASS, max |diff|", text)
        # Every part ran, each step's figures are there, and the acceptance is judged.
        for part in ("reference", "compute", "memplan"):
            self.assertTrue(report["parts"][part]["ok"], report["parts"][part].get("error"))
        steps = report["parts"]["memplan"]["result"]["steps"]
        self.assertEqual([st["step"] for st in steps], [0, 1, 2])
        self.assertEqual(s["measured_steps"], [1, 2])
        for key in ("step_s", "compute_s", "io_s", "step_over_floor", "memplan_vm_hwm",
                    "peak_rss", "drive_bytes"):
            self.assertGreater(s[key], 0, key)
        self.assertEqual(set(s["acceptance"]), {
            "states (16 B/param) >= 1.5 x RAM", "memplan's bytes on the drive >= 1.5 x RAM",
            "peak RSS <= 60% of RAM", "step <= 1.3 x max(compute, I/O)", "losses"})
        self.assertTrue(s["acceptance"]["states (16 B/param) >= 1.5 x RAM"])
        self.assertTrue(s["acceptance"]["losses"])
        # The bytes a step must move: every optimizer state (master weights and two moments, 12 B
        # a parameter) read and written, the parameters read for forward and for backward (and
        # not more than once more) and written back once (4 B): writes 16 B a parameter (the
        # few padding elements aside), reads 16 to 24.
        write = s["engine_write_bytes_per_step"] / params
        read = s["engine_read_bytes_per_step"] / params
        self.assertGreaterEqual(write, 16.0)
        self.assertLess(write, 16.5)
        self.assertGreaterEqual(read, 16.0)
        self.assertLessEqual(read, 24.5)
        # What the kernel saw the process write (O_DIRECT: nothing cached) is what the engine
        # says it wrote, within the stores' index and headers.
        self.assertLess(abs(s["proc_write_bytes_per_step"] / s["engine_write_bytes_per_step"] - 1),
                        0.05)
        self.assertLessEqual(s["memplan_vm_hwm"], s["peak_rss"])

    def test_the_judge_fails_what_misses(self):
        ram = 100 << 30
        report = {
            "states_bytes": 16 << 30, "states_over_ram": 0.16, "mem_total": ram,
            "drive": {"read_bytes_per_s": 1e9, "write_bytes_per_s": 1e9},
            "parts": {
                "reference": {"ok": True, "peak_rss": 1, "result": {
                    "pass": False, "max_loss_diff": 0.5}},
                "compute": {"ok": True, "peak_rss": 1, "result": {"compute_s": 1.0}},
                "memplan": {"ok": True, "peak_rss": 70 << 30, "result": {
                    "params": 1 << 30, "drive_bytes": 32 << 30, "offload_s": 1.0,
                    "vm_hwm": 70 << 30, "steps": [
                        {"step": i, "s": 10.0, "engine_read_bytes": 2e9,
                         "engine_write_bytes": 1e9} for i in range(3)]}},
                "deepspeed": {"ok": False, "peak_rss": 5 << 30, "error": "killed"}}}
        s = bench.summarize(report, ram)
        self.assertEqual(s["losses"], "FAIL")
        self.assertEqual(s["io_s"], 3.0)
        self.assertAlmostEqual(s["step_over_floor"], 10 / 3)
        self.assertEqual(s["acceptance"], {
            "states (16 B/param) >= 1.5 x RAM": False,
            "memplan's bytes on the drive >= 1.5 x RAM": False,
            "peak RSS <= 60% of RAM": False, "step <= 1.3 x max(compute, I/O)": False,
            "losses": False})
        self.assertIn("did not run: killed", s["deepspeed"])


if __name__ == "__main__":
    unittest.main()
