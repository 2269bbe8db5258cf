"""``memwrap plan``: the planner on the command line.

Examples::

    memwrap plan --preset llama-7b --batch 1 --seq 2048 --budget 24GiB
    memwrap plan mypkg.models:build --input-shape 64,3,224,224 --budget 24GiB --plot plan.png
    memwrap plan train.py:make_model --input-shape 8,512 --input-dtype long --input-high 32000 --budget "24 GB" --json

Exit status: 0 when a configuration fits, 3 when nothing fits (the table and verdict are still printed, and
``--json`` is still written), 2 for bad input (as argparse's own errors), 1 for an unexpected failure.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from typing import Any

from memwrap.errors import closest_hint
from memwrap.memory.budget import parse_budget
from memwrap.memory.search.planner import Margin, plan
from memwrap.memory.tracing.batch import split_batch
from memwrap.memory.tracing.trace import _to_fake, fake_model, find_stack
from memwrap.memory.search.report import plan_table, plot_plan, print_plan

__all__ = ["register", "run", "load_factory", "PlanInputError", "EXIT_FITS", "EXIT_BAD_INPUT", "EXIT_NOTHING_FITS",
           "DEFAULT_TOP"]

CHECKPOINT_NAMES = ("none", "selective", "full", "offload", "every-<k>")
EXIT_FITS, EXIT_BAD_INPUT, EXIT_NOTHING_FITS = 0, 2, 3  # `memwrap demo` uses the same codes
DEFAULT_TOP = 20  # rows shown without --top: the grid can hold hundreds of candidates


class PlanInputError(ValueError):
    """Bad command-line input (model target, preset, shapes): ``memwrap plan`` prints it and exits 2."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the ``memwrap`` parser."""
    p = subparsers.add_parser(
        "plan", help="predict peak memory of training configurations and pick the fastest that fits",
        description="Trace one training step per configuration on fake tensors (nothing is allocated), rank the "
                    "configurations that fit the budget (those keeping --keep-optim first, then by predicted step "
                    "time), and print the two lines to paste. Exit status: 0 when a configuration fits, 3 when "
                    "nothing fits, 2 for bad input.")
    p.add_argument("target", nargs="?", help="model factory: 'package.module:function' or 'path/to/file.py:function' "
                                             "(a zero-argument callable returning an nn.Module, or a tuple "
                                             "(model, make_batch) or (model, make_batch, loss_fn) with "
                                             "make_batch(micro_batch_size) -> one micro-batch)")
    p.add_argument("--preset", help="a built-in model preset (memwrap.models), e.g. llama-7b, gpt2-xl, resnet50")
    p.add_argument("--budget", required=True, help='device memory with its unit, e.g. 24GiB, "24 GB" (decimal), '
                                                   '4096B (a bare number such as 24 is refused)')
    p.add_argument("--batch", "--global-batch", dest="batch", type=int, default=None,
                   help="samples per optimizer update (kept fixed; split into micro-batches x accumulation)")
    p.add_argument("--seq", type=int, default=None, help="sequence length for text presets (image side for resnet)")
    p.add_argument("--input-shape", help="shape of one global batch for a factory model, e.g. 64,3,224,224 "
                                         "(first number = batch)")
    p.add_argument("--input-dtype", default=None, choices=("float32", "long"),
                   help="dtype of --input-shape inputs (default float32; long: token ids in [0, --input-high))")
    p.add_argument("--input-high", type=int, default=None,
                   help="upper bound of random token ids (--input-dtype long; default 32000)")
    p.add_argument("--micro-batches", help="comma-separated micro-batch sizes to try (default: powers of two)")
    p.add_argument("--precisions", default=None,
                   help="comma-separated precision modes to search, e.g. fp32,bf16,bf16-true (default: only "
                        "--keep-precision, yours; with --keep-precision any, every registered precision plugin: "
                        "`python -c 'import memwrap; print(memwrap.precisions())'`)")
    p.add_argument("--step-in-backward", default="auto", choices=("auto", "both", "yes", "no"),
                   help="plan the optimizer step inside backward: auto/both try with and without it where wrap() "
                        "allows it (default), yes only with it, no never")
    p.add_argument("--chunked-loss", default="auto", choices=("auto", "both", "yes", "no"),
                   help="plan the chunked LM-head loss: auto tries it when a loss-head plugin knows the model and the "
                        "batch carries labels (default), both/yes/no force it")
    p.add_argument("--checkpoints", default=None,
                   help=f"comma-separated checkpoint policies: {', '.join(CHECKPOINT_NAMES)}, or a plugin's policy "
                        f"(default: none,selective,every-2,full,offload and every plugin policy)")
    p.add_argument("--optimizers", default=None,
                   help="comma-separated optimizer names (default: every installed optimizer in the registry, "
                        "third-party plugins included; `python -c 'import memwrap; print(memwrap.optimizers())'`)")
    p.add_argument("--keep-optim", default="adamw", metavar="NAME",
                   help="the optimizer you train with (default adamw): configurations that keep it rank before those "
                        "that change the optimizer, i.e. the training maths; 'any' ranks by predicted speed alone")
    p.add_argument("--keep-precision", default="fp32", metavar="NAME",
                   help="the precision you train with (default fp32): kept unless --precisions lists others, which "
                        "then rank after it as changes of the training maths; 'any' searches every registered "
                        "precision, ranked by predicted speed alone")
    p.add_argument("--world-size", default="1", metavar="N[,N...]",
                   help="data-parallel ranks (GPUs), e.g. 4 or 2,4,8: --budget is then per GPU and --batch the global "
                        "batch (micro-batch x accumulate x world size)")
    p.add_argument("--strategy", default=None, metavar="fsdp2|ddp",
                   help="how the ranks share the model: fsdp2, ddp, or fsdp2,ddp (default with --world-size > 1: both)")
    p.add_argument("--max-grad-norm", type=float, default=None, help="gradient clipping, as in wrap()")
    p.add_argument("--drop-outputs", action="store_true",
                   help="your loop drops the model's outputs once the loss is computed (loss = model(**batch).loss, "
                        "Trainer); default: it keeps them through backward (outputs = model(**batch); "
                        "outputs.loss.backward()), which holds the logits longer")
    p.add_argument("--margin", type=float, default=0.08, help="margin as a fraction of the peak (default 0.08)")
    p.add_argument("--margin-bytes", default="1GiB",
                   help="fixed margin: CUDA context, workspaces (default 1GiB; 0 or 0B for none)")
    p.add_argument("--top", default=str(DEFAULT_TOP), metavar="N",
                   help=f"show the first N candidates in the table (default {DEFAULT_TOP}; 'all' shows every one)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the plan as JSON to PATH, or to stdout (instead of the table) without PATH")
    p.add_argument("--plot", metavar="PNG", help="stacked bars by category per candidate, with the budget line")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--exhaustive", action="store_true",
                   help="trace every candidate, also the checkpointed ones that a fitting candidate without "
                        "checkpointing (the same settings otherwise) outruns (default: left out, and listed as "
                        "skipped; listing --checkpoints traces them all too)")
    p.add_argument("--no-trace-cache", action="store_true",
                   help="trace every candidate again instead of reading traces made before from the disk cache "
                        "(MEMWRAP_TRACE_CACHE=0 does the same; see docs/planner.md)")
    p.set_defaults(func=run)
    return p


