"""Built-in optimizer plugins, one small module per library (torch.optim, bitsandbytes, torchao, optimi, ...).
"""
