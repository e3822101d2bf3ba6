"""The package as a user installs it: what the wheel holds, what it declares, and its oldest versions.

The README's own commands run in a new virtual environment on every CI run (``.ci/run``); these
tests add what that run cannot show: that the wheel ships only the library, that every package the
library imports is declared, and that the lowest version of every dependency in ``pyproject.toml``
(pinned in ``tests/oldest-supported.txt``) resolves and passes the compatibility tests.

The oldest-versions test takes about 7 minutes, a third of the default suite, so it is marked
``oldest_versions`` and left out of a plain ``pytest``; CI runs it with the README's command for it
(``pytest -m oldest_versions``), in the environment it made for the test command.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLDEST = os.path.join(ROOT, "tests", "oldest-supported.txt")

#: Run in the oldest-versions environment: DeepSpeed's save, load, zero_to_fp32 and universal
#: conversion, the S3 client stack (s3fs, aiobotocore, botocore), pull's progress bar (tqdm).
#: These are the packages whose oldest pin may differ from what a fresh install resolves (DeepSpeed's
#: oldest, 0.19.8, is also its newest release today); the
#: extras are pinned at today's versions, so the Trainer tests would only repeat the main run (add
#: tests/test_hf_trainer.py here when the transformers bound goes down).
COMPATIBILITY_TESTS = ["tests/test_save_engine.py", "tests/test_s3.py", "tests/test_interop.py", "-k",
                       "(not test_interop or universal or pull_from_s3) and not zero1 and not zero2-fp32"]


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["project"]


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> dict[str, str]:
    """Every declared requirement by distribution name (library and extras)."""
    project = _pyproject()
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += [r for r in extra if _name(r) != "async-ckpt"]
    return {_name(r): r for r in requirements}


def _pins() -> dict[str, str]:
    """``tests/oldest-supported.txt``: distribution name -> the exact version it pins."""
    with open(OLDEST) as fh:
        lines = [line.split("#")[0].strip() for line in fh]
    return {_name(line): line.split("==")[1] for line in lines if line}


def _third_party_imports() -> set[str]:
    """Top-level modules the library's own code imports, stdlib and async_ckpt itself left out."""
    found = set()
    for folder, _, names in os.walk(os.path.join(ROOT, "async_ckpt")):
        for name in names:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as fh:
                    tree = ast.parse(fh.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        found.update(alias.name.split(".")[0] for alias in node.names)
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "async_ckpt"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), ROOT], check=True)
    (built,) = [str(out / n) for n in os.listdir(out) if n.endswith(".whl")]
    return built


def test_the_wheel_holds_only_the_library(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"async_ckpt", "async_ckpt-0.1.0.dist-info"}
    assert [n for n in names if "/tests/" in n or "conftest" in n] == []


def test_the_benchmarks_ship_inside_the_package_for_async_ckpt_bench(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "async_ckpt/bench/save_bench.py" in names
    assert not any(n.startswith("benchmarks/") for n in names)


def test_every_package_the_library_imports_is_declared():
    distributions = importlib.metadata.packages_distributions()
    undeclared = {module: distributions.get(module) for module in _third_party_imports()
                  if not {_name(d) for d in distributions.get(module, [module])} & set(_declared())}
    assert undeclared == {}


def test_every_dependency_has_a_lower_bound_pinned_in_the_oldest_versions_file():
    pins = _pins()
    assert set(pins) == set(_declared())
    for name, requirement in _declared().items():
        bound = re.search(r">=\s*([\w.]+)", requirement)
        assert bound, f"{requirement!r} in pyproject.toml has no lower bound"
        assert pins.get(name) == bound.group(1), f"{name}: pyproject.toml says {requirement!r}, {OLDEST} pins {pins.get(name)}"


@pytest.mark.oldest_versions
def test_the_oldest_supported_versions_install_cleanly_and_pass_the_compatibility_tests(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "async-ckpt")
    subprocess.run([python, "-m", "pip", "install", "-q", "-c", OLDEST, f"{wheel}[test]"], check=True)
    assert subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True).returncode == 0
    frozen = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout
    installed = {_name(line): line.split("==")[1] for line in frozen.split() if "==" in line}
    assert {name: installed.get(name, "").split("+")[0] for name in _pins()} == _pins()
    subprocess.run([python, "-c", "import async_ckpt, s3fs, aiobotocore"], check=True)
    subprocess.run([cli, "--help"], check=True, capture_output=True)
    # -P: the tests import the installed wheel, not the checkout they run from
    run = subprocess.run([python, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *COMPATIBILITY_TESTS],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
