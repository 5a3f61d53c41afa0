"""Build this checkout's engine compiled by mypyc into a directory of its own. Not a test.

    python bench/compile_engine.py DIR        # then: PYTHONPATH=DIR:client:server ...

DIR/kvcoord/engine then holds the engine's sources and, beside them, a C extension per
module (and DIR the runtime they share); put first on the path, ``kvcoord.engine`` is
the compiled one (a regular package: it shadows client/kvcoord/engine, the rest of
``kvcoord`` still comes from client and server). ``bench/decode_cpu.py --engine-build
DIR`` and ``bench/vllm_calls.py --engine-build DIR`` measure it beside the pure engine.
Nothing is written into the source tree (a compiled module beside the source it was
built from goes stale at the next edit). About 1.5-2 minutes on 2 cores; needs mypy
(mypyc) and a C compiler. See bench/README.md, "A compiled engine (mypyc)".

Modules left interpreted (:data:`INTERPRETED`): ``_mypyc`` (mypyc's decorators, for
the pure engine), ``decode_columns`` (the service subclasses its dataclass, which an
interpreted class cannot do to a compiled one), ``events`` and ``results`` (frozen
dataclasses built without their ``__init__``: ``object.__new__`` and slot descriptors,
which a compiled class has not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[1] / "client"
INTERPRETED = frozenset({"_mypyc.py", "decode_columns.py", "events.py", "results.py"})


def engine_sources() -> list[str]:
    """The engine's modules mypyc compiles, relative to client/, sorted."""
    engine = CLIENT / "kvcoord" / "engine"
    return sorted(
        str(p.relative_to(CLIENT))
        for p in engine.rglob("*.py")
        if p.relative_to(engine).as_posix() not in INTERPRETED
    )


def compile_engine(out: Path, opt_level: str = "3") -> None:
    """The compiled engine (sources and extensions) into ``out``."""
    from mypyc.build import mypycify
    from setuptools import setup

    out = out.resolve()
    work = Path(tempfile.mkdtemp(prefix="kvcoord-mypyc-"))
    here = Path.cwd()
    os.chdir(CLIENT)  # mypy reads the sources by these relative paths
    try:
        modules = mypycify(
            ["--explicit-package-bases", *engine_sources()], opt_level=opt_level, target_dir=str(work / "c")
        )
        setup(
            name="kvcoord-engine-compiled",
            ext_modules=modules,
            script_args=["build_ext", "--build-lib", str(out), "--build-temp", str(work / "o")],
        )
    finally:
        os.chdir(here)
        shutil.rmtree(work, ignore_errors=True)
    for src in (CLIENT / "kvcoord" / "engine").rglob("*.py"):  # the interpreted ones, and the sources
        dst = out / src.relative_to(CLIENT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the build directory (put it first on PYTHONPATH)")
    ap.add_argument("--opt-level", default="3", choices=["0", "1", "2", "3"])
    args = ap.parse_args()
    compile_engine(args.out, args.opt_level)
    print(f"compiled engine in {args.out}: PYTHONPATH={args.out.resolve()}:client:server", file=sys.stderr)


if __name__ == "__main__":
    main()
