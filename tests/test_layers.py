"""The floors of docs/structure.md, read from the source with ``ast``.

Every import of a project module (at the top, inside a function or under
TYPE_CHECKING alike) must go to the same floor or a lower one, the prefill and
decode daemons never import each other, the floors below the transports never
import gRPC or the generated modules, and no two modules import each other,
directly or around a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The folders of the design; each is a subpackage of the one import package, lanekv
# (setup.py maps lanekv.kernels to kernels/ and so on; lanekv/ itself is lanekv).
PACKAGES = ("kernels", "model", "transfer", "runtime", "prefill", "decode", "lanekv", "proto")

# (module prefix, floor); the longest matching prefix decides. Lower floors come first.
FLOORS = (
    ("lanekv.kernels", 0),
    ("lanekv.proto", 0),
    ("lanekv.model", 1),
    ("lanekv.transfer.protocol", 2),
    ("lanekv.runtime", 3),
    ("lanekv.transfer", 4),  # the transports: rank/, grpcfetch/, fastpath/ and errors
    ("lanekv.transfer.connector", 5),  # the decode side's one entry point over the transports
    ("lanekv.prefill", 6),
    ("lanekv.decode", 6),
    ("lanekv", 7),  # the command line, the demo and the HTTP front
)
# Floors that must not speak gRPC: kernels, model code and the transfer protocol.
NO_GRPC_BELOW = 3
SIBLINGS_APART = ("lanekv.prefill", "lanekv.decode")


def package_of(module: str) -> str:
    """``lanekv.prefill.cp.runner`` -> ``lanekv.prefill``."""
    return ".".join(module.split(".")[:2])


def floor_of(module: str) -> int:
    best = max((p for p, _ in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return dict(FLOORS)[best]


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package != "lanekv":
                parts = ("lanekv", *parts)
            modules[".".join(parts)] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from a.b import c`` counts a.b.c when c is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            # The longest prefix that is a project module (``a.b.c`` -> ``a.b`` when c is a name).
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def external_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _imports_proto(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {"lanekv.proto"} if any(n == "lanekv.proto" or n.startswith("lanekv.proto.") for n in names) else set()


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    # A package's __init__ is its own module; importing ``a.b`` does not make ``a`` depend on itself.
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_imports_only_go_down(graph):
    upward = sorted(
        f"{module} (floor {floor_of(module)}) imports {target} (floor {floor_of(target)})"
        for module, targets in graph.items()
        for target in targets
        if floor_of(target) > floor_of(module)
    )
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def test_daemons_do_not_import_each_other(graph):
    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if package_of(module) in SIBLINGS_APART
        and package_of(target) in SIBLINGS_APART
        and package_of(module) != package_of(target)
    )
    assert not crossing, "the prefill and decode daemons import each other:\n" + "\n".join(crossing)


def test_low_floors_speak_no_grpc():
    offenders = sorted(
        f"{name} imports {', '.join(sorted(roots))}"
        for name, path in project_modules().items()
        if floor_of(name) < NO_GRPC_BELOW
        and not name.startswith("lanekv.proto")
        and (roots := external_roots(path) & {"grpc", "grpc_health"} | _imports_proto(path))
    )
    assert not offenders, "kernels, model code and the protocol import gRPC:\n" + "\n".join(offenders)


def test_no_import_cycles(graph):
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path):
    """The checks above fail on a tree that breaks them (so a pass means something)."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "decode").mkdir()
    (tmp_path / "kernels" / "a.py").write_text("from lanekv.decode.b import x\n")
    (tmp_path / "decode" / "b.py").write_text("def f():\n    import lanekv.kernels.a\n")
    modules = {"lanekv.kernels.a": tmp_path / "kernels" / "a.py", "lanekv.decode.b": tmp_path / "decode" / "b.py"}
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    assert graph == {"lanekv.kernels.a": {"lanekv.decode.b"}, "lanekv.decode.b": {"lanekv.kernels.a"}}
    assert floor_of("lanekv.kernels.a") < floor_of("lanekv.decode.b")
    assert floor_of("lanekv.cli") == 7 and floor_of("lanekv.http.app") == 7
    assert floor_of("lanekv.transfer.connector.base") == 5 and floor_of("lanekv.transfer.rank.service") == 4


def test_no_package_folder_is_crowded():
    crowded = sorted(
        f"{folder.relative_to(ROOT)}: {count} modules"
        for package in PACKAGES
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]
        if folder.name != "__pycache__"
        and (count := sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")) > 12
    )
    assert not crowded, "package folders with more than about 12 modules:\n" + "\n".join(crowded)
