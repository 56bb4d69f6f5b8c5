"""docs/operations.md's flag table is what `python -m minisgl.flag_table` generates from the
services' declarations, so a flag added, renamed or re-defaulted shows up in the docs."""

from __future__ import annotations

import pytest
from minisgl.flag_table import BEGIN, COMMAND, DOC, END, main, render, table
from minisgl.flags import all_flags


def test_the_docs_table_is_current() -> None:
    text = DOC.read_text()
    assert render(text) == text, f"docs/operations.md's flag table is out of date: run `{COMMAND}`"


def test_every_flag_and_variable_is_in_the_table() -> None:
    generated = table()
    for flags in all_flags().values():
        for f in flags:
            assert f"`{f.option}" in generated, f.option
            assert all(v.removeprefix(f"MINISGL_{f.service.upper()}_") in generated
                       for v in f.env), f.env


def test_a_stale_table_is_found_and_rewritten(tmp_path, capsys) -> None:
    doc = tmp_path / "ops.md"
    doc.write_text(f"intro\n{BEGIN}\n| old | table |\n{END}\nafter\n")
    assert main(["--check", "--doc", str(doc)]) == 1
    assert COMMAND in capsys.readouterr().err
    assert main(["--doc", str(doc)]) == 0
    assert doc.read_text() == f"intro\n{BEGIN}\n{table()}{END}\nafter\n"
    assert main(["--check", "--doc", str(doc)]) == 0


def test_the_markers_are_required() -> None:
    with pytest.raises(ValueError, match="markers"):
        render("no table here\n")
