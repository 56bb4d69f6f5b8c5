"""What each service's parser accepts, as data: every option string, its action, default (with no
MINISGL_* variable set), type, choices, metavar and the variables it falls back to.
service_flags.json holds the snapshot taken from the parsers before their declarations moved to
dataclass fields; test_parsers.py compares the generated parsers with it.

    python -m tests.flags.snapshot --write    # after changing a flag on purpose
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from minisgl.flags import service_flags

SNAPSHOT = Path(__file__).with_name("service_flags.json")


def _action(action: argparse.Action) -> dict[str, Any]:
    return {"options": list(action.option_strings), "action": type(action).__name__,
            "default": action.default,
            # add_argument without a type parses strings as `type=str` does
            "type": getattr(action.type, "__name__", None) or "str",
            "choices": list(action.choices) if action.choices else None,
            "metavar": action.metavar}


def current() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, spec in service_flags().items():
        env = {f.option: list(f.env) for f in spec.flags()}
        actions = [a for a in spec.parser(environ={})._actions if a.option_strings
                   and "--help" not in a.option_strings]
        out[name] = {a.option_strings[0]: {**_action(a), "env": env.get(a.option_strings[0], [])}
                     for a in actions}
    return out


def main() -> None:
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
