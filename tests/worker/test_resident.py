"""The one LRU of what a worker holds (worker/resident.py): the order of use, eviction at capacity, each
evicted called back; and Models' two caches on it (worker/models.py), with stand-in pipelines."""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from shared.store.claims import Holding
from worker.device_time import DeviceTime
from worker.resident import Resident


def held(capacity: int, *keys: str) -> tuple[Resident[str, str], list[tuple[str, str]]]:
    """A cache holding these keys (the first the least recently used), and what it evicts."""
    evicted: list[tuple[str, str]] = []
    cache: Resident[str, str] = Resident(capacity, lambda key, value: evicted.append((key, value)))
    for key in keys:
        cache.put(key, key.upper())
    return cache, evicted


def test_use_orders_the_keys_the_least_recently_used_first() -> None:
    cache, evicted = held(3, "a", "b", "c")
    assert cache.get("a") == "A" and cache.get("ghost") is None
    cache.touch("b")
    assert list(cache) == ["c", "a", "b"] and list(reversed(cache)) == ["b", "a", "c"]
    assert len(cache) == 3 and "a" in cache and "ghost" not in cache and evicted == []
    with pytest.raises(KeyError):
        cache.touch("ghost")


def test_a_put_beyond_capacity_evicts_the_least_recently_used_and_calls_back() -> None:
    cache, evicted = held(2, "a", "b")
    cache.get("a")
    assert cache.put("c", "C") == ["b"]
    assert evicted == [("b", "B")] and list(cache) == ["a", "c"]
    assert cache.put("c", "C2") == [] and cache.get("c") == "C2"  # a key put again: no eviction
    assert len(cache) == cache.capacity == 2


def test_room_is_made_before_a_load_and_kept_keys_stay() -> None:
    cache, evicted = held(2, "a", "b")
    assert cache.make_room(keep={"a"}) == ["b"] and evicted == [("b", "B")]
    assert cache.make_room() == [] and list(cache) == ["a"]  # one more fits already
    cache.put("b", "B")
    assert cache.make_room(keep={"a", "b"}) == [] and list(cache) == ["a", "b"]  # none to evict
    assert cache.put("c", "C", keep={"a", "b"}) == [] and list(cache) == ["a", "b", "c"]
    assert cache.put("d", "D") == ["a", "b"] and list(cache) == ["c", "d"]


def test_a_put_never_evicts_its_own_key_and_a_pop_calls_nothing_back() -> None:
    cache, evicted = held(0, "a")
    assert list(cache) == ["a"] and evicted == []  # at capacity 0 the one put stays until the next
    assert cache.make_room() == ["a"] and evicted == [("a", "A")]
    cache.put("b", "B")
    assert cache.pop("b") == "B" and cache.pop("b", "none") == "none" and len(cache) == 0
    assert evicted == [("a", "A")]


# --- Models: a count on the device, and host memory's where it has room --------------------------------

class Pipeline:
    """A stand-in for worker.pipeline.ImagePipeline: where it is, and nothing else."""

    def __init__(self, name: str) -> None:
        self.name, self.device, self.place = name, torch.device("cuda"), "device"
        self.pipe, self.memory, self.threads, self.device_time = self, None, 1, DeviceTime()
        self.holding = ("", ())


@pytest.fixture
def models(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Models of a GPU worker serving a, b and c, one on the device and two in host memory, with
    stand-ins for loading and moving."""
    from worker import memory
    from worker import models as module

    loaded: list[str] = []

    def load(settings: object, model: str, threads: int) -> Pipeline:
        loaded.append(model)
        return Pipeline(model)

    monkeypatch.setattr(module, "load_pipeline", load)
    monkeypatch.setattr(module, "set_current_pipeline", lambda pipeline: None)
    monkeypatch.setattr(module, "available_memory", lambda: 2**40)
    monkeypatch.setattr(module, "weight_bytes", lambda pipeline: 1)
    monkeypatch.setattr(memory, "unplace", lambda pipe, options: setattr(pipe, "place", "host"))
    monkeypatch.setattr(memory, "place", lambda pipe, device, options: setattr(pipe, "place", "device"))
    settings = SimpleNamespace(served_models=["a", "b", "c"], model_cache=1, host_model_cache=2)
    held = module.Models(cast(Any, settings), cast(Any, Pipeline("a")))
    held.loaded = loaded
    return held


def test_a_model_pushed_off_the_device_waits_in_host_memory(models: Any) -> None:
    assert [models.use(name).source for name in ("a", "b", "c")] == ["device", "disk", "disk"]
    assert list(models.on_device) == ["c"] and list(models.in_host) == ["a", "b"]
    assert [models.in_host.get(name).place for name in ("a", "b")] == ["host", "host"]
    assert models.loaded == ["b", "c"] and models.holding.on_device == ("c",)


def test_the_model_coming_back_from_a_full_host_cache_is_not_the_one_dropped(models: Any) -> None:
    for name in ("a", "b", "c"):
        models.use(name)
    # a is host memory's least recently used, and c pushed there makes one too many: a is taken out of
    # host memory's cache before c comes in, so it is not the one dropped.
    switch = models.use("a")
    assert (switch.source, models.current.name, models.current.place) == ("host", "a", "device")
    assert list(models.on_device) == ["a"] and list(models.in_host) == ["b", "c"]
    assert models.loaded == ["b", "c"]  # a came back from host memory, not from disk


def test_letting_go_of_the_device_moves_its_pipelines_to_host_memory_until_a_job_brings_one_back(
        models: Any) -> None:
    models.use("b")
    assert models.release() and models.current is None
    assert models.holding == Holding()  # the next claim prefers nothing
    assert list(models.on_device) == [] and list(models.in_host) == ["a", "b"]
    assert {place.model: place.place for place in models.places} == {
        "a": "in_host", "b": "in_host", "c": "released"}
    assert not models.release()  # nothing is on the device
    switch = models.use("b")
    assert (switch.source, models.current.name, models.current.place) == ("host", "b", "device")
    assert {place.model: place.place for place in models.places}["b"] == "on_device"
    assert models.loaded == ["b"]


def test_a_cpu_worker_letting_go_drops_its_pipelines_and_frees_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import models as module

    monkeypatch.setattr(module, "set_current_pipeline", lambda pipeline: None)
    monkeypatch.setattr(module, "load_pipeline", lambda settings, model, threads: Pipeline(model))
    first = Pipeline("a")
    first.device = torch.device("cpu")
    settings = SimpleNamespace(served_models=["a", "b"], model_cache=1, host_model_cache=2)
    held = module.Models(cast(Any, settings), cast(Any, first))
    gone = weakref.ref(first)
    del first
    held.release()
    assert gone() is None  # nothing holds it: its memory is the system's again
    assert [place.place for place in held.places] == ["released", "released"]
    assert held.use("a").source == "disk"
