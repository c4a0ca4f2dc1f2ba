"""memplan.torch across processes (issue 19): ZeRO-3 over torch.distributed (gloo, CPU), launched
by torchrun with 2 ranks, parameters and AdamW states on NVMe; the losses equal plain
torch.optim.AdamW over the same global batch in one process, and each rank holds half the
elements."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dist_worker  # noqa: E402

STEPS = 20
BATCH = 8
LR = 3e-3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc, args, timeout=240):
    """Runs tests/python/dist_worker.py under torchrun; returns (exit status, output)."""
    # --redirects/--tee 2: Debian's torch 1.13 cannot parse their default "0" under Python 3.11
    # (IntFlag no longer iterates the zero member), and "2" (stderr to a log, teed) is harmless
    # on every version. The rendezvous port is a free one: tests may run side by side.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--redirects", "2", "--tee", "2",
           os.path.join(HERE, "dist_worker.py")] + args
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, check=False)
    return done.returncode, done.stdout


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def reference(kind):
    """Plain torch.optim.AdamW over the whole global batch, one process."""
    model, loss_of = dist_worker.build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for tokens in dist_worker.global_batches(STEPS, BATCH):
        optimizer.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


class DistributedTest(unittest.TestCase):
    def check(self, kind):
        with tempfile.TemporaryDirectory() as tmp:
            nvme = os.path.join(tmp, "swap")
            status, output = torchrun(2, ["--model", kind, "--nvme", nvme, "--out", tmp,
                                          "--steps", str(STEPS), "--batch", str(BATCH),
                                          "--lr", str(LR)])
            self.assertEqual(status, 0, output[-4000:])
            ranks = []
            for r in range(2):
                with open(os.path.join(tmp, f"rank{r}.json"), encoding="utf-8") as f:
                    ranks.append(json.load(f))
                # Each rank's stores are its own, under <path>/rank<r>/.
                self.assertTrue(os.path.isdir(os.path.join(nvme, f"rank{r}", "optimizer")))
            weights = torch.load(os.path.join(tmp, "weights.pt"))
        ref_losses, ref_weights = reference(kind)
        self.assertEqual(ranks[0]["losses"], ranks[1]["losses"])
        self.assertEqual(ranks[0]["checksum"], ranks[1]["checksum"])
        losses = ranks[0]["losses"]
        self.assertEqual(len(losses), STEPS)
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        self.assertLessEqual(diff, 1e-5, f"{kind}: losses {losses} vs {ref_losses}")
        self.assertLess(losses[-1], losses[0] - 0.5, "the model learned nothing")
        # The trained weights (gathered from both ranks' shards) are the reference's.
        names = [n for n in ref_weights if n in weights]
        self.assertGreater(len(names), 0)
        for name in names:
            self.assertLess((weights[name] - ref_weights[name]).abs().max().item(), 1e-4, name)
        for r, result in enumerate(ranks):
            stats = result["stats"]
            self.assertEqual(stats["rank"], r)
            self.assertEqual(stats["world_size"], 2)
            self.assertEqual(stats["steps"], STEPS)
            # Half the elements each (a shard of every parameter, padded to an even size).
            self.assertLessEqual(stats["partition_elements"] * 2,
                                 stats["elements"] + stats["params"])
            self.assertGreaterEqual(stats["partition_elements"] * 2, stats["elements"])
            # Parameters and optimizer on NVMe: read every step; gradients reduce-scattered.
            self.assertGreaterEqual(stats["param"]["nvme_read_bytes"],
                                    STEPS * 4 * stats["partition_elements"])
            self.assertGreaterEqual(stats["optimizer_write_bytes"],
                                    STEPS * 12 * stats["partition_elements"])
            self.assertGreater(stats["reduce_scatter_bytes"], 0)

    def test_toy_gpt_two_ranks_equal_one_process(self):
        self.check("gpt")

    def test_llama_two_ranks_equal_one_process(self):
        self.check("llama")

    def test_sigkill_of_one_rank_resumes_both_to_identical_weights(self):
        # Rank 1 is SIGKILLed after its backward of step 4, once rank 0 has committed step 4:
        # the ranks' stores are a step apart. The restarted run resumes both at step 4 (the
        # step both completed) and ends with the weights of a run never interrupted, bit for
        # bit. The uninterrupted run also saves a checkpoint from both ranks, which
        # from_pretrained loads to the same logits.
        steps, kill = 8, 4
        common = ["--model", "llama", "--steps", str(steps), "--batch", str(BATCH),
                  "--lr", str(LR)]
        with tempfile.TemporaryDirectory() as tmp:
            whole, broken = os.path.join(tmp, "whole"), os.path.join(tmp, "broken")
            os.makedirs(whole)
            os.makedirs(broken)
            ckpt = os.path.join(whole, "ckpt")
            status, output = torchrun(2, common + ["--nvme", os.path.join(whole, "swap"),
                                                   "--out", whole, "--save", ckpt])
            self.assertEqual(status, 0, output[-4000:])
            nvme = os.path.join(broken, "swap")
            status, output = torchrun(2, common + ["--nvme", nvme, "--out", broken,
                                                   "--kill-step", str(kill)])
            self.assertNotEqual(status, 0, "the killed run should fail")
            self.assertTrue(os.path.exists(os.path.join(broken, "committed")))
            status, output = torchrun(2, common + ["--nvme", nvme, "--out", broken,
                                                   "--resume"])
            self.assertEqual(status, 0, output[-4000:])
            want = [read_json(os.path.join(whole, f"rank{r}.json")) for r in range(2)]
            got = [read_json(os.path.join(broken, f"rank{r}.json")) for r in range(2)]
            for r in range(2):
                self.assertEqual(got[r]["resumed_step"], kill)
                self.assertEqual(got[r]["stats"]["epoch"], steps)
                self.assertEqual(got[r]["checksum"], want[r]["checksum"])
                self.assertEqual(got[r]["losses"], want[r]["losses"][kill:])
            self.assertEqual(got[0]["checksum"], got[1]["checksum"])
            # The checkpoint of the uninterrupted run, written by two ranks.
            import transformers
            self.assertTrue(os.path.exists(os.path.join(ckpt, "model.safetensors")))
            self.assertTrue(os.path.exists(os.path.join(ckpt, "config.json")))
            loaded = transformers.LlamaForCausalLM.from_pretrained(
                ckpt, attn_implementation="eager")
            with torch.no_grad():
                logits = loaded(input_ids=dist_worker.global_batches(1, 2)[0]).logits
            self.assertTrue(torch.equal(logits, torch.load(os.path.join(whole, "logits.pt"))))
            self.assertEqual(sorted(os.listdir(whole)).count("ckpt"), 1)
            self.assertFalse([n for n in os.listdir(whole) if n.startswith(".memplan-save")])

    def test_clipping_over_two_ranks_and_a_checkpoint_resumed_by_one_process(self):
        # Issue 31: clip_grad_norm_ over ZeRO-3 shards is torch's over the whole model (the
        # global norm of the mean gradient), and the optimizer checkpoint two ranks wrote loads
        # into one process, which carries on as the two would have.
        steps, at, clip = 8, 4, 0.5
        with tempfile.TemporaryDirectory() as tmp:
            status, output = torchrun(2, ["--model", "gpt", "--nvme", os.path.join(tmp, "swap"),
                                          "--out", tmp, "--steps", str(steps), "--batch",
                                          str(BATCH), "--lr", str(LR), "--clip", str(clip),
                                          "--checkpoint-at", str(at)])
            self.assertEqual(status, 0, output[-4000:])
            ranks = [read_json(os.path.join(tmp, f"rank{r}.json")) for r in range(2)]
            ckpt = os.path.join(tmp, "ckpt")
            self.assertEqual(sorted(os.listdir(ckpt)), ["memplan-checkpoint.json",
                                                        "rank0-of-2.safetensors",
                                                        "rank1-of-2.safetensors"])
            whole = torch.load(os.path.join(tmp, "weights.pt"))
            # The reference: one process, the global batch, torch's clip_grad_norm_ and AdamW.
            model, loss_of = dist_worker.build("gpt")
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
            ref_losses, ref_norms = [], []
            for tokens in dist_worker.global_batches(steps, BATCH):
                loss = loss_of(model, tokens)
                loss.backward()
                ref_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
                opt.step()
                opt.zero_grad()
                ref_losses.append(loss.item())
            self.assertEqual(ranks[0]["norms"], ranks[1]["norms"])
            for a, b in zip(ranks[0]["norms"], ref_norms):
                self.assertAlmostEqual(a, b, delta=1e-5 * b)
            self.assertTrue(any(n > clip for n in ref_norms))
            self.assertLess(max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref_losses)),
                            1e-5)
            # One process loads the 2-rank checkpoint and trains the rest.
            import memplan.torch
            fresh, loss_of = dist_worker.build("gpt")
            trainer = memplan.torch.offload(fresh, lr=LR, weight_decay=0.01)
            trainer.load_checkpoint(ckpt)
            for tokens in dist_worker.global_batches(steps, BATCH)[at:]:
                loss_of(fresh, tokens).backward()
                torch.nn.utils.clip_grad_norm_(fresh.parameters(), clip)
                trainer.step()
            got = trainer.master_weights()
            trainer.close()
            for name, w in whole.items():
                self.assertLess((got[name] - w).abs().max().item(), 1e-5, name)
            # And the checkpoint consolidates to whole weights (zero_to_fp32's job).
            state = memplan.torch.consolidate_checkpoint(ckpt)
            self.assertEqual(sorted(state), sorted(got))

    def test_process_group_without_torch_distributed_is_refused(self):
        import memplan.torch
        model, _ = dist_worker.build("gpt")
        with self.assertRaisesRegex(ValueError, "not initialised"):
            memplan.torch.offload(model, process_group=object())


if __name__ == "__main__":
    unittest.main()
