"""Write docs/api.md from the public API's signatures and docstrings.

Run ``python docs/generate_api.py`` after changing a public signature or docstring; a test fails
while docs/api.md differs from what this script writes.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

HEADER = """# async_ckpt API reference

Generated from the docstrings by `python docs/generate_api.py`; do not edit by hand.
The README has the guarantees, the limits and the command line.
"""


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__ or "(no docstring)")


def _signature(name: str, obj: Any) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _function(name: str, obj: Any, level: str = "###") -> list[str]:
    return [f"{level} `{_signature(name, obj)}`", "", _doc(obj), ""]


def _class(cls: type, methods: list[str], *, signature: bool = False) -> list[str]:
    """``signature``: give the constructor's (a dataclass's fields with their defaults)."""
    name = _signature(cls.__name__, cls) if signature else cls.__name__
    lines = [f"### class `{name}`", "", _doc(cls), ""]
    for method in methods:
        attr = inspect.getattr_static(cls, method)
        if isinstance(attr, property):  # read as an attribute: its type, not a call signature
            returns = inspect.signature(attr.fget).return_annotation
            lines += [f"#### `{cls.__name__}.{method}: {returns}` (property)", "", _doc(attr.fget), ""]
        else:
            lines += _function(f"{cls.__name__}.{method}", getattr(cls, method), "####")
    return lines


def render() -> str:
    import async_ckpt
    from async_ckpt import errors
    from async_ckpt.export import export_hf
    from async_ckpt.pull import pull
    from async_ckpt.resume import resolve
    from async_ckpt.universal import to_universal

    lines = [HEADER, "## Wrapping an engine", ""]
    lines += _function("async_ckpt.wrap", async_ckpt.wrap)
    lines += _class(async_ckpt.AsyncCheckpointer, ["save", "save_consolidated", "wait", "load", "close", "failures",
                                                   "staging_bytes", "staging_reserved"])
    lines += _function("async_ckpt.wait_all", async_ckpt.wait_all)
    lines += _class(async_ckpt.SaveHandle, ["done", "wait", "result", "exception", "local_done", "wait_local",
                                            "local_result"])
    lines += _class(async_ckpt.SaveResult, ["persist_gbps"], signature=True)
    lines += ["## Configuration", ""]
    lines += _class(async_ckpt.CheckpointConfig, ["effective_wait_timeout_s"], signature=True)
    lines += ["## Tools (the library behind the `async-ckpt` commands)", ""]
    for name, fn in (("async_ckpt.resume.resolve", resolve), ("async_ckpt.pull.pull", pull),
                     ("async_ckpt.export.export_hf", export_hf), ("async_ckpt.universal.to_universal", to_universal)):
        lines += _function(name, fn)
    from async_ckpt import hf_trainer

    lines += ["## Under Hugging Face Trainer (`async_ckpt.hf_trainer`)", ""]
    lines += _function("async_ckpt.hf_trainer.enable", hf_trainer.enable)
    lines += _class(hf_trainer.AsyncCheckpointCallback, ["close"])
    lines += _function("async_ckpt.hf_trainer.last_committed_checkpoint", hf_trainer.last_committed_checkpoint)
    lines += ["## Errors", "", "Every error derives from `AsyncCkptError` and says what to do.", ""]
    for name in sorted(n for n in dir(errors) if n.endswith("Error")):
        cls = getattr(errors, name)
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        summary = " ".join(_doc(cls).split("\n\n")[0].split())
        lines.append(f"- `{name}({bases})`: {summary}")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "api.md")
    with open(path, "w") as fh:
        fh.write(render())
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