def load_factory(target: str):
    """Import ``'pkg.mod:fn'`` or ``'path/file.py:fn'`` and return ``fn`` (or a module instance).

    A module is looked up in the current directory first, as ``python -m`` would. Raises
    :class:`PlanInputError` naming the problem.

    Example:
        >>> load_factory("memwrap.models:GPT").__name__
        'GPT'
    """
    if ":" not in target:
        raise PlanInputError(f"model target {target!r} needs the form 'package.module:factory' or "
                             f"'path/to/file.py:factory'.")
    where, _, name = target.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        if not os.path.exists(where):
            raise PlanInputError(f"model target: file {where!r} does not exist (looked in {os.getcwd()}). Fix: give "
                                 f"the path of the file that defines {name!r}, relative to the current directory or "
                                 f"absolute, e.g. 'path/to/model.py:{name}'.")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec.loader.exec_module(module)
    else:
        # The console script's sys.path[0] is its bin/ folder, not the current directory.
        cwd = os.getcwd()
        sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            missing = getattr(exc, "name", None)
            if missing and (where == missing or where.startswith(missing + ".")):
                fix = (f"Fix: run memwrap from the directory that holds {where.split('.')[0]!r} (or install it), or "
                       f"name its file: 'path/to/{where.replace('.', '/')}.py:{name}'.")
            else:  # the module exists; something it imports does not
                fix = f"Fix: install what {where!r} imports ({missing or exc}), or import it lazily in the factory."
            raise PlanInputError(f"model target: cannot import {where!r}: {exc}. {fix}") from None
        finally:
            sys.path.remove(cwd)
    try:
        return getattr(module, name)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        factories = [n for n in names if callable(getattr(module, n)) and not isinstance(getattr(module, n), type(sys))]
        raise PlanInputError(f"model target: {where!r} has no attribute {name!r}.{closest_hint(name, names)} Fix: name "
                             f"a factory {where!r} defines, e.g. {', '.join(f'{where}:{n}' for n in factories[:3]) or '(none found: define one)'}.") from None


