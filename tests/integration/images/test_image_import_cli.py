"""`cri-shim images import`: the command, in-process and as its own process beside a
reader that holds the state database open as the daemon does."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cri_shim.images.importer import main_import
from cri_shim.images.store import ImageStore
from cri_shim.state.db import Database
from tests.imagebuild import build_docker_archive, build_image, build_oci_archive

pytestmark = [pytest.mark.integration, pytest.mark.root]

REPO_ROOT = Path(__file__).resolve().parents[3]


def write_config(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "state"
    config = tmp_path / "config.toml"
    config.write_text(f'root = "{root}"\nrun_root = "{tmp_path / "run"}"\n')
    return config, root


def test_main_import_prints_id_and_tags(
    tmp_path: Path, busybox_layout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, root = write_config(tmp_path)
    assert main_import(["--config", str(config), str(busybox_layout)]) == 0
    image_id = build_image().image_id
    assert capsys.readouterr().out == f"{image_id} docker.io/library/busybox:latest\n"

    archive = build_docker_archive(tmp_path / "d.tar", None, user="1000")
    assert main_import(["--config", str(config), str(archive), "--name", "app:v1"]) == 0
    out = capsys.readouterr().out.split()
    assert out[1] == "docker.io/library/app:v1"

    db = Database(root / "state.db")
    try:
        store = ImageStore(root, db)
        assert store.resolve("busybox").id == image_id
        assert store.resolve("app:v1").user == "1000"
    finally:
        db.close()


def test_main_import_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = write_config(tmp_path)
    assert main_import(["--config", str(config), str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main_import(["--config", str(tmp_path / "nope.toml"), str(tmp_path)]) == 2
    assert "nope.toml" in capsys.readouterr().err
    (tmp_path / "untagged").mkdir()
    assert main_import(["--config", str(config), str(tmp_path / "untagged"), "--name", "BAD"]) == 1
    assert "lowercase" in capsys.readouterr().err


def test_import_process_beside_a_reading_daemon(tmp_path: Path) -> None:
    """The daemon keeps its connection open and reads the images table on every request;
    an import in another process must neither block it nor be blocked, and the image must
    show up to the open connection without a restart."""
    config, root = write_config(tmp_path)
    archive = build_oci_archive(tmp_path / "image.tar", tag="cli")
    daemon_db = Database(root / "state.db")
    daemon_store = ImageStore(root, daemon_db)
    stop = threading.Event()
    reads: list[float] = []
    errors: list[BaseException] = []

    def daemon_reads() -> None:
        try:
            while not stop.is_set():
                started = time.monotonic()
                daemon_store.list()
                reads.append(time.monotonic() - started)
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=daemon_reads)
    reader.start()
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "cri_shim.images.importer",
                "--config",
                str(config),
                str(archive),
                "--name",
                "localhost/cli-test",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
    finally:
        stop.set()
        reader.join()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1:] == ["localhost/cli-test:cli"]
    assert errors == []
    assert reads and max(reads) < 5.0
    image = daemon_store.resolve("localhost/cli-test:cli")
    assert image.id == build_image().image_id
    assert len(daemon_store.lower_dirs(image)) == 2
    daemon_db.close()
