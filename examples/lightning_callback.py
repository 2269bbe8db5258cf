"""Lightning with MemwrapCallback: memwrap checkpointing and 8-bit AdamW; precision and accumulation stay Lightning's.

    python examples/lightning_callback.py --steps 4
"""
from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader

from memwrap.integrations.lightning.callback import MemwrapCallback
from memwrap.models import build_preset, lm_loss


class TinyGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = build_preset("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32)

    def training_step(self, tokens, batch_idx):
        loss = lm_loss(self.net(tokens[:, :-1]), tokens[:, 1:])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        # Written as usual; the callback converts it to memwrap's optimizer and re-attaches the scheduler.
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = TinyGPT()
    callback = MemwrapCallback(checkpoint="auto", optim="adamw_8bit")
    trainer = L.Trainer(fast_dev_run=args.steps, accelerator="cpu", precision="bf16-mixed", accumulate_grad_batches=2,
                        callbacks=[callback], enable_progress_bar=False, logger=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(torch.randint(0, 256, (args.steps * 2, 33)), batch_size=2))
    print(f"optimizer={type(trainer.optimizers[0]).__name__} global_step={trainer.global_step}")
    print(callback.report)


if __name__ == "__main__":
    main()
