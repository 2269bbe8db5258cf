"""Hugging Face Trainer with memwrap's 8-bit AdamW and checkpoint policy; then the same settings in a plain loop.

    python examples/hf_trainer.py --steps 3

Trainer keeps its own accumulation, precision, clipping and scheduler; memwrap only supplies the
optimizer (by name, HF strings included) and checkpointing. A tiny LLaMA is built from a config:
nothing is downloaded.
"""
from __future__ import annotations

import argparse
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import memwrap
from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs, wrap_options


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="optimizer updates")
    parser.add_argument("--out", default="/tmp/memwrap_hf_example")
    cli = parser.parse_args()
    ids = torch.randint(0, 128, (cli.steps * 4, 16), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": x, "labels": x} for x in ids]

    # 1. Trainer: its accumulation and precision; memwrap's optimizer and checkpointing.
    model = tiny_llama()
    args = TrainingArguments(output_dir=cli.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=cli.steps, learning_rate=1e-3, optim="adamw_bnb_8bit", use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      **memwrap_trainer_kwargs(model, args, checkpoint="selective"))
    result = trainer.train()
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it
    print(f"trainer: steps={result.global_step} loss={result.training_loss:.4f} optimizer={type(inner).__name__}")

    # 2. The seeds' TrainingArguments template as memwrap options for a plain loop.
    template = TrainingArguments(output_dir=cli.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 gradient_checkpointing=True, bf16=True, optim="adamw_bnb_8bit", use_cpu=True,
                                 report_to=[])
    with warnings.catch_warnings():
        # The warning names the fields wrap() leaves to this loop (batch size, use_cpu, ...): handled below.
        warnings.simplefilter("ignore")
        options = wrap_options(template)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = memwrap.wrap(model, optimizer, **options)
    for i in range(0, len(dataset), template.per_device_train_batch_size):
        batch = torch.stack([d["input_ids"] for d in dataset[i:i + 2]])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"plain loop: options={options} updates={optimizer.updates} loss={loss.item():.4f} "
          f"optimizer={type(memwrap.unwrap(optimizer)).__name__}")


if __name__ == "__main__":
    main()
