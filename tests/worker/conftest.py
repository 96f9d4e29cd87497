"""Fixtures shared by the worker's modules: a model cache of a module's own, the tiny models in turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.contract.models import TINY_IMAGE_MODELS, Family


@pytest.fixture(scope="module")
def cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache of the module's own: what it builds (tiny models, their adapters) is built
    once for the module, beside nothing another module wrote."""
    return tmp_path_factory.mktemp(f"{request.path.stem}-models")


@pytest.fixture(scope="module", params=list(TINY_IMAGE_MODELS))
def model(request: pytest.FixtureRequest) -> str:
    """Each tiny image model in turn (a module may narrow the list with a ``model`` of its own)."""
    return request.param


@pytest.fixture(scope="module")
def family(model: str) -> Family:
    return TINY_IMAGE_MODELS[model]
