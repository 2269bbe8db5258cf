"""Exact, crash-safe training checkpoints: ``save_checkpoint`` / ``load_checkpoint``.

Exact: besides the model, optimizer (with the accumulation window and partial gradients), scheduler and loader
position, the random states are saved (torch CPU and CUDA, Python ``random``, numpy if imported, the DataLoader's
generators, and the states the current epoch's order was drawn from), so a model with Dropout and a shuffling
loader resumes bit-identically. Crash-safe: the file is written under a temporary name in the same directory,
flushed to disk, then renamed over the old one (an atomic replace), so a kill during the save leaves the previous
checkpoint intact. Loading checks everything before changing anything.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from memwrap.accumulation import WrappedLoader
from memwrap.rng import capture_rng, restore_rng

__all__ = ["save_checkpoint", "load_checkpoint"]

_FORMAT = 1
_PARTS = ("model", "optimizer", "scheduler", "loader")


def save_checkpoint(path: str | os.PathLike, *, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                    loader: WrappedLoader | None = None, extra: Any = None) -> Path:
    """Save everything a run needs to resume exactly, atomically (a kill during the save keeps the old file).

    ``extra`` is yours (epoch, step, metrics); ``load_checkpoint`` returns it. Write from one process
    per path (under DDP, rank 0). A kill during the save may leave a ``.<name>.tmp`` file next to the
    checkpoint; the next save overwrites it.

    Example:
        >>> memwrap.save_checkpoint("ckpt.pt", model=model, optimizer=optimizer, scheduler=scheduler,
        ...                         loader=loader, extra={"epoch": epoch})  # doctest: +SKIP
    """
    if loader is not None and not isinstance(loader, WrappedLoader):
        raise TypeError(f"loader= must be the loader memwrap.wrap() returned (got {type(loader).__name__}): only it "
                        "knows the epoch position. Fix: memwrap.wrap(model, optimizer, loader, ...).")
    _check_not_mid_budget_window(optimizer, loader)
    state: dict[str, Any] = {"memwrap_checkpoint": _FORMAT, "extra": extra, "rng": capture_rng(cuda=True)}
    for name, obj in zip(_PARTS, (model, optimizer, scheduler, loader)):
        state[name] = None if obj is None else obj.state_dict()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the checkpoint
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # and the rename itself survives a power loss
    return path


def _check_not_mid_budget_window(optimizer: Any, loader: Any) -> None:
    """Under budget= a window is one loader batch cut into micro-batches; the loader's position counts whole
    batches, so a resume cannot start halfway through one (measured: the resumed loader re-planned the window while
    the restored optimizer was inside it, and stopped with "plan_window called in the middle of a window").
    Refuse such a save before anything is written."""
    gate = getattr(optimizer, "gate", None) or getattr(loader, "gate", None)
    if gate is not None and gate.varies and gate.micro_step:
        raise ValueError(
            f"save_checkpoint in the middle of a budget= window (after micro-batch {gate.micro_step} of "
            f"{gate.accumulate}): under budget= each of your batches is one window cut by the plan, and a resume "
            "cannot re-enter it halfway. Nothing was written. Fix: save between updates, e.g. "
            "`if optimizer.did_update: memwrap.save_checkpoint(...)` (or when loader.sync_gradients is True).")


def load_checkpoint(path: str | os.PathLike, *, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                    loader: WrappedLoader | None = None, map_location: Any = "cpu", weights_only: bool = True,
                    strict: bool = True) -> Any:
    """Restore what :func:`save_checkpoint` saved into freshly built objects; return its ``extra``.

    Every check runs before anything is changed: an unreadable file, a checkpoint missing a part you
    passed (or, with ``strict=True``, holding a part you did not pass), a model with other keys or
    shapes, an optimizer with other parameter groups or ``accumulate``. The random states are
    restored last. ``weights_only=False`` is needed only if your ``extra`` holds arbitrary objects.

    Example:
        >>> extra = memwrap.load_checkpoint("ckpt.pt", model=model, optimizer=optimizer, scheduler=scheduler,
        ...                                 loader=loader)  # doctest: +SKIP
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        raise ValueError(
            f"cannot read the checkpoint {path}: {type(exc).__name__}: {exc}. A file cut short by a kill during a "
            "plain torch.save() is unreadable; memwrap.save_checkpoint() replaces the file only once the new one is "
            "complete. If your extra= holds objects other than tensors and builtins, pass weights_only=False."
        ) from exc
    if not isinstance(state, dict) or state.get("memwrap_checkpoint") != _FORMAT:
        raise ValueError(f"{path} is not a checkpoint written by memwrap.save_checkpoint(); load it with torch.load.")
    targets = dict(zip(_PARTS, (model, optimizer, scheduler, loader)))
    _check(state, targets, strict)
    # Optimizer first: a refusal there (it checks its own state before loading) leaves everything as it was.
    for name in ("optimizer", "model", "scheduler", "loader"):
        if targets[name] is not None:
            targets[name].load_state_dict(state[name])
    if state["rng"].get("cuda") is not None and not torch.cuda.is_available():
        warnings.warn(f"{path} holds CUDA random states but CUDA is not available here; the CPU states are "
                      "restored, so GPU dropout will not repeat the saved run.", stacklevel=2)
    restore_rng(state["rng"])
    return state["extra"]


