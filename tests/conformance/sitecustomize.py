"""Injection for conformance runs: every engine ``deepspeed.initialize`` returns is wrapped by async_ckpt.

DeepSpeed's own checkpoint tests create their engines inside spawned rank processes and must run
unchanged, so the wrap has to happen where every interpreter starts: this file is put on
``PYTHONPATH`` by ``tests/conformance/run.py`` and does nothing unless
``ASYNC_CKPT_CONFORMANCE_LOG`` names a file. Each save's outcome (committed or the failure) is
appended to that file, so that a background failure that no test reads back still fails the run.
``ASYNC_CKPT_CONFORMANCE_OPTIONS`` (a JSON object) adds options to the wrap, e.g. DeepSpeed's
re-save semantics, ``{"overwrite_tags": true}``. Each wrap's own URL (unused: the tests name their
folders in ``save_checkpoint``) is a fresh folder under ``ASYNC_CKPT_CONFORMANCE_WORK``, which the run
removes.
"""

import os

if os.environ.get("ASYNC_CKPT_CONFORMANCE_LOG"):
    import importlib.abc
    import sys

    def _record(handle):
        error = handle.exception()
        line = f"{handle.url}\t{handle.tag}\t{'ok' if error is None else repr(error)}\n"  # the url names the test
        with open(os.environ["ASYNC_CKPT_CONFORMANCE_LOG"], "a") as log:
            log.write(line)

    def _wrap_initialize(deepspeed):
        import json
        import tempfile

        import async_ckpt

        options = json.loads(os.environ.get("ASYNC_CKPT_CONFORMANCE_OPTIONS") or "{}")

        original = deepspeed.initialize

        def initialize(*args, **kwargs):
            result = original(*args, **kwargs)
            engine = result[0]
            if hasattr(engine, "save_checkpoint"):
                url = tempfile.mkdtemp(prefix="wrap_", dir=os.environ.get("ASYNC_CKPT_CONFORMANCE_WORK"))
                async_ckpt.wrap(engine, url, on_error="raise", on_save_done=_record, **options)
            return result

        deepspeed.initialize = initialize

    class _AfterDeepSpeedImport(importlib.abc.MetaPathFinder):
        """Patches ``deepspeed.initialize`` right after ``deepspeed`` is first imported (not before:
        importing DeepSpeed here would slow every interpreter and pick its accelerator too early)."""

        def find_spec(self, name, path=None, target=None):
            if name != "deepspeed":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            loader = spec.loader
            exec_module = loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                _wrap_initialize(module)

            loader.exec_module = exec_and_patch
            return spec

    import importlib.util

    sys.meta_path.insert(0, _AfterDeepSpeedImport())
