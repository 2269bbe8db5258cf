"""The checkpoint report of the Hugging Face integration is public (issue 11, item 12)."""
from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def test_checkpoint_report_says_what_memwrap_trainer_kwargs_checkpointed(tmp_path):
    from memwrap.checkpointing.apply import CheckpointReport, is_checkpointed
    from memwrap.integrations.transformers.trainer import checkpoint_report, memwrap_trainer_kwargs
    from tests.hf_helpers import hf_args, tiny_llama

    model = tiny_llama()
    assert checkpoint_report(model) is None  # nothing applied yet
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memwrap_trainer_kwargs(model, hf_args(tmp_path), checkpoint="auto")
    report = checkpoint_report(model)
    assert isinstance(report, CheckpointReport)
    assert report.modules == ["model.layers.0", "model.layers.1"] and report.policy == "auto"
    assert all(is_checkpointed(model.get_submodule(name)) for name in report.modules)
    assert str(report).startswith("checkpointed 2 module(s) (LlamaDecoderLayer x2)")
    with pytest.raises(TypeError, match="checkpoint_report\\(\\) takes the model"):
        checkpoint_report("model")
    untouched = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        memwrap_trainer_kwargs(untouched, hf_args(tmp_path))  # no checkpoint=: nothing applied
    assert checkpoint_report(untouched) is None
    assert torch.is_tensor(next(untouched.parameters()))
