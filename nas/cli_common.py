"""What every `nas` command shares: the two consoles, the one-line failure (exit 2), the YAML loader with
`--set`, the `--out` file check (`nas.cli` and `nas.cli_tools` parse and print with these)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from nas.errors import NasError

err = Console(stderr=True, soft_wrap=True)
out = Console(width=None if sys.stdout.isatty() else 160)  # wide tables when piped to a file or CI log


def fail(message: str, code: int = 2) -> None:
    """Print ``error: MESSAGE`` and exit with ``code``; bad input (2) always on one line, while a failed run (1)
    keeps its lines (the errors of its trials, one a line)."""
    err.print("[bold red]error:[/bold red] " + escape(one_line(message) if code == 2 else message), highlight=False)
    raise typer.Exit(code)


def one_line(message: str) -> str:
    """``message`` on one line: several lines (a YAML with several problems, each ``<file>: <key>: ...``) are
    joined by ``; `` with the prefix they share (up to a ``": "``) written once."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return "".join(lines)
    shared = os.path.commonprefix(lines)
    shared = shared[: shared.rfind(": ") + 2] if ": " in shared else ""
    return shared + "; ".join(line[len(shared):] for line in lines)


def check_output_option(path: Optional[Path], option: str = "--out") -> None:
    """Fail (exit 2) before any work when the file ``path`` given by ``option`` is an existing folder."""
    from nas.atomic import check_output_file

    if path is not None:
        try:
            check_output_file(path)
        except NasError as e:
            fail(f"{option}: {e}")


SET_HELP = ("Override a YAML value, KEY.PATH=VALUE (value read as YAML), e.g. --set train.steps=2 "
             "--set search.trials=1 (repeatable).")


def load_yaml(file: Path, check_files: bool = True, check_predictor: Optional[bool] = None, overrides=()):
    from nas.space import SpecError, load_spec

    try:
        return load_spec(file, check_files=check_files, check_predictor=check_predictor, overrides=tuple(overrides or ()))
    except SpecError as e:
        fail(str(e))
