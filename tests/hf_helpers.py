"""A tiny LLaMA (no download) and quiet TrainingArguments, shared by the Hugging Face tests."""
import torch


def tiny_llama(hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64))


def hf_args(tmp_path, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                learning_rate=1e-3, weight_decay=0.1, use_cpu=True, report_to=[], save_strategy="no",
                logging_strategy="no", disable_tqdm=True, seed=0, data_seed=0)
    return TrainingArguments(**{**base, **kw})
