"""Count a package's lines: all lines, and code lines (no blanks, comments, docstrings).

Usage: python scripts/count_lines.py [DIR] [--only NAME,NAME]
(default DIR: client/kvcoord/client). Prints one row per module and a total, so a
size claim ("shrinks by a third") can be checked by anyone.
"""

from __future__ import annotations

import argparse
import ast
import io
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
    args = parser.parse_args(argv)
    only = {name for name in args.only.split(",") if name}
    files = sorted(Path(args.root).glob("*.py"))
    if only:
        files = [path for path in files if path.stem in only]
    total_all = total_code = 0
    for path in files:
        lines, code = count(path.read_text())
        total_all += lines
        total_code += code
        print(f"{path.name:32} {lines:6} {code:6}")
    print(f"{'total':32} {total_all:6} {total_code:6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
