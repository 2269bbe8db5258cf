"""The claims of the seed posts, one entry each, and the function that measures it (used by ``seed_claims.py``).

Each claim is a dict: ``id``, ``seed`` (file), ``quote`` (the original words), ``claim`` (English),
and ``measure(ctx)`` returning ``setting``, ``measured`` (text), ``figures`` (numbers; ``claimed``
and ``value`` in one ``unit`` make the plot), ``kind`` (the verdict class) and ``verdict``.
The measurements live in ``claims_memory.py``, ``claims_training.py`` and ``claims_fit.py``.
"""
from __future__ import annotations

from claims_common import S0, S1, Ctx
from claims_fit import (_gpu_or, accum_time, amp_memory, amp_speed, bert_base_3060, ckpt_memory, ckpt_time,
                        fp16_small_grads, llama_7b, llama_combo, resnet_3060, stability, t5_3b)
from claims_memory import (accum_1_over_n, accum_4gb_16gb, accum_resnet, activations_3_5x, activations_proportional,
                           adamw_bytes, amp_accum_halves, bert_large_weights, grad_bytes, grads_equal_params,
                           image_batch, memory_formula, optimizer_alternatives, params_100m, survey)
from claims_training import accum_equivalence, batchnorm, lr_scaling

__all__ = ["CLAIMS", "Ctx", "amp_speed", "ckpt_time", "accum_time", "_gpu_or"]


def _claim(id_, seed, quote, claim, fn):
    return {"id": id_, "seed": seed, "quote": quote, "claim": claim, "measure": fn}


