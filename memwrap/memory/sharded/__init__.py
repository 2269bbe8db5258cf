"""Data-parallel planning (FSDP2, DDP): one rank traced on fake tensors, sharding as a plan dimension, and
the measurement of a real rank's peak.
"""