def _world_sizes(text: str) -> list[int]:
    try:
        return [int(w) for w in _list(text)]
    except ValueError:
        raise PlanInputError(f"--world-size {text!r} must be an integer >= 1 or comma-separated integers, "
                             f"e.g. 4 or 2,4,8.") from None


def _list(text: str | None) -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def _micro_batches(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        sizes = [int(m) for m in _list(text)]
    except ValueError:
        raise PlanInputError(f"--micro-batches {text!r} must be comma-separated integers, e.g. --micro-batches "
                             f"1,2,4.") from None
    bad = [m for m in sizes if m < 1]
    if bad or not sizes:
        raise PlanInputError(f"--micro-batches {text} is not valid: each micro-batch size must be >= 1 (samples per "
                             f"forward), e.g. --micro-batches 1,2,4, or leave the option out to try powers of two.")
    return sizes


def _checkpoints(text: str) -> list[Any]:
    return [None if c.lower() in ("none", "no", "off") else c for c in _list(text)]


def _top(text: str) -> int | None:
    if str(text).strip().lower() == "all":
        return None
    try:
        top = int(text)
    except ValueError:
        top = 0
    if top < 1:
        raise PlanInputError(f"--top {text} is not valid; give the number of candidates to show, >= 1, or 'all'.")
    return top


def _model_and_batches(args):
    import torch

    if args.batch is not None and args.batch < 1:
        raise PlanInputError(f"--batch {args.batch} is not valid; give the samples per optimizer update, >= 1.")
    if args.preset and args.target:
        raise PlanInputError("give either --preset or a model factory, not both.")
    if args.preset:
        # import cost: the built-in models, needed only by presets.
        from memwrap.models import get_preset, preset_batch

        given = [f for f, v in (("--input-shape", args.input_shape), ("--input-dtype", args.input_dtype),
                                ("--input-high", args.input_high)) if v is not None]
        if given:
            raise PlanInputError(f"{' and '.join(given)} apply to a model factory, not to --preset (a preset builds "
                                 f"its own inputs): drop {' and '.join(given)}, and use --batch and --seq.")
        try:
            spec = get_preset(args.preset)
        except ValueError as exc:
            raise PlanInputError(str(exc)) from None
        batch = 1 if args.batch is None else args.batch
        seq = args.seq
        _check_preset_seq(args.preset, spec, seq)
        if spec.kind == "lm":
            # A causal LM preset computes its own loss from labels (as Hugging Face models do): the traced step is
            # the one training runs, and the chunked LM-head loss can be planned.
            return spec.factory, (lambda mb: preset_batch(args.preset, mb, seq, labels=True)), batch, None
        return spec.factory, (lambda mb: preset_batch(args.preset, mb, seq)), batch, spec.loss
    if not args.target:
        raise PlanInputError("give a model: --preset NAME or 'package.module:factory'.")
    if args.seq is not None:
        raise PlanInputError(f"--seq {args.seq} applies to --preset models; a factory model's sequence length is "
                             f"part of --input-shape (e.g. --input-shape "
                             f"{(args.input_shape or '8').split(',')[0]},{args.seq}).")
    module, make, loss = _build_factory(load_factory(args.target))
    if make is not None:  # the factory brought its own batches (and loss): the step it describes is traced
        given = [f for f, v in (("--input-shape", args.input_shape), ("--input-dtype", args.input_dtype),
                                ("--input-high", args.input_high)) if v is not None]
        if given:
            raise PlanInputError(f"{' and '.join(given)} would be ignored: the factory returns its own make_batch. "
                                 f"Drop {' and '.join(given)} and give the global batch with --batch.")
        if args.batch is None:
            raise PlanInputError("a factory that returns (model, make_batch, ...) needs --batch (samples per "
                                 "optimizer update).")
        _preflight(module, make, loss, "the factory's make_batch")
        return module, make, args.batch, loss
    if not args.input_shape:
        raise PlanInputError("a factory model needs --input-shape, e.g. --input-shape 64,3,224,224 (or return "
                             "(model, make_batch, loss_fn) from the factory).")
    try:
        shape = [int(s) for s in args.input_shape.split(",")]
    except ValueError:
        raise PlanInputError(f"--input-shape {args.input_shape!r} must be comma-separated integers.") from None
    if any(d < 1 for d in shape):
        raise PlanInputError(f"--input-shape {args.input_shape!r} must hold sizes >= 1.")
    lm = causal_lm_vocab(module)
    dtype = args.input_dtype or ("long" if lm else "float32")
    if args.input_high is not None and dtype != "long":
        raise PlanInputError("--input-high bounds random token ids; it needs --input-dtype long.")
    batch = shape[0] if args.batch is None else args.batch
    rest = shape[1:]
    positions = _positions(module)
    if dtype == "long" and positions is not None and len(rest) == 1 and rest[0] > positions[0]:
        raise PlanInputError(f"--input-shape {args.input_shape}: a sequence of {rest[0]} tokens is beyond the model's "
                             f"{positions[0]} positions (config.{positions[1]}). Fix: --input-shape "
                             f"{shape[0]},{positions[0]} or less, or build the model with more positions "
                             f"(config.{positions[1]}).")
    what = f"--input-shape {args.input_shape}"
    if dtype == "long":
        high = (lm or 32000) if args.input_high is None else args.input_high
        if lm and len(rest) == 1:
            # A causal LM computes its own cross-entropy from labels (Hugging Face: labels=input_ids, shifted
            # inside the model): the step traced is then the one training runs, not a loss on bare logits.
            def make(mb):
                ids = torch.randint(0, high, (mb, *rest))
                return {"input_ids": ids, "labels": ids}
            _preflight(module, make, None, what, shape)
            if not args.quiet and args.json != "-":
                print(f"memwrap plan: {type(module).__name__} is a causal language model: tracing "
                      f"model(input_ids=..., labels=input_ids) and its own cross-entropy loss", file=sys.stderr)
            return module, make, batch, None
        make = lambda mb: torch.randint(0, high, (mb, *rest))  # noqa: E731
    else:
        make = lambda mb: torch.randn(mb, *rest)  # noqa: E731
    _preflight(module, make, None, what, shape)
    return module, make, batch, None


def _check_preset_seq(name: str, spec: Any, seq: int | None) -> None:
    if seq is None:
        return
    what = "image side" if spec.kind == "image" else "sequence length"
    if seq < 1:
        raise PlanInputError(f"--seq {seq} is not valid: give the {what}, >= 1 (or leave --seq out for the preset's "
                             f"{spec.default_seq_len}).")
    if spec.kind != "image" and seq > spec.default_seq_len:
        raise PlanInputError(f"--seq {seq} is beyond the {spec.default_seq_len} positions (the context length) of "
                             f"preset {name!r}. Fix: --seq {spec.default_seq_len} or less, or a model factory with a longer "
                             f"context (e.g. `memwrap plan my_model.py:build --input-shape BATCH,{seq}`).")


def _positions(module: Any) -> tuple[int, str] | None:
    """``(positions, config field)`` of a model with a learned position table: an ``nn.Embedding`` with as many rows
    as its config's max_position_embeddings, n_positions or block_size. Else None: rotary positions (Llama) have no
    table, and longer sequences run (fake tensors never index the table, so only this check sees the overflow)."""
    from torch import nn

    config = getattr(module, "config", None)
    rows = {m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)}
    for field in ("max_position_embeddings", "n_positions", "block_size"):
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value in rows:
            return value, field
    return None


