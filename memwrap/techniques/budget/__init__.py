"""``wrap(..., budget="22GiB")``: plan the micro-batch at the first batch (plan), the options it may change
(apply), rank agreement under DDP/FSDP2 (ranks), and the plan made once for a framework's loop (static).
"""
