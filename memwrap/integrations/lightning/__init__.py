"""Lightning integration: the callback (callback) and its ``budget=`` plan (budget).

``MemwrapCallback`` is re-exported from :mod:`memwrap.integrations.lightning.callback` (``memwrap.integrations.lightning``
was one module before), lazily: the class is built on first access, so importing this package does not import
Lightning.
"""
from __future__ import annotations

from typing import Any

__all__ = ["MemwrapCallback"]


def __getattr__(name: str) -> Any:
    if name != "MemwrapCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # PEP 562, optional dependency: Lightning is imported only when the class is used.
    from memwrap.integrations.lightning import callback

    return callback.MemwrapCallback