def _first_layer_hint(module: Any, shape: list[int]) -> tuple[str, list[int] | None]:
    """``(what the model's first layer takes, an --input-shape it takes)`` for the refusal; ``("", None)`` when the
    first layer is of a kind that says nothing about its input."""
    from torch import nn

    layer = next((m for m in module.modules() if next(m.parameters(recurse=False), None) is not None), None)
    want = None
    if isinstance(layer, nn.Linear):
        want = (f"Its first layer ({type(layer).__name__}) takes {layer.in_features} features in the last dimension",
                [*shape[:-1], layer.in_features])
    elif isinstance(layer, nn.modules.conv._ConvNd):
        want = (f"Its first layer ({type(layer).__name__}) takes {layer.in_channels} channels in dimension 1",
                [shape[0], layer.in_channels, *shape[2:]] if len(shape) > 2 else None)
    elif isinstance(layer, nn.Embedding):
        want = (f"Its first layer (Embedding) takes token ids (--input-dtype long --input-high "
                f"{layer.num_embeddings})", None)
    return ("", None) if want is None else (f" {want[0]}.", want[1])


def _preflight(module: Any, make_batch: Any, loss: Any, what: str, shape: list[int] | None = None) -> None:
    """One forward of a micro-batch of 1 on fake tensors (a truncated copy: the first blocks only), so that a batch
    the model cannot take is refused naming the option that made it, before any candidate is traced."""
    import logging

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device("cpu")
    stack = find_stack(module)
    # torch logs the traceback of a failing fake kernel at ERROR before raising it; the refusal below says it all.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level, fake_log.level = fake_log.level, logging.CRITICAL
    try:
        fmodel = fake_model(module, mode, device, stack, min(2, stack.length) if stack is not None else None)
        batch = _to_fake(make_batch(1), mode, device)
        args, kwargs, targets = split_batch(batch)
        with mode, torch.no_grad():
            outputs = fmodel(*args, **kwargs)
            if loss is not None:
                loss(outputs, targets)
    except Exception as exc:  # the model's own forward on the batch the options describe
        hint, example = _first_layer_hint(module, shape) if shape else ("", None)
        reason = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else repr(exc)
        fix = (f"give the shape of one global batch as the model takes it (first number = batch)"
               + (f", e.g. --input-shape {','.join(map(str, example))}" if example else "") if shape
               else "return from make_batch(micro_batch_size) a micro-batch the model's forward takes")
        raise PlanInputError(f"{what}: the model's forward fails on a micro-batch of 1 ({type(exc).__name__}: "
                             f"{reason}).{hint} Fix: {fix}.") from None
    finally:
        fake_log.level = level


