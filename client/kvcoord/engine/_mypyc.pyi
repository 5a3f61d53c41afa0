# What mypy and mypyc see of _mypyc.py: mypy_extensions' decorators, which mypyc
# recognizes by these names (no runtime import: the engine needs only the standard library).
from mypy_extensions import mypyc_attr as mypyc_attr
from mypy_extensions import trait as trait

__all__ = ["mypyc_attr", "trait"]
