"""memplan.torch on the models people fine-tune (issue 19): LoRA adapters training on a frozen base
that streams from NVMe, and Transformers causal LMs (Llama, GPT-2, Qwen2 shapes, random init, no
download), each against plain PyTorch."""
import os
import tempfile
import unittest

import torch
from torch import nn
import torch.nn.functional as F

import memplan.torch


class LoraLinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update, as PEFT's LoRA (B starts at zero)."""

    def __init__(self, features, rank=4, alpha=8):
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(features, rank, bias=False)
        self.lora_B = nn.Linear(rank, features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


class LoraModel(nn.Module):
    def __init__(self, vocab=256, hidden=384, layers=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.embed.requires_grad_(False)
        self.layers = nn.ModuleList(LoraLinear(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.requires_grad_(False)

    def forward(self, tokens):
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = x + F.gelu(layer(x))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def token_batches(steps, batch=4, seq=17, vocab=256, seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        out.append((start + 3 * torch.arange(seq).unsqueeze(0)) % vocab)
    return out


def reference_losses(model, batches, loss_of, lr):
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    losses = []
    for tokens in batches:
        optimizer.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


class LoraTest(unittest.TestCase):
    def test_adapters_train_on_a_frozen_base_streamed_from_nvme(self):
        steps, lr = 8, 1e-2
        torch.manual_seed(0)
        model = LoraModel()
        torch.manual_seed(0)
        ref = LoraModel()
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        base_bytes = 4 * sum(p.numel() for p in base.values())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        batches = token_batches(steps)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = memplan.torch.offload(
                model, os.path.join(tmp, "swap"), lr=lr, weight_decay=0.01,
                pinned_budget_bytes=1 << 20, sub_group_elements=8 << 10,
                param_buffer_bytes=128 << 10, direct=False)
            start = trainer.stats()
            losses = []
            for tokens in batches:
                loss = model(tokens)
                loss.backward()
                trainer.step()
                losses.append(loss.item())
            stats = trainer.stats()
            trainer.close()
        ref_losses = reference_losses(ref, batches, lambda m, t: m(t), lr)
        # The engine's AdamW rounds as torch's: the same losses, to the bit.
        self.assertEqual(losses, ref_losses)
        self.assertLess(losses[-1], losses[0] - 0.5, "the adapters learned nothing")
        # The base is 4x the pinned memory, held on NVMe only, read every step, never written.
        self.assertGreaterEqual(base_bytes, 4 * stats["pinned_bytes"])
        self.assertLessEqual(stats["pinned_bytes"], 1 << 20)
        self.assertEqual(stats["frozen_elements"], base_bytes // 4)
        self.assertEqual(stats["optimizer_elements"], trainable)
        read = stats["param"]["nvme_read_bytes"] - start["param"]["nvme_read_bytes"]
        self.assertGreaterEqual(read, steps * base_bytes)
        written = stats["param"]["nvme_write_bytes"] - start["param"]["nvme_write_bytes"]
        self.assertEqual(written, steps * 4 * trainable)  # the adapters' write-back only
        # No optimizer state for the base: the optimizer store moves 16 B per adapter element.
        self.assertLessEqual(stats["optimizer_write_bytes"], steps * 16 * (trainable + (8 << 10)))
        # close() gives the base back unchanged and the adapters as trained.
        for name, p in model.named_parameters():
            if name in base:
                self.assertTrue(torch.equal(p.detach(), base[name]), name)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            self.assertTrue(torch.equal(p.detach(), q.detach()), name)

    def test_save_writes_safetensors_of_the_trained_and_frozen_weights(self):
        from safetensors.torch import load_file
        torch.manual_seed(0)
        model = LoraModel(hidden=32, layers=2)
        model.head.weight = model.embed.weight  # tied: stored once
        batches = token_batches(2)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = memplan.torch.offload(model, os.path.join(tmp, "swap"), lr=1e-2,
                                            direct=False, sub_group_elements=4096)
            for tokens in batches:
                model(tokens).backward()
                trainer.step()
            state = trainer.state_dict()
            out = os.path.join(tmp, "ckpt")
            trainer.save(out)
            trainer.save(out)  # over an existing checkpoint
            with open(os.path.join(tmp, "file"), "w", encoding="utf-8") as f:
                f.write("x")
            with self.assertRaisesRegex(OSError, "not a directory"):
                trainer.save(os.path.join(tmp, "file"))
            trainer.close()
            saved = load_file(os.path.join(out, "model.safetensors"))
            self.assertEqual(sorted(os.listdir(out)), ["model.safetensors"])
            self.assertFalse([n for n in os.listdir(tmp) if n.startswith(".memplan-save")])
        self.assertIn("embed.weight", saved)
        self.assertNotIn("head.weight", saved)  # the tied copy
        for name, t in saved.items():
            self.assertTrue(torch.equal(t, state[name]), name)
            self.assertTrue(torch.equal(t, model.state_dict()[name]), name)

    def test_every_parameter_frozen_is_refused(self):
        model = nn.Linear(4, 4)
        model.requires_grad_(False)
        with self.assertRaisesRegex(ValueError, "frozen"):
            memplan.torch.offload(model)


def tiny_causal_lm(kind):
    """A Transformers causal LM of a real architecture, tiny, random init (no download)."""
    import transformers
    torch.manual_seed(0)
    common = dict(vocab_size=256, use_cache=False)
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=32,
                                          **common)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         **common)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=32,
                                          tie_word_embeddings=True, **common)
        model = transformers.Qwen2ForCausalLM(config)
    return model


def lm_loss(model, tokens):
    return model(input_ids=tokens, labels=tokens).loss


class TransformersTest(unittest.TestCase):
    BLOCKS = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block", "qwen2": "Qwen2DecoderLayer"}

    def check(self, kind, steps=6, lr=3e-3):
        model, ref = tiny_causal_lm(kind), tiny_causal_lm(kind)
        batches = token_batches(steps, batch=2, seq=16)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = memplan.torch.offload(model, os.path.join(tmp, "swap"), lr=lr,
                                            weight_decay=0.01, sub_group_elements=16 << 10,
                                            param_buffer_bytes=128 << 10, direct=False)
            units = trainer.fetch_units()
            losses = []
            for tokens in batches:
                loss = lm_loss(model, tokens)
                loss.backward()
                trainer.step()
                losses.append(loss.item())
            stats = trainer.stats()
            trainer.close()
        ref_losses = reference_losses(ref, batches, lm_loss, lr)
        self.assertLessEqual(max(abs(a - b) for a, b in zip(losses, ref_losses)), 1e-5,
                             f"{kind}: {losses} vs {ref_losses}")
        self.assertLess(losses[-1], losses[0])
        # One unit per decoder layer (the model's _no_split_modules class), holding all of it.
        blocks = [u for u in units if u["type"] == self.BLOCKS[kind]]
        self.assertEqual(len(blocks), 2, units)
        layer = sum(p.numel() for p in ref.base_model.get_submodule(
            "h" if kind == "gpt2" else "layers")[0].parameters())
        self.assertEqual(blocks[0]["elements"], layer)
        self.assertEqual(stats["elements"], sum(p.numel() for p in ref.parameters()))
        # A tied parameter is in each unit that uses it (GPT-2's and Qwen2's embedding and head).
        tied = sum(p.numel() for p in ref.get_input_embeddings().parameters()) if (
            ref.get_output_embeddings().weight is ref.get_input_embeddings().weight) else 0
        self.assertEqual(sum(u["elements"] for u in units), stats["elements"] + tied)
        self.assertLessEqual(len(units), 2 + 5, units)  # blocks, embeddings, norms, head
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            self.assertLess((p.detach() - q.detach()).abs().max().item(), 1e-4, name)

    def test_llama(self):
        self.check("llama")

    def test_gpt2(self):
        self.check("gpt2")

    def test_qwen2(self):
        self.check("qwen2")

    def test_per_module_units_on_request(self):
        model = tiny_causal_lm("llama")
        trainer = memplan.torch.offload(model, fetch_units="module")
        units = trainer.fetch_units()
        self.assertFalse(any(u["type"] == "LlamaDecoderLayer" for u in units))
        self.assertIn("model.layers.0.self_attn.q_proj", [u["name"] for u in units])
        trainer.close()
        with self.assertRaisesRegex(ValueError, "fetch_units"):
            memplan.torch.offload(tiny_causal_lm("llama"), fetch_units=[3])
        with self.assertRaisesRegex(ValueError, "names GPT2Block, but no module"):
            memplan.torch.offload(tiny_causal_lm("llama"), fetch_units=["GPT2Block"])
        # Named by class: the same grouping as "auto".
        import transformers
        trainer = memplan.torch.offload(
            tiny_causal_lm("llama"),
            fetch_units=[transformers.models.llama.modeling_llama.LlamaDecoderLayer])
        self.assertEqual(sum(u["type"] == "LlamaDecoderLayer" for u in trainer.fetch_units()), 2)
        trainer.close()

    def test_a_saved_view_of_a_parameter_is_refused_naming_the_module(self):
        class Transposed(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(8, 8))

            def forward(self, x):
                return x @ self.w.t()  # matmul saves the transposed view for backward

        model = nn.Sequential(nn.Linear(8, 8), Transposed())
        trainer = memplan.torch.offload(model)
        with self.assertRaisesRegex(RuntimeError, r"memplan.torch: 1 \(Transposed\) saves a "
                                    r"view of parameter 1.w"):
            model(torch.randn(2, 8, requires_grad=True)).sum().backward()
        trainer.close()
        # Under no_grad nothing is saved: inference works.
        trainer = memplan.torch.offload(model)
        with torch.no_grad():
            self.assertEqual(model(torch.randn(2, 8)).shape, (2, 8))
        trainer.close()

    def test_multihead_attention_is_refused_naming_the_module(self):
        model = nn.Sequential(nn.Linear(8, 8), nn.TransformerEncoderLayer(8, 2))
        with self.assertRaisesRegex(ValueError, r"1\.self_attn is an nn.MultiheadAttention"):
            memplan.torch.offload(model)
        # Nothing was changed: the module still trains as an ordinary module.
        self.assertGreater(model[0].weight.numel(), 0)


if __name__ == "__main__":
    unittest.main()
