"""Print one of the README's two set-up commands (``demo`` or ``test``), or one of CI's extra legs.

CI runs the README's own words, so the two cannot drift apart. The commands are the fenced
``bash`` blocks of the README's "Set-up" section: exactly two, one running the demo, one pytest.
The extra legs (``conformance``, ``oldest``) are the one command of their own README sections.
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


#: CI's legs beyond the test command, each the one bash command of its own README section: the
#: section's heading and what the command must run.
LEGS = {
    "conformance": ("Judged by DeepSpeed's own tests", "python tests/conformance/run.py --quick"),
    "oldest": ("Oldest supported versions", "python -m pytest -m oldest_versions"),
}


def leg_command(text: str, leg: str) -> str:
    """The one bash command of the README section behind one of CI's extra legs (``LEGS``)."""
    heading, runs = LEGS[leg]
    section = re.search(rf"^## {re.escape(heading)}\b.*?(?=^## )", text, re.S | re.M)
    blocks = [b.strip() for b in re.findall(r"^```bash\n(.*?)^```", section.group(0), re.S | re.M)] if section else []
    if len(blocks) != 1 or runs not in blocks[0] or "\n" in blocks[0]:
        raise SystemExit(f"README.md's section {heading!r} must hold one one-line bash command running {runs}, "
                         f"found {blocks}")
    return blocks[0]


if __name__ == "__main__":
    with open(README) as fh:
        readme = fh.read()
    print(leg_command(readme, sys.argv[1]) if sys.argv[1] in LEGS else setup_commands(readme)[sys.argv[1]])
