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

from memwrap.runtime.loader import WrappedLoader
from memwrap.runtime.scheduler import WrappedScheduler
from memwrap.state.rng import check_rng, capture_rng, loader_generators, restore_rng
from memwrap.state.checks import check_optimizer_state, check_plain_optimizer_state, check_scheduler_state, class_name

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
    # The classes of the optimizer and scheduler (inside memwrap's wrappers): a load into another kind is refused.
    state["classes"] = {"optimizer": None if optimizer is None else class_name(getattr(optimizer, "optimizer", optimizer)),
                        "scheduler": None if scheduler is None else class_name(_inner_scheduler(scheduler))}
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

    Every check runs before anything is changed, so a refused load leaves every object as it was: an
    unreadable file, a checkpoint missing a part you passed (or, with ``strict=True``, holding a part you
    did not pass), a model with other keys or shapes, an optimizer of another class or with other
    parameter groups or ``accumulate``, a scheduler of another class, a GradScaler state this run's
    precision would drop or cannot take, a loader built otherwise, damaged random states. The random
    states are restored last. ``weights_only=False`` is needed only if your ``extra`` holds arbitrary objects.

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
    # Everything that can refuse has been checked above; the loads below only apply it (each load_state_dict checks
    # again, and finds nothing).
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
    classes = state.get("classes") or {}  # absent in checkpoints of earlier memwrap versions
    if targets["model"] is not None:
        _check_model(state["model"], targets["model"].state_dict())
    if targets["optimizer"] is not None:
        _check_optimizer(state["optimizer"], targets["optimizer"], classes.get("optimizer"))
    if targets["scheduler"] is not None:
        _check_scheduler(state["scheduler"], targets["scheduler"], classes.get("scheduler"))
    if targets["loader"] is not None:
        if not isinstance(targets["loader"], WrappedLoader):
            raise TypeError("loader= must be the loader memwrap.wrap() returned: only it can resume mid-epoch.")
        _check_loader(state["loader"], targets["loader"])
    check_rng(state.get("rng"), what="the checkpoint's random state")


def _check_model(saved: dict[str, Any], current: dict[str, Any]) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"the checkpoint's model state is a {type(saved).__name__}, not a state_dict. Fix: save "
                         "with memwrap.save_checkpoint(..., model=model).")
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise ValueError(f"the checkpoint's model does not match: missing keys {missing[:5]}, unexpected keys "
                         f"{unexpected[:5]}. Fix: build the same model as in the saved run.")
    for key, value in current.items():
        if isinstance(value, torch.Tensor) and (not isinstance(saved[key], torch.Tensor)
                                                or tuple(saved[key].shape) != tuple(value.shape)):
            raise ValueError(f"the checkpoint's {key} has shape {tuple(getattr(saved[key], 'shape', ()))}, the model's "
                             f"{tuple(value.shape)}. Fix: build the same model as in the saved run.")


def _check_optimizer(saved: dict[str, Any], optimizer: Any, saved_class: str | None) -> None:
    wrapped = hasattr(optimizer, "gate")
    if not isinstance(saved, dict):
        raise ValueError(f"the checkpoint's optimizer state is a {type(saved).__name__}, not a state_dict.")
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
    if wrapped:  # the wrapper's own full check: class, per-parameter state, GradScaler, partial gradients
        check_optimizer_state(optimizer, saved)
    else:
        check_plain_optimizer_state(optimizer, saved, saved_class)


def _inner_scheduler(scheduler: Any) -> Any:
    return scheduler.scheduler if isinstance(scheduler, WrappedScheduler) else scheduler


def _check_scheduler(saved: Any, scheduler: Any, saved_class: str | None) -> None:
    """The same checks WrappedScheduler.load_state_dict makes, for a wrapped or a plain scheduler, before any load."""
    wrapped_state = isinstance(saved, dict) and "updates_seen" in saved
    if isinstance(scheduler, WrappedScheduler):
        inner = saved.get("scheduler") if wrapped_state else saved
        recorded = saved.get("scheduler_class") if wrapped_state else saved_class
        check_scheduler_state(scheduler.scheduler, scheduler.optimizer.optimizer, inner, recorded or saved_class)
        return
    if wrapped_state:
        raise ValueError("the checkpoint's scheduler state was saved from a memwrap-wrapped scheduler, the scheduler "
                         "passed is a plain one. Nothing was loaded. Fix: pass the scheduler memwrap.wrap() returned.")
    check_scheduler_state(scheduler, scheduler.optimizer, saved, saved_class)


def _check_loader(saved: Any, loader: WrappedLoader) -> None:
    loader.check_state_dict(saved)
    generators = len(loader_generators(loader.loader))
    for i, gen_state in enumerate(saved.get("generators") or []):
        try:
            torch.Generator().set_state(gen_state)  # a throwaway: torch judges the format, nothing changes
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"the checkpoint's loader generator {i} state is damaged ({err}). Nothing was loaded. "
                             "Fix: load a checkpoint as memwrap.save_checkpoint wrote it.") from err
    if saved.get("pass_rng") is not None:
        check_rng(saved["pass_rng"], generators, what="the checkpoint's loader (this epoch's random order)")


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
