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
    "cri_shim.images",
    "cri_shim.inspection",
    "cri_shim.lifecycle",
    "cri_shim.streaming.on_demand",
    "cri_shim.state.records",
    "cri_shim.server",
)
ROOT = ("cri_shim.cli", "cri_shim.daemon", "cri_shim.composition")
# The CRI socket under the gRPC edge: bound, or passed by systemd and relayed.
TRANSPORT = "cri_shim.transport"
EDGES = ("cri_shim.server", TRANSPORT, "cri_shim.metrics")
# What the transport may import: bytes and sockets, and the configuration's errors.
TRANSPORT_MAY_IMPORT = (TRANSPORT, "cri_shim.config")
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
    "cri_shim.config",
    "cri_shim.pod_rules",
    "cri_shim.tracing",
)
# The modules every package may import: they import nothing of the daemon but each other.
LEAVES = (
    "cri_shim.errors",
    "cri_shim.faults",
    "cri_shim.logcontext",
    "cri_shim.logsetup",
    "cri_shim.loop_monitor",
)
PACKAGES = tuple(sorted({*ROOT, *EDGES, *DOMAIN, *BELOW_DOMAIN, "cri_shim.api"}))
# The persistence the edges never touch: the database, journal, ledger, repositories.
PERSISTENCE = tuple(
    f"cri_shim.state.{module}"
    for module in "db schema journal ledger objects sandboxes containers images".split()
)
# importer -> the modules and packages it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "cri_shim.inspection": (*ROOT, *EDGES, "cri_shim.lifecycle"),
    "cri_shim.lifecycle": (*ROOT, *EDGES, "cri_shim.inspection"),
    "cri_shim.metrics": (*ROOT, "cri_shim.server", "cri_shim.lifecycle", *PERSISTENCE),
    **{below: (*ROOT, *EDGES, *DOMAIN) for below in BELOW_DOMAIN},
    # The kernel's wrappers sit under every other package: they import none of them.
    "cri_shim.host": tuple(p for p in PACKAGES if p != "cri_shim.host"),
    **{leaf: PACKAGES for leaf in LEAVES},
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
# One concern a class in the runtime (how a container stops, how its exit is recorded):
# none grows past this.
MAX_RUNTIME_CLASS_LINES = 300


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


def test_the_transport_imports_only_the_configuration() -> None:
    assert imports_outside(TRANSPORT, TRANSPORT_MAY_IMPORT) == []


def test_only_the_root_imports_the_transport() -> None:
    importers = {
        importer
        for importer, module in imports_of("cri_shim")
        if within(module, TRANSPORT) and not within(importer, TRANSPORT)
    }
    assert importers <= set(ROOT)


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


# The generated gRPC client stubs: for clients of the CRI API (kubelet-like tests and
# benchmarks); the daemon registers its methods from the proto's descriptor instead.
FOR_CLIENTS = ("cri_shim.api.v1.api_pb2_grpc",)


def test_every_module_is_used_by_the_daemon_not_only_by_tests() -> None:
    used = set(entry_points()) | set(FOR_CLIENTS)
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


def long_classes(tree: ast.AST, limit: int) -> list[str]:
    """The classes in `tree` longer than `limit` lines, with their length."""
    return [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_each_runtime_class_holds_one_concern() -> None:
    big = [
        f"{name}.{found}"
        for name in modules()
        if within(name, "cri_shim.runtime")
        for found in long_classes(tree_of(name), MAX_RUNTIME_CLASS_LINES)
    ]
    assert big == []


def test_a_class_past_the_limit_is_found() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_RUNTIME_CLASS_LINES))
    source = f"class Short:\n    pass\n\n\nclass Backend:\n{body}"
    assert long_classes(ast.parse(source), MAX_RUNTIME_CLASS_LINES) == [
        f"Backend: {MAX_RUNTIME_CLASS_LINES + 1} lines"
    ]


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


# ---- what an import hides -------------------------------------------------------------


