"""Fixtures shared by the worker's modules: a model cache of a module's own, the tiny models in turn,
no network while a module loads its models."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def _no_network(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a model must load without the network")


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    """Any connection attempt fails the module's tests: loading is offline."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", _no_network)
        patch.setattr(socket, "getaddrinfo", _no_network)
        yield