CLAIMS = [
    _claim("survey-67pct", S0, "根据2023年AI硬件调查报告，超过67%的开发者都曾在单卡训练时遭遇显存瓶颈",
           "over 67% of developers have hit GPU-memory limits on one card (2023 survey)", survey),
    _claim("bert-large-1.3gb", S0, "这段代码就会立即占用约1.3GB显存，这还只是模型的静态权重",
           "BERT-large's weights alone take about 1.3 GB", bert_large_weights),
    _claim("adamw-8-bytes", S0, "优化器状态（AdamW需要8字节/参数）", "AdamW's state needs 8 bytes per parameter", adamw_bytes),
    _claim("grads-4-bytes", S0, "梯度值（4字节/参数）", "gradients need 4 bytes per parameter", grad_bytes),
    _claim("activations-proportional", S0, "前向传播的激活值（与batch size和序列长度成正比）",
           "activations are proportional to batch size and sequence length", activations_proportional),
    _claim("accum-60pct-memory", S0, "梯度累积虽然会降低约15-30%的训练速度，但能让显存需求下降60%以上 (ResNet50, ImageNet)",
           "gradient accumulation cuts memory needs by 60% or more (ResNet-50)", accum_resnet),
    _claim("accum-15-30pct-time", S0, "梯度累积虽然会降低约15-30%的训练速度",
           "gradient accumulation makes training 15-30% slower (ResNet-50)", accum_time),
    _claim("ckpt-75pct-memory", S0, "能减少多达75%的显存占用", "checkpointing saves up to 75% of memory", ckpt_memory),
    _claim("ckpt-20-30pct-time", S0, "这项技术的代价是增加约20-30%的计算时间",
           "checkpointing costs about 20-30% more compute time", ckpt_time),
    _claim("amp-50pct-memory", S0, "混合精度训练不仅减少了50%的显存占用", "mixed precision halves memory use", amp_memory),
    _claim("amp-2-3x-speed", S0, "还带来了2-3倍的速度提升", "mixed precision is 2-3x faster", amp_speed),
    _claim("fp16-small-grads", S0, "对于小于1e-4的非常小的梯度值，建议保持FP32模式以避免精度损失",
           "keep FP32 for gradients smaller than 1e-4 to avoid precision loss", fp16_small_grads),
    _claim("optimizer-alternatives", S0, "8-bit Adam和Adafactor是两种优秀替代方案 (内存占用对比)",
           "8-bit Adam and Adafactor need much less state memory than Adam", optimizer_alternatives),
    _claim("t5-3b-24gb-8bit-adam", S0, "在T5-3B模型上，8-bit Adam让我在24GB显存的3090上实现了原本需要多卡才能完成的训练任务",
           "8-bit Adam makes T5-3B training fit a 24 GB RTX 3090", t5_3b),
    _claim("llama-7b-4090-accum", S0, "梯度累积(Gradient Accumulation)是我在RTX 4090上训练LLaMA-7B时的救命稻草",
           "gradient accumulation makes LLaMA-7B training possible on a 24 GB RTX 4090", llama_7b),
    _claim("llama-7b-combination", S0, "per_device_train_batch_size=2, gradient_accumulation_steps=8, gradient_checkpointing"
           "=True, fp16=True, optim=\"adamw_bnb_8bit\" ... 在LLaMA-7B上的实测结果",
           "the recommended combination trains LLaMA-7B on one card", llama_combo),
    _claim("accum-4gb-as-16gb", S1, "试试PyTorch梯度累加，用4GB显存跑出16GB的效果",
           "accumulation lets 4 GB of GPU memory do the work of 16 GB", accum_4gb_16gb),
    _claim("params-100m-400mb", S1, "一个1亿参数的FP32模型就占用约400MB", "a 100M-parameter FP32 model takes about 400 MB",
           params_100m),
    _claim("activations-3-5x-params", S1, "中间激活值前向传播产生的临时变量往往是参数大小的3-5倍",
           "activations are usually 3-5x the parameter size", activations_3_5x),
    _claim("image-batch-150mb", S1, "batch_size32的224x224图像在FP32下约占150MB",
           "a batch of 32 224x224 images takes about 150 MB in FP32", image_batch),
    _claim("grads-equal-params", S1, "梯度缓存与参数大小相同的反向传播中间结果", "gradients take as much memory as the parameters",
           grads_equal_params),
    _claim("memory-formula", S1, "total_memory ≈ (参数 + 梯度) * 4 + 激活值 * batch_size * 序列长度",
           "total memory ≈ (params + grads) x 4 bytes + activations x batch x sequence", memory_formula),
    _claim("bert-base-3060-batch8", S1, "当你在RTX 3060（12GB）上尝试训练BERT-base时可能连batch_size=8都跑不起来",
           "BERT-base may not even run batch 8 on a 12 GB RTX 3060", bert_base_3060),
    _claim("accum-memory-1-over-n", S1, "显存占用: 直接大batch 高, 梯度累积 低(1/N)",
           "accumulation brings memory down to 1/N", accum_1_over_n),
    _claim("accum-equals-big-batch", S1, "数学上这两种方式在理论上等效: 大batch梯度 = Σ(小batch梯度) / N; 正确做法(loss/accum_steps).backward()",
           "accumulation is the big batch: big-batch gradient = sum of micro-batch gradients / N", accum_equivalence),
    _claim("lr-linear-scaling", S1, "当effective_batch增大时通常需要线性放大学习率: lr=base_lr * accum_steps",
           "scale the learning rate linearly with accum_steps", lr_scaling),
    _claim("batchnorm-micro-batch", S1, "BN统计量基于物理batch_size计算; 解决: 使用torch.nn.SyncBatchNorm或改为GroupNorm",
           "BatchNorm statistics use the micro-batch; fix with SyncBatchNorm or GroupNorm", batchnorm),
    _claim("amp-accum-halves-again", S1, "结合梯度累积与AMP自动混合精度显存再减半",
           "AMP on top of accumulation halves memory again", amp_accum_halves),
    _claim("resnet50-3060-table", S1, "在RTX 3060(12GB)上训练ResNet-50: 直接训练 最大batch_size 32, 25分钟/epoch; 梯度累加(accum=4) 8, 28分钟",
           "ResNet-50 on a 12 GB RTX 3060: batch 32 is the largest that fits", resnet_3060),
    _claim("llama-7b-stability-15pct", S1, "我在微调LLaMA-7B时通过梯度累加将batch_size从1提升到8等效训练稳定性反而提高了15%",
           "accumulating LLaMA-7B from batch 1 to 8 improved training stability by 15%", stability),
]
