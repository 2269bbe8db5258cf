"""Random-number states a training run depends on: capture and restore, in a form ``torch.load(weights_only=True)`` reads.

Dropout draws from torch's global generator, a shuffling ``DataLoader`` from its ``generator=`` (or, without one,
from the global generator at the start of each epoch), augmentations often from Python's ``random`` or numpy.
Resuming exactly needs all of them; :mod:`memwrap.state.checkpoint` and the wrapped loader use these helpers.
"""
from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["capture_rng", "check_rng", "restore_rng", "loader_generators"]


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader draws its order and worker seeds from (each once).

    Example:
        >>> g = torch.Generator()
        >>> dl = torch.utils.data.DataLoader(list(range(4)), shuffle=True, generator=g)
        >>> loader_generators(dl) == [g]
        True
    """
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [getattr(loader, "generator", None), getattr(sampler, "generator", None),
                  getattr(batch_sampler, "generator", None), getattr(getattr(batch_sampler, "sampler", None), "generator", None)]
    found: list[torch.Generator] = []
    for gen in candidates:
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def capture_rng(generators: list[torch.Generator] = (), cuda: bool = False) -> dict[str, Any]:
    """The global random states (torch CPU, Python ``random``, numpy if imported, CUDA if asked) and ``generators``'.

    Example:
        >>> state = capture_rng(); a = torch.rand(1); restore_rng(state); torch.equal(a, torch.rand(1))
        True
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": None, "cuda": None,
                             "generators": [g.get_state() for g in generators]}
    np = sys.modules.get("numpy")
    if np is not None:
        name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        # A tensor instead of an ndarray: weights_only loading accepts tensors, not numpy arrays.
        state["numpy"] = (name, torch.from_numpy(key.astype("int64")), int(pos), int(has_gauss), float(gauss))
    if cuda and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng(state: Any, generators: int = 0, what: str = "the saved random state") -> None:
    """Raise ``ValueError`` if :func:`restore_rng` would fail on ``state`` part-way (changes nothing).

    Each piece is tried on a throwaway generator of its own kind, so torch, Python and numpy judge
    their own formats and the global states stay untouched.

    Example:
        >>> check_rng(capture_rng())  # fits: no error
    """
    def refuse(piece: str, err: Any) -> None:
        raise ValueError(f"{what} is damaged: its {piece} state cannot be restored ({err}). Nothing was loaded. "
                         "Fix: load a checkpoint written by memwrap.save_checkpoint and not edited since.")

    if not isinstance(state, dict) or not {"torch", "random", "generators"} <= state.keys():
        refuse("overall", f"expected a dict with 'torch', 'random' and 'generators', got {type(state).__name__}")
    saved = state["generators"]
    if not isinstance(saved, (list, tuple)) or len(saved) != generators:
        count = len(saved) if isinstance(saved, (list, tuple)) else saved
        raise ValueError(f"{what} holds {count} loader generator(s) but this loader has {generators}. Nothing was "
                         "loaded. Fix: build the DataLoader as in the saved run (same generator= / sampler).")
    for name, value in [("torch", state["torch"])] + [(f"generator {i}", g) for i, g in enumerate(saved)]:
        try:
            torch.Generator().set_state(value)
        except (RuntimeError, TypeError) as err:
            refuse(name, err)
    try:
        random.Random().setstate(_as_tuples(state["random"]))
    except (TypeError, ValueError) as err:
        refuse("Python random", err)
    if state.get("numpy") is not None:
        try:
            import numpy as np

            name, key, pos, has_gauss, gauss = state["numpy"]
            np.random.RandomState().set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
        except (ImportError, TypeError, ValueError, AttributeError) as err:
            refuse("numpy", err)
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if not isinstance(cuda, (list, tuple)) or len(cuda) > torch.cuda.device_count():
            raise ValueError(
                f"{what} holds CUDA random states for {len(cuda) if isinstance(cuda, (list, tuple)) else cuda} "
                f"device(s) but this process sees {torch.cuda.device_count()}. Nothing was loaded. Fix: resume with "
                "as many visible GPUs as the saved run (CUDA_VISIBLE_DEVICES), or drop the checkpoint's "
                "state['rng']['cuda'] to give up repeating its GPU dropout.")
        for i, value in enumerate(cuda):
            if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
                refuse(f"CUDA device {i}", f"expected a uint8 tensor, got {type(value).__name__}")


def restore_rng(state: dict[str, Any], generators: list[torch.Generator] = ()) -> None:
    """Put back what :func:`capture_rng` captured (the CUDA states only where CUDA is available).

    Example:
        >>> restore_rng(capture_rng())
    """
    if len(state["generators"]) != len(generators):
        raise ValueError(
            f"the saved random state holds {len(state['generators'])} loader generator(s) but this loader has "
            f"{len(generators)}. Fix: build the DataLoader as in the saved run (same generator= / sampler).")
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["random"]))
    if state.get("numpy") is not None:
        import numpy as np

        name, key, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for gen, saved in zip(generators, state["generators"]):
        gen.set_state(saved)


def _as_tuples(value: Any) -> Any:
    # random.setstate wants tuples; a state that went through another serializer may come back as lists.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
