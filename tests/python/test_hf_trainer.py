"""memplan.hf.MemplanTrainer (issue 19): the Hugging Face Trainer with the model's parameters and
optimizer in memplan's engine (NVMe) trains a tiny Llama-shaped model with the losses of the plain
Trainer, and its save_model() checkpoint loads with from_pretrained. Runs under the modern
environment (Transformers 5, Accelerate), which the Trainer needs."""
import os
import tempfile
import unittest

import torch

import memplan.hf


def tiny_llama():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=16):
        g = torch.Generator().manual_seed(7)
        start = torch.randint(0, 128, (n, 1), generator=g)
        self.rows = (start + 3 * torch.arange(seq).unsqueeze(0)) % 128

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def arguments(out, **extra):
    import transformers
    options = dict(output_dir=out, max_steps=6, per_device_train_batch_size=4, learning_rate=3e-3,
                   weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[],
                   use_cpu=True, save_strategy="no", seed=3, dataloader_num_workers=0,
                   gradient_accumulation_steps=2, lr_scheduler_type="linear", warmup_steps=2)
    options.update(extra)
    return transformers.TrainingArguments(**options)


def losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


class MemplanTrainerTest(unittest.TestCase):
    def test_trains_as_the_plain_trainer_and_saves_a_loadable_checkpoint(self):
        import transformers
        with tempfile.TemporaryDirectory() as tmp:
            plain = transformers.Trainer(model=tiny_llama(), args=arguments(tmp + "/plain"),
                                         train_dataset=Tokens())
            plain.train()
            model = tiny_llama()
            ours = memplan.hf.MemplanTrainer(
                model=model, args=arguments(tmp + "/ours"), train_dataset=Tokens(),
                memplan_path=os.path.join(tmp, "swap"),
                memplan_options={"direct": False, "sub_group_elements": 16 << 10})
            ours.train()
            want, got = losses(plain), losses(ours)
            self.assertEqual(len(got), 6)
            # The losses logged (each the mean over an accumulation of 2 micro-batches) agree;
            # the learning-rate schedule (warm-up, linear decay) reached the engine.
            for a, b in zip(got, want):
                self.assertAlmostEqual(a, b, delta=1e-4)
            stats = ours.memplan.stats()
            self.assertEqual(stats["steps"], 6)
            self.assertGreater(stats["param"]["nvme_read_bytes"], 0)
            ours.save_model(os.path.join(tmp, "ckpt"))
            loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(tmp, "ckpt"))
            for (name, p), q in zip(loaded.named_parameters(), plain.model.parameters()):
                self.assertLess((p.detach() - q.detach()).abs().max().item(), 1e-4, name)

    def test_clipping_and_other_optimizers_are_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaisesRegex(ValueError, "max_grad_norm"):
                memplan.hf.MemplanTrainer(model=tiny_llama(),
                                          args=arguments(tmp, max_grad_norm=1.0),
                                          train_dataset=Tokens())
            with self.assertRaisesRegex(ValueError, "adamw"):
                memplan.hf.MemplanTrainer(model=tiny_llama(), args=arguments(tmp, optim="sgd"),
                                          train_dataset=Tokens())


if __name__ == "__main__":
    unittest.main()