@cache
def tree_of(module: str) -> ast.Module:
    return ast.parse(modules()[module].read_text())


def top_level_imports(module: str) -> Iterator[ast.ImportFrom]:
    """The `from` imports at a module's top, those under `if TYPE_CHECKING:` included."""
    for node in tree_of(module).body:
        if isinstance(node, ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            yield from (n for n in node.body if isinstance(n, ast.ImportFrom))


def absolute(node: ast.ImportFrom, module: str) -> str:
    if not node.level:
        return node.module or ""
    package = module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def origin(module: str, name: str, seen: frozenset[str] = frozenset()) -> str:
    """The module that defines `name`, which `module` may only pass on (re-export)."""
    if module not in modules() or module in seen:
        return module
    for node in top_level_imports(module):
        source = absolute(node, module)
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if f"{source}.{alias.name}" in modules():
                return f"{source}.{alias.name}"  # a module itself
            return origin(source, alias.name, seen | {module})
    return module


def names_from(prefix: str) -> Iterator[tuple[str, str, str]]:
    """(importer, name, the module that defines it) for every `from … import name` of
    the modules under `prefix` from another module of the daemon."""
    for importer in sorted(modules()):
        if not within(importer, prefix):
            continue
        for node in ast.walk(tree_of(importer)):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = absolute(node, importer)
            if not within(source, "cri_shim") or source == "cri_shim":
                continue
            for alias in node.names:
                defined = origin(source, alias.name)
                if defined != source:
                    yield importer, alias.name, defined


# Figures of the host that inspection/host.py hands the edge: frozen dataclasses of the
# runtime's cgroup readers and of the network's interface counters, read-only data as
# state.records is, re-exported by the one host reader so that the edge never imports
# the runtime or the network. Any other name re-exported to the edge fails.
EDGE_MAY_RECEIVE = {
    ("cri_shim.runtime.cgroup_metrics", "CgroupFigures"),
    ("cri_shim.runtime.stats", "CgroupStats"),
    ("cri_shim.runtime.stats", "PressureStall"),
    ("cri_shim.runtime.stats", "LayerUsage"),
    ("cri_shim.network.netdev", "InterfaceCounters"),
    ("cri_shim.network.netdev", "NetnsCounters"),
}


def reexports_past(prefix: str, allowed: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    return [
        f"{importer} imports {name} of {defined} through a re-export"
        for importer, name, defined in names_from(prefix)
        if (not any(within(defined, ok) for ok in allowed))
        or any(within(defined, no) for no in banned)
    ]


def test_the_edge_is_handed_no_forbidden_name_through_a_re_export() -> None:
    wrong = [
        line
        for line in reexports_past("cri_shim.server", SERVER_MAY_IMPORT, ())
        if not any(f"imports {name} of {defined} " in line for defined, name in EDGE_MAY_RECEIVE)
    ]
    assert wrong == []


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_no_re_export_hides_what_sits_above_a_package(importer: str) -> None:
    assert reexports_past(importer, ("cri_shim",), FORBIDDEN[importer]) == []


def test_no_module_imports_by_name_at_run_time() -> None:
    """`importlib.import_module` and `__import__` hide an import from every rule here.
    Finding a module without importing it (`importlib.util.find_spec`) is allowed."""
    dynamic = []
    for name in sorted(modules()):
        if any(within(name, prefix) for prefix in GENERATED):
            continue
        for node in ast.walk(tree_of(name)):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called in ("__import__", "importlib.import_module", "import_module"):
                    dynamic.append(f"{name}:{node.lineno}: {called}")
            elif isinstance(node, ast.ImportFrom) and node.module == "importlib":
                if any(alias.name == "import_module" for alias in node.names):
                    dynamic.append(f"{name}:{node.lineno}: from importlib import import_module")
    assert dynamic == []


# ---- the edge reads no host file ------------------------------------------------------

# Calls that read the host's files (or ask the kernel about one): `open`, `os.stat` and
# its kin, and pathlib's readers.
HOST_READS = re.compile(
    r"^(open|io\.open|os\.(stat|lstat|listdir|scandir|open|access|readlink|path\.\w+))$"
    r"|\.(read_text|read_bytes|open|stat|lstat|exists|is_file|is_dir|is_socket|iterdir)$"
)
# What the edge still reads itself, each with its reason.
EDGE_HOST_READS = {
    # Its own socket: the directory's mode and a stale socket file (DESIGN §1).
    "cri_shim.transport.unix_socket",
    # A mount's host path must exist (INVALID_ARGUMENT naming the field, before the
    # name is reserved); validation runs synchronously in server/limits.py.
    "cri_shim.server.validation._mount",
}
# The domain's functions that read the host, which the edge may call only from a worker
# thread (`asyncio.to_thread(f, ...)`, where f is passed, not called). Known exception,
# out of this test's sight: a container's status (lifecycle/statuses.py, made once per
# record) reads process.user from its config.json for a row written before the row
# recorded it.
EDGE_MAY_CALL_ON_THE_LOOP: set[tuple[str, str]] = {
    # ContainerStatus verbose: the config.json the daemon wrote (on the loop too,
    # runtime/conmon_launch.py) in its own state root; a worker thread cost more than the read.
    ("cri_shim.server.container_status", "runtime_spec_of"),
}


def host_reads(module: str) -> Iterator[tuple[str, int, str]]:
    """(function, line, call) for each host read in `module`'s functions."""
    for node in ast.walk(tree_of(module)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and HOST_READS.search(ast.unparse(call.func)):
                    yield node.name, call.lineno, ast.unparse(call.func)


def test_the_edge_reads_no_host_file_itself() -> None:
    found = [
        f"{module}.{function}:{line}: {call}"
        for prefix in EDGES
        for module in sorted(modules())
        if within(module, prefix) and module not in EDGE_HOST_READS
        for function, line, call in host_reads(module)
        if f"{module}.{function}" not in EDGE_HOST_READS
    ]
    assert found == []


def domain_readers() -> set[tuple[str, str]]:
    """(module, function) of the domain's plain functions that read the host."""
    return {
        (module, function)
        for prefix in DOMAIN
        for module in modules()
        if within(module, prefix)
        for function, _, _ in host_reads(module)
    }


def test_the_edge_calls_no_domain_reader_on_the_event_loop() -> None:
    readers = domain_readers()
    wrong = []
    for module in sorted(modules()):
        if not any(within(module, prefix) for prefix in EDGES):
            continue
        imported = {
            (alias.asname or alias.name): absolute(node, module)
            for node in top_level_imports(module)
            for alias in node.names
        }
        for node in ast.walk(tree_of(module)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
                if (imported.get(name), name) in readers:
                    if (module, name) not in EDGE_MAY_CALL_ON_THE_LOOP:
                        wrong.append(f"{module}:{node.lineno}: {name}() on the event loop")
    assert wrong == []


# A runtime's names, as a branch on what the runtime is would spell them.
RUNTIME_NAME = re.compile(r"^(runc|crun|youki|runsc|gvisor|kata.*|containerd-shim-kata.*)$", re.I)
KINDS = "cri_shim.runtime.kinds"


def _runtime_names_in(node: ast.AST) -> bool:
    """A string constant naming a runtime, alone or in a literal set, tuple or list."""
    elements = node.elts if isinstance(node, ast.Set | ast.Tuple | ast.List) else [node]
    return any(
        isinstance(e, ast.Constant) and isinstance(e.value, str) and RUNTIME_NAME.match(e.value)
        for e in elements
    )


def _is_a_paths_name(node: ast.AST) -> bool:
    """`<...path>.name`: a file's name."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "name"
        and re.search(r"path\b", ast.unparse(node.value)) is not None
    )


def name_branches(tree: ast.AST, module: str) -> list[str]:
    """Comparisons that decide by what a runtime is called, or where it lives: against a
    runtime's name, on a runtime binary's file name (a path's name compared with
    anything that says runtime), or conmon's runtime against the
    runtime's path (a kind told by a wrapper script)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            text = ast.unparse(node)
            if (
                any(_runtime_names_in(side) for side in sides)
                or (
                    any(_is_a_paths_name(side) for side in sides)
                    and re.search("runtime", text, re.I) is not None
                )
                or ("conmon_runtime" in text and "runtime_path" in text)
            ):
                found.append(f"{module}:{node.lineno}: {text}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and any(_runtime_names_in(arg) for arg in node.args)
        ):
            found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_the_kinds_branches_on_a_runtimes_name_or_path() -> None:
    """What differs with the runtime is its handler kind's (runtime/kinds/): a branch on
    a runtime's name elsewhere is a kind that a new runtime would not get."""
    wrong = []
    for module in sorted(modules()):
        if within(module, KINDS) or any(within(module, g) for g in GENERATED):
            continue
        wrong += name_branches(tree_of(module), module)
    assert wrong == []


@pytest.mark.parametrize(
    "branch",
    [
        'if backend.runtime_path.name == "runsc":\n    pass',
        'if handler_features(backend.runtime_path).kind == "gvisor":\n    pass',
        "if self.conmon_runtime != self.runtime_path:\n    pass",
        "gvisor = self.conmon_runtime != self.runtime_path",
        "sandboxed = self.path.name in SANDBOXED_RUNTIMES",
        'kata = path.name in {"kata-runtime", "containerd-shim-kata-v2"}',
        'gvisor = result.stdout.startswith("runsc")',
    ],
)
def test_the_name_branch_finder_finds_one(branch: str) -> None:
    """As it would be caught in lifecycle/pause.py."""
    assert name_branches(ast.parse(branch), "cri_shim.lifecycle.pause") != []


def test_the_name_branch_finder_lets_other_comparisons_be() -> None:
    code = (
        'if mode == "runtime" or handler.name == default or kind.pod_sandbox:\n    pass\n'
        'if path.name in ("", ".", ".."):\n    pass'
    )
    assert name_branches(ast.parse(code), "cri_shim.lifecycle.pause") == []


# ---- each RPC is found by its name --------------------------------------------------------


def rpc_module(rpc: str) -> str:
    """`RunPodSandbox` → `cri_shim.server.run_pod_sandbox`: where an RPC is served."""
    return "cri_shim.server." + re.sub(r"(?<!^)(?=[A-Z])", "_", rpc).lower()


def test_an_rpc_module_is_the_rpc_name_in_snake_case() -> None:
    assert rpc_module("RunPodSandbox") == "cri_shim.server.run_pod_sandbox"
    assert rpc_module("Exec") == "cri_shim.server.exec"
    assert rpc_module("ListPodSandboxStats") == "cri_shim.server.list_pod_sandbox_stats"
    assert rpc_module("ImageFsInfo") == "cri_shim.server.image_fs_info"


def test_each_rpc_is_served_from_the_module_named_after_it() -> None:
    """Every RPC of the CRI (the generated API's two services) has a module named after
    it under server/, and the services' table routes the RPC to that module's handler:
    a reader finds CreateContainer's code in server/create_container.py."""
    from cri_shim.api.v1 import api_pb2
    from cri_shim.server import services

    wrong = []
    for cls in (services.RuntimeService, services.ImageService):
        methods = api_pb2.DESCRIPTOR.services_by_name[cls.__name__].methods_by_name
        for name in methods:
            if name in services.PENDING:
                continue  # answered UNIMPLEMENTED, no handler yet
            module = rpc_module(name)
            handler = getattr(getattr(cls, name), "__wrapped__", None)
            if module not in modules():
                wrong.append(f"{name}: no module {module}")
            elif getattr(handler, "__module__", None) != module:
                wrong.append(f"{name}: served from {getattr(handler, '__module__', None)}")
    assert wrong == []