def causal_lm_vocab(module: Any) -> int | None:
    """The vocabulary size of a causal language model that computes its own loss from ``labels`` (a
    Hugging Face ``*ForCausalLM``: a ``config`` with ``vocab_size`` and a ``labels`` argument in
    ``forward``), else None.

    Example:
        >>> import torch
        >>> causal_lm_vocab(torch.nn.Linear(2, 2)) is None
        True
    """
    import inspect

    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return None
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return vocab if "labels" in params and "input_ids" in params else None


def _build_factory(factory: Any) -> tuple[Any, Any, Any]:
    """``(module built on the meta device, make_batch or None, loss_fn or None)`` from a factory target."""
    import torch
    from torch import nn

    if isinstance(factory, nn.Module):
        return factory, None, None
    if not callable(factory):
        raise PlanInputError(f"the model target is a {type(factory).__name__}, not a factory (a zero-argument "
                             f"callable) or an nn.Module.")
    with torch.device("meta"):  # nothing allocated: the planner traces a structural copy on fake tensors
        built = factory()
    if isinstance(built, nn.Module):
        return built, None, None
    if isinstance(built, tuple) and len(built) in (2, 3) and isinstance(built[0], nn.Module) and callable(built[1]) \
            and (len(built) == 2 or built[2] is None or callable(built[2])):
        return built[0], built[1], (built[2] if len(built) == 3 else None)
    raise PlanInputError(f"the model factory returned {type(built).__name__}; return an nn.Module, or a tuple "
                         f"(model, make_batch) or (model, make_batch, loss_fn) with make_batch(micro_batch_size) "
                         f"returning one micro-batch and loss_fn(outputs, targets) the training loss.")


