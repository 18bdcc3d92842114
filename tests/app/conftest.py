"""Fixtures for tests/app; the helpers themselves live in apphelpers.py."""

from __future__ import annotations

import os
import sys

# --import-mode=importlib does not put test directories on sys.path; the helpers module is
# shared by every test module here.
sys.path.insert(0, os.path.dirname(__file__))

from apphelpers import client, sim_server  # noqa: F401  (fixtures)
