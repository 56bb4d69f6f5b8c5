"""Prints the third-party requirements of the given package directories, one per line.

The Dockerfile installs these (pinned by a constraints file) before it copies any source, so a code
change rebuilds only the layer that installs our own packages. Our own packages (minisgl-*) are
left out: they are installed from the source tree afterwards. Standard library only.

    python pyproject_deps.py libs/minisgl_core services/gateway [--extra gpu]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirements(package_dirs: list[str], extras: list[str]) -> list[str]:
    found: list[str] = []
    for directory in package_dirs:
        project = tomllib.loads((Path(directory) / "pyproject.toml").read_text())["project"]
        reqs = list(project.get("dependencies", []))
        for extra in extras:
            reqs += project.get("optional-dependencies", {}).get(extra, [])
        for req in reqs:
            name = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")
            if not name.startswith("minisgl") and req not in found:
                found.append(req)
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirs", nargs="+", help="directories holding a pyproject.toml")
    parser.add_argument("--extra", action="append", default=[], help="optional dependency group")
    args = parser.parse_args()
    print("\n".join(requirements(args.dirs, args.extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
