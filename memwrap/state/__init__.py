"""Training state: exact, crash-safe checkpoints (save/load), the checks a saved state must pass before it is
loaded, and random-number states.
"""
