"""What tests/python/test_hf_trainer.py trains, shared with its 2-rank worker (hf_worker.py): tiny
Llama and GPT-2 models, a token dataset, TrainingArguments, and one cell of the issue 31 matrix
(the plain Trainer and MemplanTrainer on the same seed, data and settings, their logs)."""
import os
import tempfile

import torch

import memplan.hf

# The matrix (issue 31): models x precision x clipping, each with the Trainer's default
# no-decay groups (weight_decay > 0), gradient checkpointing, gradient accumulation and
# evaluation every 2 steps, in 1 and 2 ranks.
MODELS = ("llama", "gpt2")
PRECISIONS = ("fp32", "bf16")
CLIPS = (0.0, 1.0)
CELLS = [(m, p, c) for m in MODELS for p in PRECISIONS for c in CLIPS]


def tiny_llama():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2():
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=32, use_cache=False, bos_token_id=1,
                                     eos_token_id=2)
    return transformers.GPT2LMHeadModel(config)


BUILD = {"llama": tiny_llama, "gpt2": tiny_gpt2}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32, seq=16, seed=7):
        g = torch.Generator().manual_seed(seed)
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
                   gradient_accumulation_steps=2, lr_scheduler_type="linear", warmup_steps=2,
                   disable_tqdm=True)
    options.update(extra)
    return transformers.TrainingArguments(**options)


def cell_arguments(out, precision, clip, world=1):
    """A matrix cell's settings: the global batch (8 sequences x 2 accumulated) is the same for
    any number of ranks."""
    return arguments(out, max_steps=4, weight_decay=0.1, max_grad_norm=clip,
                     bf16=precision == "bf16", gradient_checkpointing=True,
                     eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4,
                     per_device_train_batch_size=4 // world)


def logs(trainer):
    history = trainer.state.log_history
    return {"loss": [e["loss"] for e in history if "loss" in e],
            "grad_norm": [e["grad_norm"] for e in history if "grad_norm" in e],
            "eval_loss": [e["eval_loss"] for e in history if "eval_loss" in e]}


MEMPLAN_OPTIONS = {"direct": False, "sub_group_elements": 16 << 10}


def run_cell(model, precision, clip, world=1, tmp=None):
    """One cell: {"plain": logs, "memplan": logs, "memplan_stats": the engine's}."""
    import transformers
    with tempfile.TemporaryDirectory(dir=tmp) as out:
        plain = transformers.Trainer(
            model=BUILD[model](), args=cell_arguments(os.path.join(out, "plain"), precision, clip,
                                                      world),
            train_dataset=Tokens(), eval_dataset=Tokens(8, seed=11))
        plain.train()
        ours = memplan.hf.MemplanTrainer(
            model=BUILD[model](), args=cell_arguments(os.path.join(out, "ours"), precision, clip,
                                                      world),
            train_dataset=Tokens(), eval_dataset=Tokens(8, seed=11),
            memplan_path=os.path.join(out, "swap"), memplan_options=dict(MEMPLAN_OPTIONS))
        ours.train()
        return {"plain": logs(plain), "memplan": logs(ours), "memplan_stats": ours.memplan.stats()}
