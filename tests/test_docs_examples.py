"""The docs' code is checked, not just read (issue 11, item 12).

* Every call of a memwrap function in the docs' Python blocks and inline code (``measure_peak(model, batch,
  loss_fn, steps=1)``) must bind to that function's real signature: a positional argument where the function
  takes keywords only (``measure_peak(model, batch, loss_fn, steps)``, a TypeError) or a misspelled keyword fails
  here, without running anything.
* Blocks marked ``<!-- test: run -->`` (cheap, self-contained) are executed.
"""
from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"(<!-- test: run -->\s*\n)?```python\n(.*?)```", re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+\([^`\n]*\))`(?!`)")


def _functions() -> dict[str, object]:
    """Public memwrap callables by the names docs call them with (``measure_peak``, ``memwrap.plan``, ...)."""
    import memwrap
    import memwrap.memory as memory

    out = {}
    for module in (memwrap, memory):
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if inspect.isfunction(obj):
                out[name] = obj
    return out


def _calls(source: str):
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a signature written with `*` or `...`: not a call
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            # only memwrap.X(...), memwrap.memory.X(...) or a bare X(...): not p.plan(...) on some other object
            owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
            if name and owner in ("", "memwrap", "memwrap.memory"):
                yield name, node


def _snippets(path: pathlib.Path):
    """``(source, line, whole)``: code blocks are whole programs; inline code may abbreviate (``plan(margin=0.1)``)."""
    text = path.read_text()
    for m in BLOCK.finditer(text):
        yield m.group(2), text[:m.start()].count("\n") + 1, True
    for m in INLINE.finditer(text):
        yield m.group(1), text[:m.start()].count("\n") + 1, False


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_documented_call_binds_to_the_real_signature(path):
    functions = _functions()
    bad = []
    for source, line, whole in _snippets(path):
        for name, node in _calls(source):
            fn = functions.get(name)
            if fn is None or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            if any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in [*node.args, *(k.value for k in node.keywords)]):
                continue  # "f(x, ...)": an abbreviation, not a call
            kwargs = {k.arg: None for k in node.keywords if k.arg is not None}
            signature = inspect.signature(fn)
            try:  # inline code may leave arguments out; it may not pass too many or unknown ones
                (signature.bind if whole else signature.bind_partial)(*[None] * len(node.args), **kwargs)
            except TypeError as exc:
                bad.append(f"{path.name}:{line}: {ast.unparse(node)}: {exc}")
    assert not bad, "\n".join(bad)


RUNNABLE = [(p, i, src) for p in DOCS for i, m in enumerate(BLOCK.finditer(p.read_text())) if m.group(1)
            for src in [m.group(2)]]


@pytest.mark.parametrize("path,index,source", RUNNABLE, ids=[f"{p.name}-{i}" for p, i, _ in RUNNABLE])
def test_runnable_doc_blocks_run(path, index, source, recwarn):
    exec(compile(source, f"{path.name} block {index}", "exec"), {"__name__": "__doc_example__"})


def test_the_measure_peak_call_in_the_planner_docs_was_checked():
    # The checker sees inline code: the docs' reference call of measure_peak is among what it binds.
    text = (ROOT / "docs" / "planner.md").read_text()
    calls = [ast.unparse(n) for s, _, _ in _snippets(ROOT / "docs" / "planner.md") for name, n in _calls(s)
             if name == "measure_peak"]
    assert calls and "measure_peak" in text
    from memwrap.memory import measure_peak

    with pytest.raises(TypeError):  # what the docs used to say: measure_peak(model, batch, loss_fn, steps)
        inspect.signature(measure_peak).bind_partial(None, None, None, None)
