"""Run DeepSpeed's own checkpoint tests, stock and with async_ckpt injected, and tabulate them per file.

DeepSpeed's tests are the judge of compatibility: they run unchanged, from a copy of DeepSpeed's
``tests/`` folder (``--deepspeed-tests``), once with DeepSpeed's own checkpoint engine and once
with every engine wrapped by async_ckpt (``sitecustomize.py`` beside this file). A test that
fails or is skipped on stock DeepSpeed too (fp16 or CUDA only, on CPU) is listed with its reason;
any other difference is a conformance failure. Every background save's outcome is logged by the
injection, and a failed save fails the run even where no test read it back.

Needs pytest>=7.2,<8.4 and pytest-timeout in the interpreter that runs this (DeepSpeed's own pin):
    pip install -e '.[example]' 'pytest>=7.2,<8.4' pytest-timeout huggingface_hub
    python tests/conformance/run.py --out benchmarks/results/conformance.json

By default it runs the tests listed in ``selection.txt`` (why some are left out is written there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_TESTS = ROOT.parent / "shared" / "deepspeed-tests"


def run_mode(mode: str, tests_dir: Path, selection: list[str], work: Path, timeout_s: int,
             wrap_options: dict | None = None) -> dict:
    """One pytest run of ``selection``: every test's outcome, and (injected) every background save's."""
    junit = work / f"{mode}.xml"
    saves = work / f"{mode}-saves.log"
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="4", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(work / "torch_extensions"))
    env.pop("ASYNC_CKPT_CONFORMANCE_LOG", None)
    env.pop("ASYNC_CKPT_CONFORMANCE_OPTIONS", None)
    env.pop("ASYNC_CKPT_CONFORMANCE_WORK", None)
    if mode == "async_ckpt":
        env["ASYNC_CKPT_CONFORMANCE_LOG"] = str(saves)
        env["ASYNC_CKPT_CONFORMANCE_WORK"] = str(work / "wrap_urls")
        (work / "wrap_urls").mkdir(exist_ok=True)
        env["ASYNC_CKPT_CONFORMANCE_OPTIONS"] = json.dumps(wrap_options or {})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--timeout={timeout_s}",
               f"--junitxml={junit}", "-q", *selection]
    print(f"[{mode}] {' '.join(command)}", flush=True)
    started = time.monotonic()
    subprocess.run(command, cwd=tests_dir, env=env, check=False)
    print(f"[{mode}] {time.monotonic() - started:.0f} s", flush=True)
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if not case.get("classname"):  # the test an interrupt stopped: it has no outcome
            continue
        parts = case.get("classname", "").split(".")
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
        nodeid = "::".join(["/".join(parts[:module + 1]) + ".py", *parts[module + 1:], case.get("name", "")])
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = (child.get("message") or "").strip()
                message = text.splitlines()[0][:200] if text else ""
        results[nodeid] = {"outcome": outcome, "message": message, "seconds": round(float(case.get("time", 0)), 1)}
    outcomes = saves.read_text().splitlines() if saves.exists() else []
    return {"tests": results, "wrap_options": (wrap_options or {}) if mode == "async_ckpt" else None,
            "saves_ok": sum(line.endswith("\tok") for line in outcomes),
            "failed_saves": [line for line in outcomes if not line.endswith("\tok")]}


def tabulate(stock: dict, ours: dict) -> tuple[list[dict], list[str]]:
    """Per file: tests run; passed on stock and with async_ckpt; not passing on stock either (with the
    reasons); failing with async_ckpt only (the regressions, each listed)."""
    rows: dict[str, dict] = defaultdict(lambda: {"run": 0, "stock_passed": 0, "async_passed": 0,
                                                 "not_passing_on_stock": 0, "async_only_failures": 0,
                                                 "not_run_with_async_ckpt": 0, "stock_reasons": set()})
    regressions = []
    for nodeid in sorted(set(stock["tests"]) | set(ours["tests"])):
        base = stock["tests"].get(nodeid, {"outcome": "not run", "message": ""})
        mine = ours["tests"].get(nodeid)
        row = rows[nodeid.split("::")[0]]
        if mine is None:
            row["not_run_with_async_ckpt"] += 1
            continue
        row["run"] += 1
        row["stock_passed"] += base["outcome"] == "passed"
        row["async_passed"] += mine["outcome"] == "passed"
        if base["outcome"] != "passed":
            row["not_passing_on_stock"] += 1
            row["stock_reasons"].add(f"{base['outcome']}: {base['message'][:90]}")
        elif mine["outcome"] != "passed":
            row["async_only_failures"] += 1
            regressions.append(f"{nodeid}: {mine['outcome']}: {mine['message']}")
    table = [{"file": name, **counts, "stock_reasons": sorted(counts["stock_reasons"])}
             for name, counts in sorted(rows.items())]
    return table, regressions


def markdown(table: list[dict]) -> str:
    columns = ("run", "stock_passed", "async_passed", "not_passing_on_stock", "async_only_failures",
               "not_run_with_async_ckpt")
    lines = ["| file | run (both) | passed, stock | passed, async_ckpt | not passing on stock either "
             "| failing with async_ckpt only | not run with async_ckpt |", "|---|---|---|---|---|---|---|"]
    for row in table:
        lines.append(f"| `{row['file'].rsplit('/', 1)[-1]}` | " + " | ".join(str(row[c]) for c in columns) + " |")
    lines.append("| **all** | " + " | ".join(str(sum(r[c] for r in table)) for c in columns) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("selection", nargs="*", default=None,
                        help="pytest node ids relative to the DeepSpeed tests folder (default: those in "
                             "selection.txt beside this file; 'unit/checkpoint' runs all)")
    parser.add_argument("--deepspeed-tests", type=Path, default=Path(os.environ.get("DEEPSPEED_TESTS", DEFAULT_TESTS)))
    parser.add_argument("--modes", default="stock,async_ckpt")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test (the first builds ops)")
    parser.add_argument("--work", type=Path, default=None, help="keep junit files and op builds here")
    parser.add_argument("--out", type=Path, default=None, help="write the table and every outcome as JSON")
    parser.add_argument("--wrap-options", type=json.loads, default={}, metavar="JSON",
                        help="options for every async_ckpt.wrap of the async_ckpt mode, e.g. '{\"overwrite_tags\": true}'")
    parser.add_argument("--quick", action="store_true",
                        help="CI's run: only async_ckpt, on the tests in selection-quick.txt (each passes on stock "
                             "DeepSpeed here); fails unless every one passes and every background save commits")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON",
                        help="tabulate earlier single-mode runs instead: the stock one, then async_ckpt ones (a "
                             "later run's outcome of a test replaces an earlier one's)")
    args = parser.parse_args()
    if not isinstance(args.wrap_options, dict):
        parser.error(f"--wrap-options must be a JSON object of async_ckpt.wrap options, got {args.wrap_options!r}")
    if args.quick:
        args.modes = "async_ckpt"
    if not args.selection:
        lines = (HERE / ("selection-quick.txt" if args.quick else "selection.txt")).read_text().splitlines()
        args.selection = [line for line in lines if line.strip() and not line.startswith("#")]
    if args.combine:
        ours: dict = {"tests": {}, "saves_ok": 0, "failed_saves": []}
        for path in args.combine[1:]:
            run = json.loads(path.read_text())["runs"]["async_ckpt"]
            ours["tests"].update(run["tests"])
            ours["saves_ok"] += run["saves_ok"]
            ours["failed_saves"] += run["failed_saves"]
        runs = {"stock": json.loads(args.combine[0].read_text())["runs"]["stock"], "async_ckpt": ours}
        return report(runs, args.selection, args.out)
    if not (args.deepspeed_tests / "unit" / "checkpoint").is_dir():
        print(f"DeepSpeed's tests not found at {args.deepspeed_tests}: pass --deepspeed-tests (a copy of DeepSpeed's "
              "tests/ folder)", file=sys.stderr)
        if args.quick:  # CI's leg fails: a conformance run that ran nothing is not a pass
            print("conformance (quick): FAILED, DeepSpeed's tests are not on this machine")
        return 2
    import pytest
    if not (7, 2) <= tuple(int(p) for p in pytest.__version__.split(".")[:2]) < (8, 4):
        print(f"pytest {pytest.__version__}: DeepSpeed's tests need pytest>=7.2,<8.4 (pip install 'pytest>=7.2,<8.4' "
              "pytest-timeout)", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="async_ckpt_conformance_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        runs = {mode: run_mode(mode, args.deepspeed_tests, args.selection, work, args.timeout, args.wrap_options)
                for mode in args.modes.split(",")}
    finally:
        if args.work is None:  # a folder of our own: its op builds and junit files go with it
            shutil.rmtree(work, ignore_errors=True)
    status = report(runs, args.selection, args.out)
    if args.quick:
        ours = runs["async_ckpt"]
        failed = [f"{nodeid}: {r['outcome']}: {r['message']}" for nodeid, r in ours["tests"].items()
                  if r["outcome"] != "passed"]
        for line in failed + ours["failed_saves"]:
            print("FAIL", line)
        print(f"conformance (quick): {len(ours['tests']) - len(failed)} of {len(ours['tests'])} DeepSpeed tests passed "
              "with async_ckpt")
        if not ours["saves_ok"]:  # DeepSpeed's tests passed, but on its own engine: the injection never ran
            print("FAIL no background save of async_ckpt committed: sitecustomize.py did not wrap DeepSpeed's engines")
        status = 1 if (failed or ours["failed_saves"] or not ours["saves_ok"]
                       or len(ours["tests"]) != len(args.selection)) else status
    return status


def report(runs: dict, selection: list[str], out: Path | None) -> int:
    """Print the table (both modes) and the regressions; non-zero exit if there is any or a save failed."""
    result: dict = {"selection": selection, "runs": runs}
    status = 0
    if set(runs) == {"stock", "async_ckpt"}:
        table, regressions = tabulate(runs["stock"], runs["async_ckpt"])
        result.update(table=table, regressions=regressions, markdown=markdown(table))
        print(result["markdown"])
        for row in table:
            for reason in row["stock_reasons"]:
                print(f"  {row['file']}: on stock: {reason}")
        for line in regressions + runs["async_ckpt"]["failed_saves"]:
            print("FAIL", line)
        status = 1 if regressions or runs["async_ckpt"]["failed_saves"] else 0
    for mode, run in runs.items():
        if not run["tests"]:
            print(f"FAIL no test ran in mode {mode}: check the node ids (relative to the DeepSpeed tests folder)")
            status = 1
    if "async_ckpt" in runs:
        print(f"async_ckpt: {runs['async_ckpt']['saves_ok']} background saves committed, "
              f"{len(runs['async_ckpt']['failed_saves'])} failed")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
