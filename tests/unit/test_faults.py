"""The fault points: each one the code reaches is declared, and the crash tests kill the
daemon at each one declared. A new creation step, or a new undo action in the journal,
fails here until it is in the crash matrix (tests/scenarios/test_crash_restart.py)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import cri_shim
from cri_shim import faults
from cri_shim.composition import build_graph
from cri_shim.config import config_from_dict

PACKAGE = Path(cri_shim.__file__).parent


def fault_point_calls() -> Iterator[tuple[str, ast.Call]]:
    """Every call of `fault_point` in the daemon's code, with the module it is in."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name == "fault_point":
                yield str(path.relative_to(PACKAGE.parent)), node


def test_every_named_point_in_the_code_is_declared() -> None:
    named: set[str] = set()
    for module, call in fault_point_calls():
        (argument,) = call.args
        where = f"{module}:{call.lineno}"
        if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
            assert argument.value in faults.ALL, f"{where}: {argument.value!r} is not in faults"
            named.add(argument.value)
        else:
            # The journal's points, one per undo action (the next test); any other point
            # must be named by a literal, so that it can be checked here.
            assert (
                isinstance(argument, ast.Call)
                and isinstance(argument.func, ast.Name)
                and argument.func.id == "undo_point"
            ), f"{where}: a fault point not named by a string: {ast.unparse(argument)}"
    declared = set(faults.ALL) - set(faults.TEARDOWN)
    assert named == declared, f"declared but reached nowhere: {declared - named}"


def test_every_undo_action_of_the_journal_is_a_declared_point(tmp_path: Path) -> None:
    # The actions are registered by the components that own them, as the daemon builds
    # them: building the graph is how the code tells which there are.
    config = config_from_dict({"root": str(tmp_path / "root"), "run_root": str(tmp_path / "run")})
    graph = build_graph(config)
    try:
        actions = graph.journal.actions()
    finally:
        graph.db.close()
    assert actions, "no undo action registered"
    assert {faults.undo_point(action) for action in actions} == set(faults.TEARDOWN)


def crash_matrix() -> set[str]:
    """Every fault point a test of the crash tests kills the daemon at."""
    from tests.scenarios import test_crash_restart

    killed: set[str] = set()
    for name in dir(test_crash_restart):
        test = getattr(test_crash_restart, name)
        if not name.startswith("test_") or not callable(test):
            continue
        for mark in getattr(test, "pytestmark", []):
            if mark.name == "parametrize" and mark.args[0] == "fault":
                killed.update(mark.args[1])
    return killed


def test_the_crash_tests_kill_the_daemon_at_every_declared_point() -> None:
    missing = sorted(set(faults.ALL) - crash_matrix())
    assert not missing, f"no crash test kills the daemon at {missing}"


def test_points_are_declared_once() -> None:
    assert len(faults.ALL) == len(set(faults.ALL))