def _check(state: dict[str, Any], targets: dict[str, Any], strict: bool) -> None:
    for name, obj in targets.items():
        if obj is not None and state.get(name) is None:
            raise ValueError(f"the checkpoint holds no {name} state, but {name}= was passed. Fix: save it with "
                             f"save_checkpoint(..., {name}={name}) or do not pass it.")
        if strict and obj is None and state.get(name) is not None:
            raise ValueError(f"the checkpoint holds a {name} state, but no {name}= was passed, so it would not be "
                             f"restored. Fix: pass {name}=..., or strict=False to leave it out on purpose.")
    if targets["model"] is not None:
        _check_model(state["model"], targets["model"].state_dict())
    if targets["optimizer"] is not None:
        _check_optimizer(state["optimizer"], targets["optimizer"])
    if targets["loader"] is not None:
        if not isinstance(targets["loader"], WrappedLoader):
            raise TypeError("loader= must be the loader memwrap.wrap() returned: only it can resume mid-epoch.")
        targets["loader"].check_state_dict(state["loader"])


def _check_model(saved: dict[str, Any], current: dict[str, Any]) -> None:
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ValueError(f"the checkpoint's model does not match: missing keys {missing[:5]}, unexpected keys "
                         f"{unexpected[:5]}. Fix: build the same model as in the saved run.")
    for key, value in current.items():
        if isinstance(value, torch.Tensor) and tuple(saved[key].shape) != tuple(value.shape):
            raise ValueError(f"the checkpoint's {key} has shape {tuple(saved[key].shape)}, the model's "
                             f"{tuple(value.shape)}. Fix: build the same model as in the saved run.")


def _check_optimizer(saved: dict[str, Any], optimizer: Any) -> None:
    wrapped = hasattr(optimizer, "gate")
    if wrapped != ("gate" in saved):
        raise ValueError("the checkpoint's optimizer state and the optimizer passed are not both memwrap-wrapped. "
                         "Fix: save and load the optimizer memwrap.wrap() returned.")
    inner = saved["optimizer"] if wrapped else saved
    # Under budget= (gate.varies) each batch's cut sets accumulate: the saved value is not a setting to match.
    if wrapped and saved["gate"]["accumulate"] != optimizer.gate.accumulate and not optimizer.gate.varies:
        raise ValueError(f"the checkpoint was saved with accumulate={saved['gate']['accumulate']} but this run uses "
                         f"accumulate={optimizer.gate.accumulate}; resume with the same accumulate.")
    saved_sizes = [len(g["params"]) for g in inner["param_groups"]]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        raise ValueError(f"the checkpoint's optimizer has parameter groups of sizes {saved_sizes}, this one "
                         f"{sizes}. Fix: build the optimizer as in the saved run.")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
