"""Print one of the README's two set-up commands (``demo`` or ``test``), or its ``conformance`` command.

CI runs the README's own words, so the two cannot drift apart. The commands are the fenced
``bash`` blocks of the README's "Set-up" section: exactly two, one running the demo, one pytest.
"""

from __future__ import annotations

import os
import re
import sys

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MARKERS = {"demo": "async-ckpt demo", "test": "pytest"}


def setup_commands(text: str) -> dict[str, str]:
    section = re.search(r"^## Set-up\b.*?(?=^## )", text, re.S | re.M)
    if section is None:
        raise SystemExit("README.md has no '## Set-up' section")
    blocks = [b.strip() for b in re.findall(r"^```bash\n(.*?)^```", section.group(0), re.S | re.M)]
    if len(blocks) != 2 or any("\n" in b for b in blocks):
        raise SystemExit(f"README.md's Set-up section must hold exactly two one-line bash commands, found {blocks}")
    found = {name: [b for b in blocks if marker in b] for name, marker in MARKERS.items()}
    if any(len(match) != 1 for match in found.values()):
        raise SystemExit(f"README.md's Set-up commands must be one demo and one test command, found {blocks}")
    return {name: match[0] for name, match in found.items()}


def conformance_command(text: str) -> str:
    """The one bash command of the README's conformance section (DeepSpeed's own tests, CI's subset)."""
    section = re.search(r"^## Judged by DeepSpeed's own tests\b.*?(?=^## )", text, re.S | re.M)
    blocks = [b.strip() for b in re.findall(r"^```bash\n(.*?)^```", section.group(0), re.S | re.M)] if section else []
    if len(blocks) != 1 or "tests/conformance/run.py --quick" not in blocks[0] or "\n" in blocks[0]:
        raise SystemExit(f"README.md's conformance section must hold one one-line bash command running "
                         f"tests/conformance/run.py --quick, found {blocks}")
    return blocks[0]


if __name__ == "__main__":
    with open(README) as fh:
        readme = fh.read()
    print(conformance_command(readme) if sys.argv[1] == "conformance" else setup_commands(readme)[sys.argv[1]])
