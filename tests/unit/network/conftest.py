"""Fixtures of the network unit tests: a fake CNI setup in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_cni import FakeCni


@pytest.fixture
def fake_cni(tmp_path: Path) -> FakeCni:
    return FakeCni(tmp_path)
