"""The API reference is generated from the docstrings and kept in sync with them."""

from __future__ import annotations

import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_api_reference_matches_the_docstrings():
    generator = runpy.run_path(os.path.join(ROOT, "docs", "generate_api.py"))
    with open(os.path.join(ROOT, "docs", "api.md")) as fh:
        assert fh.read() == generator["render"](), "docs/api.md is stale: run python docs/generate_api.py"


def test_every_config_field_is_documented():
    from dataclasses import fields

    from async_ckpt import CheckpointConfig

    doc = CheckpointConfig.__doc__ or ""
    assert [f.name for f in fields(CheckpointConfig) if f"{f.name}:" not in doc] == []


def test_the_readme_gives_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = runpy.run_path(os.path.join(ROOT, ".ci", "readme_command.py"))["setup_commands"]
    with open(os.path.join(ROOT, "README.md")) as fh:
        found = commands(fh.read())
    assert found["test"].endswith("python -m pytest") and found["demo"].endswith("async-ckpt demo")
    assert all("torch==2.13.0" in command for command in found.values())
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        assert 'python3 .ci/readme_command.py test' in fh.read()


@pytest.mark.parametrize("leg, runs", [("conformance", "python tests/conformance/run.py --quick"),
                                       ("oldest", "python -m pytest -m oldest_versions tests/test_install.py")])
def test_ci_runs_each_extra_leg_exactly_as_its_readme_section_says(leg, runs):
    command = runpy.run_path(os.path.join(ROOT, ".ci", "readme_command.py"))["leg_command"]
    with open(os.path.join(ROOT, "README.md")) as fh:
        found = command(fh.read(), leg)
    assert found.endswith(runs) and "torch==2.13.0" in found
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        assert f"python3 .ci/readme_command.py {leg}" in fh.read()


def test_every_error_the_library_raises_is_exported_from_the_package():
    import async_ckpt
    from async_ckpt import errors

    for name in (n for n in dir(errors) if n.endswith("Error")):
        assert getattr(async_ckpt, name) is getattr(errors, name) and name in async_ckpt.__all__, name
