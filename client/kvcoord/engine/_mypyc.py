"""mypyc's class decorators, with nothing to install at runtime.

mypyc (the compiled engine measured by bench/compile_engine.py) reads ``trait`` and
``mypyc_attr`` by their names in ``mypy_extensions``, as ``_mypyc.pyi`` gives them to
mypy; at runtime they return the class. This module is never compiled, so the engine
runs on the standard library alone, compiled or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["mypyc_attr", "trait"]

T = TypeVar("T")


def trait(cls: T) -> T:
    """mypyc: ``cls`` is a trait (a compiled class may list traits after its one base)."""
    return cls


def mypyc_attr(*attrs: str, **kwattrs: Any) -> Callable[[T], T]:
    """mypyc: how to compile the class (``native_class=False``: as a Python class)."""
    return lambda cls: cls
