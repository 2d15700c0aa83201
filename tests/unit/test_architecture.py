"""The rules of docs/architecture.md, read from the code with `ast`: a package that imports
what the rules forbid fails here, as does an import circle, a module that nothing in the
daemon uses (only its tests), and a function too long to read at once at the edge."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "cri_shim"
# Programs outside the package that import it: conmon-stub writes its log with crilog.
OTHER_IMPORTERS = (REPO / "conmon-stub" / "conmon-stub",)

# What the gRPC edge may import: the domain it translates to, and nothing that holds
# state or touches the host (the state package's plain record dataclasses excepted).
SERVER_MAY_IMPORT = (
    "cri_shim.api",
    "cri_shim.config",
    "cri_shim.errors",
    "cri_shim.logcontext",
    "cri_shim.tracing",
    "cri_shim.pod_rules",
    "cri_shim.cpusets",
    "cri_shim.images",
    "cri_shim.inspection",
    "cri_shim.lifecycle",
    "cri_shim.streaming.on_demand",
    "cri_shim.state.records",
    "cri_shim.server",
)
ROOT = ("cri_shim.cli", "cri_shim.daemon", "cri_shim.composition")
EDGES = ("cri_shim.server", "cri_shim.metrics")
DOMAIN = ("cri_shim.lifecycle", "cri_shim.inspection")
# The packages below the domain: each wraps one part of the host or of the state.
BELOW_DOMAIN = (
    "cri_shim.creation",
    "cri_shim.state",
    "cri_shim.host",
    "cri_shim.network",
    "cri_shim.runtime",
    "cri_shim.images",
    "cri_shim.nri",
    "cri_shim.streaming",
    "cri_shim.logs",
    "cri_shim.config",
    "cri_shim.pod_rules",
    "cri_shim.tracing",
)
# importer -> the modules and packages it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "cri_shim.inspection": (*ROOT, *EDGES, "cri_shim.lifecycle"),
    "cri_shim.lifecycle": (*ROOT, *EDGES, "cri_shim.inspection"),
    "cri_shim.metrics": (*ROOT, "cri_shim.server", "cri_shim.lifecycle"),
    **{below: (*ROOT, *EDGES, *DOMAIN) for below in BELOW_DOMAIN},
}
# The idempotency core does no I/O: it imports nothing of the daemon but its errors, the
# log context and the tracing context (whose exporter the composition root loads).
CREATION_MAY_IMPORT = (
    "cri_shim.creation",
    "cri_shim.errors",
    "cri_shim.logcontext",
    "cri_shim.tracing",
)
# No function longer than this anywhere but in the generated protobuf modules.
MAX_FUNCTION_LINES = 80
GENERATED = ("cri_shim.api", "cri_shim.nri.api")
# One operation a module in the lifecycle: none grows past this.
MAX_LIFECYCLE_MODULE_LINES = 450


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@cache
def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_in(tree: ast.AST, package: str) -> set[str]:
    """Every module `tree` imports: at the top, under TYPE_CHECKING and inside functions
    alike (a rule holds for the design, not only for what runs first). `from a import b`
    counts a.b when b is a module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            named = {f"{module}.{alias.name}" for alias in node.names}
            found.update(named & modules().keys())
            if not named <= modules().keys():  # a name defined in the module itself
                found.add(module)
    return {m for m in found if within(m, "cri_shim")}


@cache
def import_graph() -> dict[str, frozenset[str]]:
    graph = {}
    for name, path in modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = frozenset(imports_in(ast.parse(path.read_text()), package))
    return graph


def imports_of(prefix: str) -> Iterator[tuple[str, str]]:
    """What the modules under `prefix` import; the package itself (its version) aside."""
    for importer, imported in import_graph().items():
        if within(importer, prefix):
            for module in sorted(imported - {"cri_shim"}):
                yield importer, module


def imports_outside(prefix: str, allowed: tuple[str, ...]) -> list[str]:
    return [
        f"{importer} imports {module}"
        for importer, module in imports_of(prefix)
        if not any(within(module, ok) for ok in allowed)
    ]


def test_the_edge_imports_only_the_domain_and_plain_records() -> None:
    assert imports_outside("cri_shim.server", SERVER_MAY_IMPORT) == []


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_no_package_imports_what_sits_above_it(importer: str) -> None:
    wrong = [
        f"{source} imports {module}"
        for source, module in imports_of(importer)
        if any(within(module, banned) for banned in FORBIDDEN[importer])
    ]
    assert wrong == []


def test_the_creation_core_imports_nothing_that_does_io() -> None:
    assert imports_outside("cri_shim.creation", CREATION_MAY_IMPORT) == []


def circles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.get(module, ()):
            if other not in graph:
                continue
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_one() -> None:
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset()}
    assert circles(graph) == [["a", "b", "c"]]


def entry_points() -> set[str]:
    """Modules started from outside: the console scripts of pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {target.partition(":")[0] for target in project.get("scripts", {}).values()}


def test_every_module_is_used_by_the_daemon_not_only_by_tests() -> None:
    used = set(entry_points())
    for imported in import_graph().values():
        used.update(imported)
    for program in OTHER_IMPORTERS:
        used.update(imports_in(ast.parse(program.read_text()), ""))
    for module in list(used):  # importing a.b.c imports the packages a.b and a
        parts = module.split(".")
        used.update(".".join(parts[:end]) for end in range(1, len(parts)))
    assert sorted(set(modules()) - used) == []


def test_no_function_is_longer_than_a_screen() -> None:
    long = []
    for name, path in modules().items():
        if any(within(name, prefix) for prefix in GENERATED):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []


def test_each_lifecycle_module_holds_one_operation() -> None:
    big = [
        f"{name}: {len(path.read_text().splitlines())} lines"
        for name, path in modules().items()
        if within(name, "cri_shim.lifecycle")
        and len(path.read_text().splitlines()) > MAX_LIFECYCLE_MODULE_LINES
    ]
    assert big == []


# A comment says why; an issue number sends the reader elsewhere to find out.
ISSUE_CITATION = re.compile(r"\bissues? ?#?[0-9]+", re.IGNORECASE)


def test_no_comment_or_docstring_cites_an_issue() -> None:
    cited = []
    for folder in ("cri_shim", "tests", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in ("", ".py", ".sh") or not path.is_file():
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if ISSUE_CITATION.search(line):
                    cited.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert cited == []
