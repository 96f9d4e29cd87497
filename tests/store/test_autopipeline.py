"""shared/store/autopipeline.py: concurrent script calls share round trips, each keeps its own answer."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from flask.testing import FlaskClient
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

from shared.contract.settings import Settings
from shared.store import autopipeline
from shared.store.autopipeline import AutoPipeline
from tests.conftest import RedisServer, post_job, wait_for, waiting_ids

CALLERS = 10

EMPTY = [0, 0, 0, 0]  # counts.lua on an empty line: each class's count, then 0: not paused


@pytest.fixture
def clients() -> Iterator[Callable[..., Redis]]:
    """``clients(url, **options)``: clients of the test's own, closed afterwards (one left to the
    collector may leave its socket open, which the suite counts as an error)."""
    made: list[Redis] = []

    def client(url: str, **options: Any) -> Redis:
        made.append(Redis.from_url(url, **options))
        return made[-1]

    yield client
    for each in made:
        each.close()


def evalsha_calls(redis: Redis) -> int:
    return int(redis.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@contextmanager
def redis_paused(redis: Redis) -> Iterator[None]:
    """Redis holds every script call until the block ends (CLIENT PAUSE WRITE: reads and CLIENT go on)."""
    redis.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")  # scripts may write: held too
    try:
        yield
    finally:
        redis.execute_command("CLIENT", "UNPAUSE")


def in_threads(calls: list[Callable[[], Any]]) -> tuple[list[threading.Thread], dict[int, Any]]:
    """Start each call on a thread of its own; their answers (or errors) by index, once joined."""
    answers: dict[int, Any] = {}

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            answers[index] = call()
        except Exception as exc:  # the test asserts on it
            answers[index] = exc

    threads = [threading.Thread(target=run, args=(index, call)) for index, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    return threads, answers


def gathered(pipeline: AutoPipeline, count: int) -> Callable[[], bool]:
    return lambda: len(pipeline._gathered) == count


def test_calls_made_while_a_round_trip_is_out_go_together_in_the_next(private_redis: RedisServer,
                                                                      clients: Callable[..., Redis]) -> None:
    # A Redis of this test's own: its script calls are counted server-wide, and the session's Redis
    # also serves the workers other tests leave running (a heartbeat's script once spoiled the count).
    redis = clients(private_redis.url)
    pipeline, line = AutoPipeline(clients(private_redis.url)), "autopipe"
    assert pipeline.run("counts", [], [line]) == EMPTY  # alone; and the script is loaded
    before = evalsha_calls(redis)
    with redis_paused(redis):
        # The first call goes out at once and waits on the paused Redis; the others gather behind it.
        threads, answers = in_threads([lambda: pipeline.run("counts", [], [line])])
        wait_for(lambda: pipeline.round_trips == 2, what="the first call's round trip")
        more, more_answers = in_threads([lambda: pipeline.run("counts", [], [line])] * CALLERS)
        wait_for(gathered(pipeline, CALLERS), what="the other calls gathered")
    for thread in threads + more:
        thread.join(30)
    assert answers == {0: EMPTY} and more_answers == dict.fromkeys(range(CALLERS), EMPTY)
    assert pipeline.round_trips == 3  # the first alone, then the ten in one
    # Still one EVALSHA a call: Redis runs each script on its own, atomically.
    assert evalsha_calls(redis) - before == 1 + CALLERS


def test_admissions_made_at_once_share_round_trips_and_keep_the_cap_exact(
        settings: Settings, redis: Redis, client: FlaskClient) -> None:
    # The API admits through the auto-pipeline: six submits made while the first one's round trip
    # is out go to Redis together, and the line's cap (5) still holds exactly.
    pipeline = autopipeline.of(client.application.extensions["slotq.queue"].connection)
    assert post_job(client, prompt="loads the script").status_code == 202
    trips = pipeline.round_trips
    with redis_paused(redis):
        threads, first = in_threads([lambda: post_job(client).status_code])
        wait_for(lambda: pipeline.round_trips == trips + 1, what="the first submit's round trip")
        more, answers = in_threads([lambda: post_job(client).status_code] * 6)
        wait_for(gathered(pipeline, 6), what="six submits gathered")
    for thread in threads + more:
        thread.join(30)
    assert first == {0: 202}
    assert sorted(answers.values()) == [202, 202, 202, 429, 429, 429] and pipeline.round_trips == trips + 2
    assert len(waiting_ids(redis, settings)) == settings.queue_capacity == 5


def test_a_call_s_error_is_its_own(redis: Redis, clients: Callable[..., Redis]) -> None:
    pipeline = AutoPipeline(clients(_url(redis)))
    with redis_paused(redis):
        threads, first = in_threads([lambda: pipeline.run("counts", [], ["autopipe"])])
        wait_for(lambda: pipeline.round_trips == 1, what="the first call's round trip")
        # The middle call names no line: its script fails; the calls beside it do not.
        calls = [lambda: pipeline.run("counts", [], ["autopipe"]), lambda: pipeline.run("counts", [], []),
                 lambda: pipeline.run("counts", [], ["autopipe"])]
        more, answers = in_threads(calls)
        wait_for(gathered(pipeline, 3), what="three calls gathered")
    for thread in threads + more:
        thread.join(30)
    assert first == {0: EMPTY}
    assert answers[0] == answers[2] == EMPTY
    assert isinstance(answers[1], ResponseError)
    assert pipeline.round_trips == 2


@pytest.mark.parametrize("callers", [1, 4])
def test_scripts_flushed_from_redis_are_loaded_again(redis: Redis, callers: int,
                                                     clients: Callable[..., Redis]) -> None:
    pipeline = AutoPipeline(clients(_url(redis)))
    assert pipeline.run("counts", [], ["autopipe"]) == EMPTY
    redis.script_flush()
    threads, answers = in_threads([lambda: pipeline.run("counts", [], ["autopipe"])] * callers)
    for thread in threads:
        thread.join(30)
    assert answers == dict.fromkeys(range(callers), EMPTY)


def test_a_connection_error_reaches_every_call_of_its_round_trip() -> None:
    # Nothing listens on port 1: the round trip fails, and each caller hears of it (then a 503).
    from redis.exceptions import ConnectionError as RedisConnectionError

    pipeline = AutoPipeline(Redis(port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)))
    threads, answers = in_threads([lambda: pipeline.run("counts", [], ["autopipe"])] * 3)
    for thread in threads:
        thread.join(30)
    assert all(isinstance(answer, RedisConnectionError) for answer in answers.values()), answers
    assert pipeline._out is False  # nobody is left holding the lead


@pytest.mark.parametrize("retries", [0, 1])
def test_a_round_trip_cut_off_is_sent_again_as_the_client_s_retry_says(
        redis: Redis, retries: int, clients: Callable[..., Redis]) -> None:
    # The connection dies while the call is out (a Redis restart, a failover): with a retry the call
    # reconnects and goes again, as redis-py's own commands do; without one the caller hears of it.
    from redis.exceptions import ConnectionError as RedisConnectionError

    client = clients(_url(redis), retry=Retry(NoBackoff(), retries))
    pipeline = AutoPipeline(client)
    assert pipeline.run("counts", [], ["autopipe"]) == EMPTY
    first = client.client_id()  # the pool's one connection: the next call's
    with redis_paused(redis):
        threads, answers = in_threads([lambda: pipeline.run("counts", [], ["autopipe"])])
        wait_for(lambda: any(entry["id"] == str(first) and entry["cmd"] == "evalsha"
                             for entry in redis.client_list()), what="the call held by the paused Redis")
        assert redis.client_kill_filter(_id=str(first)) == 1
    threads[0].join(30)
    if retries:
        assert answers == {0: EMPTY} and client.client_id() != first
    else:
        assert isinstance(answers[0], RedisConnectionError), answers
    assert pipeline.run("counts", [], ["autopipe"]) == EMPTY  # and the next call goes as usual


def test_an_argument_redis_cannot_take_is_refused_as_redis_py_refuses_it(
        redis: Redis, clients: Callable[..., Redis]) -> None:
    from redis.exceptions import DataError

    pipeline = AutoPipeline(clients(_url(redis)))
    with pytest.raises(DataError, match="bool"):
        pipeline.run("counts", [], [True])
    assert pipeline.run("counts", [], ["autopipe"]) == EMPTY


def test_a_caller_gone_before_its_call_was_sent_passes_its_lead_on(redis: Redis,
                                                                    clients: Callable[..., Redis]) -> None:
    # A waiting greenlet can be killed (gunicorn's graceful timeout): its call must not be sent,
    # and a lead handed to it must pass on, or every later call of the process would wait forever.
    from shared.store.autopipeline import _Call

    pipeline = AutoPipeline(clients(_url(redis)))
    gone, waiting = _Call("counts", [], ["autopipe"]), _Call("counts", [], ["autopipe"])
    pipeline._out, pipeline._gathered = True, [gone, waiting]  # a round trip out, two gathered
    pipeline._hand_on()  # it came back: the lead goes to the first gathered, which is gone
    assert gone.leads and gone.woken.is_set()
    pipeline._abandon(gone)
    assert pipeline._gathered == [waiting] and waiting.leads and waiting.woken.is_set()
    pipeline._abandon(waiting)
    assert pipeline._gathered == [] and pipeline._out is False
    assert pipeline.run("counts", [], ["autopipe"]) == EMPTY  # the next call leads at once


def test_one_auto_pipeline_a_client(redis: Redis, clients: Callable[..., Redis]) -> None:
    other = clients(_url(redis))
    assert autopipeline.of(redis) is autopipeline.of(redis)
    assert autopipeline.of(other) is not autopipeline.of(redis)


def _url(redis: Redis) -> str:
    kwargs = redis.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"
