"""The client's, the engine's, the wire's and the service's modules, checked on their
sources: none reaches into another object's private members or imports another
module's private names; and no module of the client or the service grows past about
500 lines (issue 21, item 7). Import cycles are test_layers.py's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client" / "kvcoord" / "client"
SERVICE = ROOT / "server" / "kvcoord" / "service"

#: the most lines one module of kvcoord.client or kvcoord.service may have ("about 500")
MAX_LINES = 500

#: modules still over MAX_LINES, with the line count they may not grow past; issue 21
#: splits them, and an entry whose module shrank under MAX_LINES fails the test (delete it)
KNOWN_LARGE: dict[str, int] = {}


#: the standard library's documented private names a module may call
STDLIB_PRIVATE = frozenset({"os._exit"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reaches(path: Path) -> list[str]:
    """Where ``path`` reads a private attribute of anything but ``self`` / ``cls`` /
    ``super()`` (a subclass extending its base's hook is the same object), or
    imports a private name from another module of ours (a private module, such as
    ``_requests``, imported whole is that package's own and allowed)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            if ast.unparse(node) in STDLIB_PRIVATE:
                continue
            out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("kvcoord")):
            for alias in node.names:
                module = node.module or ""
                if _private(alias.name) and not (node.level and not module):
                    out.append(
                        f"{path.name}:{node.lineno} from {'.' * node.level}{module} import {alias.name}"
                    )
    return out


def _modules() -> list[Path]:
    modules = sorted(CLIENT.rglob("*.py"))
    assert len(modules) > 15 and any(p.name == "manager.py" for p in modules)
    return modules


def test_no_client_module_reaches_into_private_members() -> None:
    """kvcoord.client's modules, the engine's, the wire's, the conformance tools' and
    kvcoord.service's (issue 21 item 4)."""
    service = sorted(SERVICE.glob("*.py"))
    assert len(service) > 30 and any(p.name == "pool_service.py" for p in service)
    shared = [p for d in ("engine", "wire", "conformance") for p in sorted((CLIENT.parent / d).rglob("*.py"))]
    assert len(shared) > 40 and any(p.name == "decode_run.py" for p in shared)
    bad = [use for p in _modules() + service + shared for use in private_reaches(p)]
    assert not bad, "private members reached from outside their object:\n" + "\n".join(bad)


def test_the_private_check_sees_a_reach(tmp_path: Path) -> None:
    """The check above finds what it looks for (it cannot pass by reading nothing)."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nfrom .batch import _pack, Item\n"
        "from . import _requests as rq\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        os._exit(1)\n"
        "        return self._x + other._y + self.__class__.__name__.__len__() + super()._z\n"
    )
    assert private_reaches(sample) == ["sample.py:2 from .batch import _pack", "sample.py:7 other._y"]


def test_no_module_is_over_about_500_lines() -> None:
    """kvcoord.client's modules (named as in the package) and kvcoord.service's
    (``service/`` and the name)."""
    service = sorted(SERVICE.glob("*.py"))
    assert len(service) > 20 and any(p.name == "servicer.py" for p in service)
    sizes = {p.relative_to(CLIENT).as_posix(): len(p.read_text().splitlines()) for p in _modules()}
    sizes |= {f"service/{p.name}": len(p.read_text().splitlines()) for p in service}
    grown = {n: s for n, s in sizes.items() if s > MAX_LINES and s > KNOWN_LARGE.get(n, 0)}
    assert not grown, f"modules over {MAX_LINES} lines (split them by role): {grown}"
    shrunk = [n for n, cap in KNOWN_LARGE.items() if sizes.get(n, 0) <= MAX_LINES]
    assert not shrunk, f"no longer over {MAX_LINES} lines (delete them from KNOWN_LARGE): {shrunk}"
