"""Unit tests of memplan.trace's pieces, with figures computed by hand (run in the modern
environment: torch 2.15, Transformers 5; tests/trace/CMakeLists.txt)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan import trace, trace_cuda, trace_grid


def rounded(nbytes):
    return -(-nbytes // 512) * 512 if nbytes else 0


class AllocatorRounding(unittest.TestCase):
    def test_known_sizes(self):
        # CUDACachingAllocator round_size: kMinBlockSize 512, nothing for 0 bytes.
        cases = {0: 0, 1: 512, 4: 512, 511: 512, 512: 512, 513: 1024, 1024: 1024,
                 1000000: 1000448, 2**20: 2**20, 2**20 + 1: 2**20 + 512}
        for nbytes, expected in cases.items():
            self.assertEqual(trace_cuda.round_allocation(nbytes), expected, nbytes)


class TwoLinearMLP(unittest.TestCase):
    """A 2-Linear MLP whose parameters, gradients and saved activations are known to the byte:
    x [4, 100] fp32 -> Linear(100, 300) -> ReLU -> Linear(300, 10) -> sum."""

    def trace(self, optimizer):
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = torch.nn.Sequential(torch.nn.Linear(100, 300), torch.nn.ReLU(),
                                        torch.nn.Linear(300, 10))
            x = torch.empty(4, 100)
            opt = optimizer(model.parameters())

            def forward_loss():
                return model(x).sum()
            target = trace.Target(model, opt, [model[0], model[2]], None, forward_loss,
                                  inputs=(x,))
            return trace.trace_target(target, (8, 0))

    params = rounded(300 * 100 * 4) + rounded(300 * 4) + rounded(10 * 300 * 4) + rounded(10 * 4)
    workspace = 4096 * 1024 * 2 + 16 * 1024 * 8   # cuBLAS on sm80
    x = rounded(4 * 100 * 4)

    def test_sgd_categories(self):
        r = self.trace(lambda p: torch.optim.SGD(p, lr=0.1, foreach=True))
        self.assertEqual(self.params, 134656)
        start = r["step_start"]["categories"]
        self.assertEqual(start["parameters"], self.params)
        self.assertEqual(start["optimizer_states"], 0)
        self.assertEqual(start["gradients"], 0)   # zero_grad(set_to_none=True)
        self.assertEqual(start["other"], self.workspace + self.x)
        self.assertEqual(start["activations"] + start["temporaries"], 0)
        fwd = r["phases"]["forward"]["categories"]
        # During ReLU: its input (addmm's output, 4 x 300 fp32) and its output (saved).
        self.assertEqual(fwd["activations"], 2 * rounded(4 * 300 * 4))
        step = r["phases"]["optimizer_step"]["categories"]
        self.assertEqual(step["gradients"], self.params)
        self.assertEqual(step["optimizer_transients"], 0)  # foreach SGD updates in place
        self.assertEqual(r["peak"]["step"], 2)

    def test_adamw_states(self):
        r = self.trace(lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True))
        # exp_avg and exp_avg_sq per parameter; the step counters live on the CPU.
        self.assertEqual(r["step_start"]["categories"]["optimizer_states"], 2 * self.params)
        # foreach AdamW: sqrt(exp_avg_sq) for the whole group at once.
        self.assertGreaterEqual(
            r["phases"]["optimizer_step"]["categories"]["optimizer_transients"], self.params)


class Torchtitan(unittest.TestCase):
    """torchtitan 0.3 under FSDP2 on a fake process group: a small Llama (hidden 256, 4 heads,
    2 KV heads, MLP 512, vocabulary 1024), 2 x 256 tokens, figures counted by hand."""

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
              "vocab_size": 1024, "num_hidden_layers": 2, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}
    b, s, d, kv, ffn, vocab = 2, 256, 256, 128, 512, 1024

    def trace(self, **kw):
        setup = dict(framework="torchtitan", model=self.config, micro_batch=self.b,
                     seq_len=self.s, precision="bf16-mixed", optimizer="adamw-fused",
                     checkpointing="none", loss="chunked", loss_chunks=4)
        setup.update(kw)
        return trace.run(setup)

    def fp32_params(self, ranks):
        # FSDP2 shards every parameter on dim 0 (padded to a multiple of the ranks); each rank
        # holds one fp32 shard, allocated on its own.
        d, kv, ffn, v = self.d, self.kv, self.ffn, self.vocab
        shapes = [(v, d), (d,), (v, d)] + 2 * [(d + 2 * kv, d), (d, d), (ffn, d), (d, ffn),
                                               (ffn, d), (d,), (d,)]
        total = 0
        for shape in shapes:
            rows = -(-shape[0] // ranks)
            rest = shape[1] if len(shape) > 1 else 1
            total += rounded(rows * rest * 4)
        return total

    def test_parameters_and_states_shard_over_ranks(self):
        for ranks in (1, 4):
            r = self.trace(ranks=ranks)
            start = r["step_start"]["categories"]
            self.assertEqual(start["parameters"], self.fp32_params(ranks), ranks)
            # fused AdamW: exp_avg, exp_avg_sq per shard, and a step counter (one fp32 on the
            # GPU, rounded to 512 bytes) per parameter.
            self.assertEqual(start["optimizer_states"],
                             2 * self.fp32_params(ranks) + 17 * 512, ranks)
            # Two RoPE caches (complex64, seq x head_dim / 2), one per block.
            self.assertEqual(start["buffers"], 2 * rounded(self.s * 32 * 8))
            self.assertEqual(r["model"]["ranks"], ranks)

    def per_layer_forward(self, checkpointing):
        one = self.trace(checkpointing=checkpointing, layers=1)
        two = self.trace(checkpointing=checkpointing, layers=2)
        return (two["phases"]["forward"]["categories"]["activations"] -
                one["phases"]["forward"]["categories"]["activations"])

    def test_checkpointing_policies_keep_what_torchtitan_saves(self):
        tokens = self.b * self.s
        bf16 = lambda width: rounded(tokens * width * 2)
        lse = rounded(self.b * 4 * self.s * 4)   # flash's fp32 log-sum-exp per head and token
        rng = 2 * 512                             # and its RNG seed and offset
        # FullAC: each block keeps its input.
        self.assertEqual(self.per_layer_forward("full"), bf16(self.d))
        # SelectiveAC (op): the input, the outputs of the 1st, 3rd and 5th matmuls (wqkv, w1,
        # w2; wo and w3 are recomputed) and all the attention op returns.
        self.assertEqual(self.per_layer_forward("op"),
                         bf16(self.d) + bf16(self.d + 2 * self.kv) + bf16(self.ffn) +
                         bf16(self.d) + bf16(self.d) + lse + rng)

    def test_chunked_loss_keeps_one_chunk_of_logits(self):
        chunked = self.trace()["phases"]["loss"]["categories"]
        full = self.trace(loss="full")["phases"]["loss"]["categories"]
        # The full loss holds the bf16 logits, their fp32 copy and log_softmax's fp32 output at
        # once; the chunked loss a quarter of that at a time, plus an fp32 gradient of the
        # hidden states.
        logits = self.b * self.s * self.vocab
        self.assertGreaterEqual(full["activations"] - chunked["activations"],
                                rounded(logits * 10) - rounded(logits * 10 // 4) -
                                rounded(self.b * self.s * self.d * 4))

    def test_refusals_name_the_field(self):
        for kw, field in ((dict(checkpointing="selective"), "checkpointing"),
                          (dict(precision="bf16"), "precision"),
                          (dict(loss_chunks=3), "loss_chunks"),
                          (dict(checkpoint_every=2), "checkpoint_every"),
                          (dict(attention="eager"), "attention")):
            with self.assertRaises(trace.TraceError) as caught:
                self.trace(**kw)
            self.assertTrue(str(caught.exception).startswith(field + ":"), caught.exception)


class CudaSemantics(unittest.TestCase):
    def test_autocast_policy_matches_cuda_kernels(self):
        missing, extra, differ = trace_cuda.verify_autocast_policy()
        self.assertEqual((missing, extra, differ), ([], [], []))

    def test_no_device_autocast_query_sees_the_emulated_cuda_autocast(self):
        # torch.is_autocast_enabled() asks about CUDA; code that casts by hand under autocast
        # (llm-foundry's LPLayerNorm) must see the emulated CUDA autocast, and nothing after.
        self.assertFalse(torch.is_autocast_enabled())
        with trace_cuda.CudaAutocastPolicy():
            self.assertFalse(torch.is_autocast_enabled())
            with trace_cuda.CudaAutocast(torch.bfloat16):
                self.assertTrue(torch.is_autocast_enabled())
                self.assertTrue(torch.is_autocast_enabled("cpu"))
                self.assertFalse(torch.is_autocast_enabled("cuda"))
                with FakeTensorMode():
                    ln = torch.nn.LayerNorm(64, bias=False)
                    x = torch.empty(8, 64, requires_grad=True)
                    # LPLayerNorm.forward, as llmfoundry/models/layers/norm.py writes it.
                    xc = x.to(torch.bfloat16) if torch.is_autocast_enabled() else x
                    with torch.autocast(enabled=False, device_type="cpu"):
                        y = torch.nn.functional.layer_norm(xc, (64,), ln.weight.to(xc.dtype))
                    self.assertEqual(y.dtype, torch.bfloat16)
        self.assertFalse(torch.is_autocast_enabled())

    def test_sdpa_backend_choice(self):
        with FakeTensorMode():
            q = torch.empty(2, 32, 512, 128, dtype=torch.bfloat16, requires_grad=True)
            k = torch.empty(2, 8, 512, 128, dtype=torch.bfloat16, requires_grad=True)
            pick = trace_cuda.select_sdpa_backend
            self.assertEqual(pick((8, 0), q, k, k, None, 0.0, True, True), "flash")
            self.assertEqual(pick((9, 0), q, k, k, None, 0.0, True, True), "cudnn")
            self.assertEqual(pick((7, 0), q, k, k, None, 0.0, True, True), "math")
            mask = torch.empty(2, 1, 512, 512, dtype=torch.bool)
            self.assertEqual(pick((8, 0), q, k, k, mask, 0.0, False, True), "efficient")
            q32 = torch.empty(2, 32, 512, 128, requires_grad=True)
            self.assertEqual(pick((8, 0), q32, q32, q32, None, 0.0, True, False), "efficient")

    def test_flash_saves_what_cuda_saves(self):
        with FakeTensorMode(), trace_cuda.CudaSemantics((8, 0)):
            q = torch.empty(1, 4, 256, 64, dtype=torch.bfloat16, requires_grad=True)
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            node = out.grad_fn
            while node is not None and "Flash" not in node.name():
                node = node.next_functions[0][0]
            self.assertIsNotNone(node)
            self.assertEqual(tuple(node._saved_logsumexp.shape), (1, 4, 256))
            self.assertEqual(node._saved_logsumexp.dtype, torch.float32)

    def test_math_backend_runs_the_composite_in_fp32(self):
        # sm70 with bf16: the math backend. CUDA runs _scaled_dot_product_attention_math (16-bit
        # inputs computed in fp32, the score matrix kept for softmax's backward), with autocast
        # excluded below SDPA's autocast kernel: not the CPU's fused flash kernel, nor matmuls
        # cast back to bf16 by the autocast policy.
        with FakeTensorMode(), trace_cuda.CudaSemantics((7, 0)), \
                trace_cuda.CudaAutocast(torch.bfloat16):
            q = torch.empty(1, 4, 256, 64, requires_grad=True)
            k = torch.empty(1, 2, 256, 64, requires_grad=True)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                                   enable_gqa=True)
            self.assertEqual(out.dtype, torch.bfloat16)
            names, node, seen = set(), out.grad_fn, []
            stack = [out.grad_fn]
            while stack:
                node = stack.pop()
                if node is None or node in seen:
                    continue
                seen.append(node)
                names.add(node.name())
                if node.name() == "SafeSoftmaxBackward0":
                    self.assertEqual(tuple(node._saved_result.shape), (1, 4, 256, 256))
                    self.assertEqual(node._saved_result.dtype, torch.float32)
                if node.name() == "BmmBackward0":
                    self.assertEqual(node._saved_self.dtype, torch.float32)
                stack.extend(n for n, _ in node.next_functions)
            self.assertIn("SafeSoftmaxBackward0", names)
            self.assertFalse(any("Flash" in n for n in names), names)

    def test_dropout_and_norms(self):
        with FakeTensorMode(), trace_cuda.CudaSemantics((8, 0)):
            x = torch.empty(16, 32, dtype=torch.bfloat16, requires_grad=True)
            d = torch.nn.functional.dropout(x, 0.1)
            self.assertEqual(d.grad_fn.name(), "NativeDropoutBackward0")
            self.assertEqual(d.grad_fn._saved_result1.dtype, torch.bool)
            n = torch.nn.functional.rms_norm(x, (32,))
            self.assertEqual(n.grad_fn.name(), "FusedRmsNormBackward")
            self.assertEqual(n.grad_fn.saved_tensors[1].dtype, torch.float32)
            ln = torch.nn.functional.layer_norm(x, (32,))
            self.assertEqual(ln.grad_fn._saved_result1.dtype, torch.float32)


class Cli(unittest.TestCase):
    def run_cli(self, *args):
        env = dict(os.environ)
        return subprocess.run([sys.executable, "-m", "memplan.trace"] + list(args),
                              capture_output=True, text=True, env=env)

    def test_bad_field_named(self):
        r = self.run_cli("--model", "llama-3.2-1b", "--precision", "bf17")
        self.assertEqual(r.returncode, 2)
        self.assertIn("precision", r.stderr)
        self.assertEqual(r.stdout, "")
        r = self.run_cli("--model", "no-such-model")
        self.assertEqual(r.returncode, 2)
        self.assertIn("model", r.stderr)

    def test_output_file_and_listing(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "t.json")
            r = self.run_cli("--model", "llama-3.2-1b", "--layers", "1", "--seq-len", "128",
                             "--saved-tensors", "-o", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(out, encoding="utf-8") as f:
                result = json.load(f)
            self.assertEqual(result["format"], trace.FORMAT)
            self.assertEqual(result["peak"]["bytes"] % 512, 0)
            nodes = {row["node"] for row in result["saved_tensors"]["ops"]}
            self.assertIn("ScaledDotProductFlashAttentionBackward0", nodes)
            self.assertGreater(result["saved_tensors"]["block_saved_bytes"], 0)
            self.assertEqual(sorted(os.listdir(d)), ["t.json"])


class Adapters(unittest.TestCase):
    def run_setup(self, **fields):
        setup = dict(framework="transformers", layers=1, micro_batch=1, seq_len=128,
                     precision="bf16-mixed", lora_rank=8, **fields)
        return trace.run(setup)

    def test_lora_on_a_masked_lm(self):
        # PEFT's causal-LM wrapper asks a masked LM for prepare_inputs_for_generation: the
        # encoders take the plain PeftModel. LoRA on query and value of one layer, r = 8.
        result = self.run_setup(model="bert-base-uncased")
        self.assertEqual(result["model"]["trainable_params"], 2 * (768 * 8 + 8 * 768))
        self.assertGreater(result["peak"]["categories"]["activations"], 0)

    def test_lora_with_checkpointing_starts_each_step_clean(self):
        # Note [The tracker's hooks keep a leaf alive]: the embeddings' output, a leaf that
        # requires grad under PEFT + checkpointing, and its gradient do not outlive a step.
        result = self.run_setup(model="llama-3.2-1b", checkpointing="full")
        start = result["step_start"]["categories"]
        self.assertEqual(start["activations"], 0)
        self.assertEqual(start["temporaries"], 0)


    def test_a_checkpointed_step_has_no_packed_sequence_mask(self):
        # With gradient checkpointing there is no cache, and Transformers looks for packed
        # sequences in the position ids; on fake tensors its is_tracing() answered "packed" and
        # made a mask (the memory-efficient kernel, repeated keys and values). Real arange
        # positions give none, and SDPA runs causal: flash on an A100.
        result = self.run_setup(model="llama-3.2-1b", checkpointing="full")
        self.assertEqual(set(result["sdpa_backends"]), {"flash"})

    def test_a_classifiers_loss_phase_starts_at_its_head(self):
        # The loss phase starts when the output head's forward ends: for a token classifier its
        # classifier Linear, so the cross entropy the model's forward computes is in the loss
        # phase, as a language model's is (it was in the forward phase).
        config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracle",
                              "modern_configs", "bert-base-ner.json")
        result = self.run_setup(model=config)
        self.assertEqual(result["phases"]["loss"]["op"], "aten.nll_loss_forward.default")


class ModuleHooks(unittest.TestCase):
    def chunk_gradients_alive(self, tracer_hooks):
        # torchtune's chunked output in small: a head run per chunk of the sequence, and a loss
        # module whose inputs are the chunks' logits. Returns, after each chunk's projection has
        # run its backward, which chunks' logits gradients are still alive.
        import contextlib
        from torch.distributed._tools.mod_tracker import ModTracker
        from torch.multiprocessing.reductions import StorageWeakRef

        class Loss(torch.nn.Module):
            def forward(self, chunks):
                return sum((c.float() ** 2).sum() for c in chunks)

        class Head(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.output = torch.nn.Linear(8, 64, bias=False)

            def forward(self, h):
                return [self.output(c) for c in h.chunk(4, dim=1)]

        head, loss_fn = Head(), Loss()
        h = torch.randn(2, 16, 8, requires_grad=True)
        grads, alive = {}, []
        hooks = trace._ModuleHooksPerPass() if tracer_hooks else contextlib.nullcontext()
        with hooks, ModTracker():
            logits = head(h)
            for i, chunk in enumerate(logits):
                chunk.register_hook(
                    lambda g, i=i: grads.__setitem__(i, StorageWeakRef(g.untyped_storage())))
                node = chunk.grad_fn
                while "Mm" not in type(node).__name__:
                    node = node.next_functions[0][0]
                node.register_hook(lambda gi, go, i=i: alive.append(
                    (i, sorted(k for k, r in grads.items() if k != i and not r.expired()))))
            loss = loss_fn(logits)
            del logits
            loss.backward()
        return alive

    def test_module_input_hooks_hold_no_gradients(self):
        # Note [The tracker's hooks hold gradients]: torch's "all" multi-grad hook on the loss
        # module's inputs keeps every chunk's logits gradient until the last chunk's arrives; the
        # tracer's keeps none, as training without the tracker.
        held = self.chunk_gradients_alive(tracer_hooks=False)
        self.assertEqual(held[:3], [(3, []), (2, [3]), (1, [2, 3])])
        freed = self.chunk_gradients_alive(tracer_hooks=True)
        self.assertEqual([i for i, _ in freed], [3, 2, 1, 0])
        self.assertEqual([others for _, others in freed], [[], [], [], []])


class Grid(unittest.TestCase):
    def test_points_and_holdout_are_deterministic(self):
        ids = [p["id"] for p in trace_grid.points()]
        self.assertEqual(len(ids), len(set(ids)))
        self.assertGreaterEqual(len(ids), 300)
        held = trace_grid.holdout_ids(ids)
        self.assertEqual(held, trace_grid.holdout_ids(list(reversed(ids))))
        # About a fifth, each point's lot its own: a point's place does not depend on the others.
        self.assertLess(abs(len(held) - len(ids) / 5), 3 * (len(ids) * 0.16) ** 0.5)
        self.assertEqual(held - {ids[0]}, trace_grid.holdout_ids(ids[1:]))
        self.assertTrue(trace_grid.held_out(sorted(held)[0]))
        for pid in trace_grid.CI_SAMPLE:
            self.assertIn(pid, ids)


if __name__ == "__main__":
    unittest.main()
