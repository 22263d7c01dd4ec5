"""Fixtures shared by the speculation tests of this folder."""

from __future__ import annotations

import pytest

from tests.conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """The target, itself as a draft (many accepts), and an unrelated random draft."""
    d = tmp_path_factory.mktemp("pair")
    target = make_tiny_checkpoint(d / "target", seed=0)
    return {
        "target": target,
        "copy": target,
        "random": make_tiny_checkpoint(d / "draft", seed=1, num_layers=1),
    }
