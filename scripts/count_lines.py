"""Count a package's lines: all lines, and code lines (no blanks, comments, docstrings).

Usage: python scripts/count_lines.py [DIR] [--only NAME,NAME] [--at REV]
(default DIR: client/kvcoord/client). Prints one row per module and a total (columns:
all lines, code lines), so a size claim ("shrinks by a third") can be checked by anyone.
``--at REV`` counts DIR as it was at git revision REV (read with ``git show``, the
working tree untouched), e.g. ``--at a2bf467``, the commit issue 21 was filed against.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Line numbers covered by module, class and function docstrings."""
    lines: set[int] = set()
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if not isinstance(node, kinds) or not node.body:
            continue
        first = node.body[0]
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            end = first.end_lineno or first.lineno
            lines.update(range(first.lineno, end + 1))
    return lines


def count(source: str) -> tuple[int, int]:
    """Return (all lines, code lines) of one module's source."""
    total = len(source.splitlines())
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            continue
        code.update(range(tok.start[0], tok.end[0] + 1))
    code -= _docstring_lines(ast.parse(source))
    return total, len(code)


def main(argv: list[str] | None = None) -> int:
    """Print the per-module table and the total."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="client/kvcoord/client")
    parser.add_argument("--only", default="", help="comma-separated module stems")
    parser.add_argument("--at", metavar="REV", help="count the directory as it was at this git revision")
    args = parser.parse_args(argv)
    only = {name for name in args.only.split(",") if name}
    sources = _at_revision(args.root, args.at) if args.at else _in_tree(args.root)
    if only:
        sources = {name: text for name, text in sources.items() if Path(name).stem in only}
    total_all = total_code = 0
    for name, text in sorted(sources.items()):
        lines, code = count(text)
        total_all += lines
        total_code += code
        print(f"{name:32} {lines:6} {code:6}")
    print(f"{'total':32} {total_all:6} {total_code:6}")
    return 0


def _in_tree(root: str) -> dict[str, str]:
    """The modules directly in ``root`` (not its sub-packages), by file name."""
    return {path.name: path.read_text() for path in Path(root).glob("*.py")}


def _at_revision(root: str, rev: str) -> dict[str, str]:
    """The modules directly in ``root`` as they were at git revision ``rev``."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout

    prefix = root.rstrip("/") + "/"
    names = [n for n in git("ls-tree", "--name-only", rev, prefix).split() if n.endswith(".py")]
    return {Path(n).name: git("show", f"{rev}:{n}") for n in names}


if __name__ == "__main__":
    sys.exit(main())
