"""The configuration reference is generated from the code and cannot drift from it.

A key added to the dataclasses without an entry in KEY_DOCS, a doc entry for a key that
is gone, a generated file not regenerated, or a key the loader does not accept: each
fails here with the command that fixes it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from cri_shim.cli import main
from cri_shim.config import Config, config_from_dict
from cri_shim.config.reference import (
    KEY_DOCS,
    config_keys,
    config_reference_markdown,
    config_reference_toml,
    config_to_toml,
)

REPO = Path(__file__).resolve().parents[2]
REGENERATE = (
    "regenerate with: .venv/bin/cri-shim config --reference > docs/configuration.md && "
    ".venv/bin/cri-shim config --reference --toml > contrib/config.toml"
)


def test_every_key_is_documented_and_every_doc_names_a_key() -> None:
    paths = {key.path for key in config_keys()}
    undocumented = sorted(paths - KEY_DOCS.keys())
    assert not undocumented, f"add these keys to cri_shim.config.reference.KEY_DOCS: {undocumented}"
    stale = sorted(KEY_DOCS.keys() - paths)
    assert not stale, f"KEY_DOCS documents keys that do not exist: {stale}"


def test_the_walk_finds_nested_and_per_name_keys() -> None:
    paths = [key.path for key in config_keys()]
    for expected in (
        "listen",
        "network.setup_timeout",
        "runtime.handlers.NAME.path",
        "images.mirrors",
        "metrics.listen",
        "log_format",
    ):
        assert expected in paths
    # TOML needs a table's own keys before its sub-tables.
    assert paths.index("runtime.stop_timeout_grace") < paths.index("runtime.handlers.NAME.path")


def test_docs_configuration_md_is_up_to_date() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    assert text == config_reference_markdown(), f"docs/configuration.md is stale; {REGENERATE}"


def test_contrib_config_toml_is_up_to_date() -> None:
    text = (REPO / "contrib" / "config.toml").read_text()
    assert text == config_reference_toml(), f"contrib/config.toml is stale; {REGENERATE}"


def test_the_reference_shows_defaults_and_types() -> None:
    table = config_reference_markdown()
    assert '| `[network] setup_timeout` | duration | `"5m"` |' in table
    assert "| `[creation] keep_on_timeout` | boolean | `true` |" in table
    assert "| `[creation] hand_off` | boolean | `true` |" in table
    assert '| `[network] bin_dirs` | list of paths | `["/usr/lib/cni", "/opt/cni/bin"]` |' in table
    assert "| `[runtime.handlers.NAME] root` | path | `<run_root>/runtime/NAME` |" in table
    assert "**undocumented**" not in table


def test_uncommenting_the_default_config_changes_nothing() -> None:
    """Every commented value in contrib/config.toml is accepted and is the default."""
    text = config_reference_toml()
    uncommented = re.sub(r"(?m)^#(?=[a-z_\"]+ = )", "", text)
    assert uncommented != text
    data = tomllib.loads(uncommented)
    cfg = config_from_dict(data)
    assert config_to_toml(cfg) == config_to_toml(Config())


@pytest.mark.parametrize(
    "key", [k for k in config_keys() if k.default is not None], ids=lambda k: k.path
)
def test_the_loader_accepts_every_key(key) -> None:  # type: ignore[no-untyped-def]
    """A field in the dataclasses that the loader rejects as unknown is caught here."""
    document = f"[{key.example_section}]\n" if key.example_section else ""
    document += f"{key.name} = {key.default}\n"
    config_from_dict(tomllib.loads(document))


def test_cli_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out == config_reference_markdown()
    assert main(["config", "--reference", "--toml"]) == 0
    assert capsys.readouterr().out == config_reference_toml()


def test_readme_points_at_the_generated_reference_not_a_copy() -> None:
    readme = (REPO / "README.md").read_text()
    assert "docs/configuration.md" in readme
    # A hand-written table in the README is what drifted before; there is one reference.
    assert "| `[network] setup_timeout`" not in readme