def _after_trace(label: str) -> bool:
    """The planner's call after a trace ('traced k/n', after any 'stage ...: ' prefix), as opposed to before one."""
    return label.rpartition(": ")[2].startswith("traced ")


class _Progress:
    """Progress on stderr: a rich bar when rich is installed and stderr is a terminal, else plain lines."""

    def __init__(self, quiet: bool):
        self.quiet, self.bar, self.task, self.t0 = quiet, None, None, time.perf_counter()
        if quiet or not sys.stderr.isatty():
            return
        try:
            from rich.console import Console
            from rich.progress import Progress
        except ImportError:
            return
        self.bar = Progress(console=Console(stderr=True), transient=True)

    def __call__(self, done: int, total: int, label: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            if self.task is None:
                self.bar.start()
                self.task = self.bar.add_task("planning", total=total)
            self.bar.update(self.task, completed=done, description=label)
            return
        if _after_trace(label) and done < total:
            return  # the next "tracing ..." line reports the same count
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {done}/{total} {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.stop()


def run(args: argparse.Namespace) -> int:
    """Execute ``memwrap plan``; returns the exit status: 0 when a configuration fits, 3 when nothing fits
    (:data:`EXIT_NOTHING_FITS`, as ``memwrap demo``), 2 for bad input."""

    try:  # every input error exits 2, as argparse's own do
        parse_budget(args.budget, what="--budget")  # checked here to name the flag; plan() reads the same text
        margin = Margin.parse((args.margin, args.margin_bytes))  # the same validation as plan(margin=...)
        top = _top(args.top)
        keep = None if args.keep_optim.strip().lower() in ("any", "none") else args.keep_optim
        keep_precision = None if args.keep_precision.strip().lower() in ("any", "none") else args.keep_precision
        factory, make_batch, global_batch, loss = _model_and_batches(args)
        micro = _micro_batches(args.micro_batches)
    except ValueError as exc:
        print(f"memwrap plan: {exc}", file=sys.stderr)
        return 2
    if args.no_trace_cache:  # this process only: memwrap.memory.tracing.disk_cache reads it for every trace
        os.environ["MEMWRAP_TRACE_CACHE"] = "0"
    progress = _Progress(args.quiet or args.json == "-")
    try:
        result = plan(factory, make_batch, budget=args.budget, global_batch=global_batch, loss_fn=_loss(loss),
                      precisions=_list(args.precisions),
                      checkpoints=_checkpoints(args.checkpoints) if args.checkpoints is not None else None,
                      optimizers=_list(args.optimizers), micro_batches=micro, margin=margin,
                      max_grad_norm=args.max_grad_norm, keep_optim=keep, keep_precision=keep_precision,
                      progress=progress,
                      world_size=_world_sizes(args.world_size), strategy=_list(args.strategy),
                      step_in_backward=_switch(args.step_in_backward), chunked_loss=_switch(args.chunked_loss),
                      keep_outputs=not args.drop_outputs, exhaustive=True if args.exhaustive else None)
    except (ValueError, TypeError) as exc:
        progress.close()
        print(f"memwrap plan: {exc}", file=sys.stderr)
        return 2
    progress.close()
    status = EXIT_FITS if result.fits else EXIT_NOTHING_FITS
    if args.plot:
        plot_plan(result, args.plot)
    if args.json == "-":
        json.dump(result.to_dict(), sys.stdout, indent=1, default=repr)
        print()
        return status
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.to_dict(), fh, indent=1, default=repr)
    if sys.stdout.isatty():
        print_plan(result, limit=top)
    else:
        print(plan_table(result, limit=top))
    return status


def _switch(value: str):
    """``--step-in-backward``/``--chunked-loss``: None (auto), or the values to search."""
    return {"auto": None, "both": (False, True), "yes": (True,), "no": (False,)}[value]


def _loss(preset_loss):
    if preset_loss is None:
        return None
    return lambda outputs, targets: preset_loss(outputs, targets)
