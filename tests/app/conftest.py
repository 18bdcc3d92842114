"""Fixtures for tests/app; the helpers themselves live in apphelpers.py."""

from __future__ import annotations

import os
import sys

import pytest

from tributary.engine import EngineConfig

# --import-mode=importlib does not put test directories on sys.path; the helpers module is
# shared by every test module here.
sys.path.insert(0, os.path.dirname(__file__))

from apphelpers import client, sim_config, sim_server  # noqa: F401  (fixtures)


@pytest.fixture
def tributary_engine_config() -> EngineConfig:
    """The plugin's engines, here on the fast sim model (apphelpers.FAST)."""
    return sim_config()
