"""The options of ``wrap()``: parsed and validated once (options) and the Hugging Face ``TrainingArguments``
fields it does not apply (training_args). The pass over the objects that makes the plan ``wrap()`` acts on is
:mod:`memwrap.validation`.

The names below are re-exported from the modules that define them (``memwrap.config`` was one module before).
"""
from __future__ import annotations

from memwrap.config.options import Options, parse_options, options_from, HF_ALIASES

__all__ = ['Options', 'parse_options', 'options_from', 'HF_ALIASES']
