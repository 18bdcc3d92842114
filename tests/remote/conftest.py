"""Fixtures for tests/remote; the helpers live in remotehelpers.py."""

from __future__ import annotations

import os
import sys

# --import-mode=importlib does not put test directories on sys.path.
sys.path.insert(0, os.path.dirname(__file__))
