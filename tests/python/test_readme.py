"""Every command the README shows and every example of `memplan <command> --help` runs, and does
what the text says (issue 16: the README's own `plan` examples once failed with "no plan fits").

What is run:
- README.md's fenced blocks: `sh` lines that call build/tools/memplan (after the set-up step),
  `$ memplan ...` lines of the sample output blocks, and the `python` blocks, with `model` and
  `data` defined as a tiny module and its batches, and the NVMe path of the example made a
  temporary directory;
- the lines that start with `memplan ` in each subcommand's --help (under "Examples").

Each runs in a scratch directory that holds the files the examples name (ds_config.json and
schedule.json written by `memplan plan`, a config.json, an NVMe bench report), with the Hub
offline. A command succeeds
(exit 0, output on stdout) unless it is listed in EXPECTED_FAILURES with the message the README
gives for it. A README or --help example that names a file this test does not make fails here, so
an example cannot quietly stop working.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import unittest

MEMPLAN = os.environ["MEMPLAN_BINARY"]
SOURCE = os.environ["MEMPLAN_SOURCE_DIR"]
README = os.path.join(SOURCE, "README.md")

# Commands that must fail, with a part of the error they must give: none today.
EXPECTED_FAILURES = {}

SUBCOMMANDS = ["estimate", "inventory", "models", "plan", "check", "bench", "capacity",
               "calibrate"]


def fenced_blocks(text):
    """(language, [lines]) for each ``` block of a Markdown text."""
    blocks, lang, lines = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if lines is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks.append((lang, lines))
                lang, lines = None, None
        elif lines is not None:
            lines.append(line)
    return blocks


def joined(lines):
    """The lines with shell continuations (a trailing backslash) joined."""
    out = []
    for line in lines:
        if out and out[-1].endswith("\\"):
            out[-1] = out[-1][:-1] + " " + line.strip()
        else:
            out.append(line)
    return out


def readme_commands(text):
    """The memplan command lines of the README, as argument lists without the program."""
    commands = []
    for lang, lines in fenced_blocks(text):
        for line in joined(lines):
            if lang == "sh" and "memplan " in line:
                # "bash scripts/setup.sh && build/tools/memplan ...": the set-up ran already.
                line = line.split("&&")[-1].strip()
                args = shlex.split(line)
                if os.path.basename(args[0]) == "memplan":
                    commands.append(args[1:])
            elif lang == "" and line.startswith("$ memplan "):
                commands.append(shlex.split(line[2:])[1:])
    return commands


def help_examples():
    """The `memplan ...` lines of each subcommand's --help, as argument lists."""
    commands = []
    for sub in SUBCOMMANDS:
        out = subprocess.run([MEMPLAN, sub, "--help"], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            line = line.strip()
            if line.startswith("memplan "):
                commands.append(shlex.split(line)[1:])
    return commands


def python_blocks(text):
    return ["\n".join(lines) for lang, lines in fenced_blocks(text) if lang == "python"]


class ReadmeCommands(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="memplan-readme.")
        cls.env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=os.path.join(cls.tmp, "hf"))
        # The files the examples name.
        subprocess.run([MEMPLAN, "plan", "--model", "llama-2-7b", "--gpu", "a100-80", "--gpus",
                        "8", "--global-batch", "64", "--emit-deepspeed", "ds_config.json"],
                       cwd=cls.tmp, env=cls.env, check=True, capture_output=True)
        subprocess.run([MEMPLAN, "plan", "--model", "llama-2-7b", "--gpu", "h100-80", "--gpus",
                        "8", "--global-batch", "64", "--accelerate-plugin", "fsdp",
                        "--emit-accelerate", "fsdp.yaml"],
                       cwd=cls.tmp, env=cls.env, check=True, capture_output=True)
        subprocess.run([MEMPLAN, "plan", "--model", "llama-2-7b", "--gpu", "rtx4090", "--cpu-mem",
                        "64GiB", "--nvme-path", "/mnt/nvme", "--nvme-capacity", "1TiB",
                        "--global-batch", "16", "--emit-schedule", "schedule.json"],
                       cwd=cls.tmp, env=cls.env, check=True, capture_output=True)
        shutil.copy(os.path.join(SOURCE, "estimator", "models", "llama-2-7b.json"),
                    os.path.join(cls.tmp, "config.json"))
        with open(os.path.join(cls.tmp, "nvme.json"), "w") as f:
            json.dump({"best": {"read_bytes_per_s": 3.5e9, "write_bytes_per_s": 2.8e9}}, f)
        # capacity's GPU types with prices, and calibrate's measured runs and their calibration.
        with open(os.path.join(cls.tmp, "offers.json"), "w") as f:
            json.dump({"gpus": ["a100-80", {"preset": "h100-80", "price_per_gpu_hour": 2.9}],
                       "cpu_memory_bytes": "1TiB"}, f)
        runs = []
        for i, (mb, seq, step) in enumerate([(1, 1024, 2.9), (2, 2048, 10.4), (4, 4096, 41.0)]):
            runs.append({"id": f"run{i}", "model": "llama-2-7b",
                         "cluster": {"gpu": "a100-80", "gpus_per_node": 8},
                         "setup": {"zero_stage": 3, "checkpointing": "full", "micro_batch": mb,
                                   "grad_accum": 4, "seq_len": seq},
                         "step_time_s": step})
        with open(os.path.join(cls.tmp, "runs.json"), "w") as f:
            json.dump({"format": "memplan.runs/1", "runs": runs}, f)
        subprocess.run([MEMPLAN, "calibrate", "runs.json", "-o", "calibration.json"],
                       cwd=cls.tmp, env=cls.env, check=True, capture_output=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def run_memplan(self, args):
        """Runs one example in a fresh copy of the fixtures (an example that writes
        ds_config.json must not change what the next one reads)."""
        key = " ".join(args)
        self.cwd = tempfile.mkdtemp(dir=self.tmp)
        for name in ("ds_config.json", "config.json", "nvme.json", "offers.json", "runs.json",
                     "calibration.json", "schedule.json", "fsdp.yaml"):
            shutil.copy(os.path.join(self.tmp, name), self.cwd)
        with self.subTest(command=key):
            run = subprocess.run([MEMPLAN] + args, cwd=self.cwd, env=self.env,
                                 capture_output=True, text=True, timeout=120)
            if key in EXPECTED_FAILURES:
                self.assertEqual(run.returncode, 2, run.stdout)
                self.assertIn(EXPECTED_FAILURES[key], run.stderr)
            else:
                self.assertEqual(run.returncode, 0, f"memplan {key}\n{run.stderr}")
                self.assertTrue(run.stdout.strip(), f"memplan {key}: no output")
                self.assertEqual(run.stderr, "", f"memplan {key}")
            return run

    def test_readme_commands(self):
        commands = readme_commands(open(README).read())
        self.assertGreaterEqual(len(commands), 2)
        for args in commands:
            self.run_memplan(args)

    def test_help_examples(self):
        commands = help_examples()
        self.assertGreaterEqual(len(commands), 10)
        for args in commands:
            run = self.run_memplan(args)  # None when it failed (recorded by its subTest)
            # Files an example writes go where it says.
            for flag in ("--emit-deepspeed", "--svg", "-o"):
                if flag in args and run is not None and run.returncode == 0:
                    self.assertTrue(os.path.exists(os.path.join(self.cwd, args[args.index(flag) + 1])))

    def test_readme_python(self):
        blocks = python_blocks(open(README).read())
        self.assertGreaterEqual(len(blocks), 2)
        import torch  # the examples' `model`: a tiny module whose forward returns a loss

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Linear(8, 8)
                self.out = torch.nn.Linear(8, 1)

            def forward(self, x):
                return self.out(torch.relu(self.inner(x))).pow(2).mean()

        nvme = os.path.join(self.tmp, "run1")
        os.makedirs(nvme, exist_ok=True)
        old_env = dict(os.environ)
        os.environ.update(HF_HUB_OFFLINE="1")
        try:
            for code in blocks:
                with self.subTest(block=code.splitlines()[0]):
                    torch.manual_seed(0)
                    scope = {"model": Tiny(), "data": [torch.randn(4, 8) for _ in range(3)]}
                    exec(compile(code.replace("/mnt/nvme/run1", nvme), "README.md", "exec"), scope)
        finally:
            os.environ.clear()
            os.environ.update(old_env)


if __name__ == "__main__":
    unittest.main()
