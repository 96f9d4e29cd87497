"""Fencing: a worker presumed dead that comes back cannot write to a job another attempt now runs."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import ConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from shared.contract import keys
from shared.contract.settings import Settings
from shared.store import fencing, records, waiting
from shared.store.fencing import Fence, FencedRedis, StaleAttemptError, holding
from tests.conftest import LosesOneReply, Process, post_job, start_worker, wait_for, wait_for_status

CLAIMS = "slotq:claims:test-worker"


@pytest.fixture
def fenced(settings: Settings) -> Iterator[FencedRedis]:
    connection = FencedRedis.from_url(settings.redis_url)
    yield connection
    connection.close()


def claimed(fenced: FencedRedis, job_id: str) -> Fence:
    """A job in the test worker's claims with its attempt started, as a claim leaves it."""
    fenced.rpush(CLAIMS, job_id)
    fence = Fence(job_id, fencing.new_token())
    fenced.set(fence.key, fence.token, ex=60)
    return fence


def test_a_claim_starts_an_attempt_its_fence_holding_the_claims_token(client: FlaskClient, settings: Settings,
                                                                      redis: Redis) -> None:
    ids = [post_job(client, seed=seed).get_json()["id"] for seed in range(3)]
    first = waiting.claim(redis, settings.line, CLAIMS, fence_ttl_s=60)
    assert first is not None and first.job_id == ids[0] and first.token
    assert redis.get(keys.fence_key(ids[0])) == first.token.encode()
    assert 0 < redis.ttl(keys.fence_key(ids[0])) <= 60
    more = waiting.claim_compatible(redis, settings.line, CLAIMS, first, 2, 8, fence_ttl_s=60)
    assert [each.job_id for each in more] == ids[1:]
    assert len({first.token, *(each.token for each in more)}) == 3  # each attempt its own token
    assert [redis.get(keys.fence_key(each.job_id)) for each in more] == [each.token.encode() for each in more]
    # Without a TTL (a plain claim, as RQ-level tools and tests make), no attempt is started.
    assert redis.delete(*(keys.fence_key(job_id) for job_id in ids)) == 3
    post_job(client, seed=3)
    plain = waiting.claim(redis, settings.line, CLAIMS)
    assert plain is not None and plain.token == "" and not redis.exists(keys.fence_key(plain.job_id))


def test_writes_under_a_current_fence_go_through(fenced: FencedRedis) -> None:
    fence = claimed(fenced, "job")
    with holding(fence):
        fenced.hset("record", "status", "started")  # a single write
        with fenced.pipeline(transaction=False) as pipe:  # a pipeline, made a transaction
            pipe.hset("record", "progress", "1")
            pipe.exists(keys.cancel_key("job"))
            assert pipe.execute() == [1, 0]
        assert fenced.hgetall("record") == {b"status": b"started", b"progress": b"1"}


def test_a_fenced_pipeline_is_one_script_call_that_answers_as_exec_would(fenced: FencedRedis,
                                                                          redis: Redis) -> None:
    fence = claimed(fenced, "job")
    redis.set("text", "a string")

    def queue(pipe: Pipeline, prefix: str) -> None:
        pipe.hset(f"{prefix}:hash", mapping={"status": "started", "cost": 1.5})
        pipe.hgetall(f"{prefix}:hash")
        pipe.hmget(f"{prefix}:hash", ["status", "missing"])
        pipe.hincrbyfloat(f"{prefix}:hash", "cost", 0.25)
        pipe.set(f"{prefix}:string", "value", ex=60)
        pipe.get(f"{prefix}:missing")
        pipe.zadd(f"{prefix}:zset", {"a": 1.5, "b": 2})
        pipe.zrange(f"{prefix}:zset", 0, -1, withscores=True)
        pipe.expire(f"{prefix}:zset", 60)
        pipe.rpush(f"{prefix}:list", "x", "y")
        pipe.lrange(f"{prefix}:list", 0, -1)
        pipe.hset("text", "field", "value")  # WRONGTYPE: an error in its place, the rest still runs
        pipe.exists(f"{prefix}:hash", f"{prefix}:missing")
        pipe.publish("events", "job")
        pipe.delete(f"{prefix}:list")

    with redis.pipeline() as pipe:  # MULTI ... EXEC, unfenced
        queue(pipe, "exec")
        expected = pipe.execute(raise_on_error=False)
    redis.config_resetstat()
    with holding(fence), fenced.pipeline() as pipe:
        queue(pipe, "fenced")
        answers = pipe.execute(raise_on_error=False)
    assert [str(answer) if isinstance(answer, Exception) else answer for answer in answers] == [
        str(answer) if isinstance(answer, Exception) else answer for answer in expected]
    assert isinstance(answers[11], ResponseError) and "WRONGTYPE" in str(answers[11])
    assert redis.hgetall("fenced:hash") == {b"status": b"started", b"cost": b"1.75"}
    calls = {name: stats["calls"] for name, stats in redis.info("commandstats").items()}
    assert calls.get("cmdstat_evalsha") == 1  # one round trip: no WATCH, no MULTI ... EXEC
    assert not {"cmdstat_watch", "cmdstat_multi", "cmdstat_exec"} & set(calls)
    with holding(fence), fenced.pipeline() as pipe, pytest.raises(ResponseError, match="WRONGTYPE"):
        pipe.hset("text", "field", "value")
        pipe.execute()


def test_a_fenced_write_whose_reply_is_lost_is_not_sent_again(settings: Settings, redis: Redis) -> None:
    # As the worker's client: one retry on a timeout, which would send the writes a second time.
    pool = ConnectionPool.from_url(settings.redis_url, connection_class=LosesOneReply,
                                   retry=Retry(NoBackoff(), 1))
    fenced = FencedRedis(connection_pool=pool)
    fence = claimed(fenced, "job")
    redis.script_flush()  # and the script is loaded on the way (NOSCRIPT, then EVAL)
    with holding(fence):
        assert fenced.hincrby("ended", "succeeded", 1) == 1
    LosesOneReply.lose_at = 1  # the next reply
    with holding(fence), pytest.raises(RedisTimeoutError):
        fenced.hincrby("ended", "succeeded", 1)
    assert redis.hget("ended", "succeeded") == b"2"  # it ran once: not again (3)
    pool.disconnect()


def test_a_revoked_fence_refuses_every_write_and_writes_nothing(fenced: FencedRedis, redis: Redis) -> None:
    fence = claimed(fenced, "job")
    with redis.pipeline() as pipe:  # another worker recovers the claim
        pipe.lrem(CLAIMS, 1, "job")
        fencing.revoke(pipe, "job")
        pipe.execute()
    with holding(fence):
        with pytest.raises(StaleAttemptError):
            fenced.hset("record", "status", "finished")
        with pytest.raises(StaleAttemptError), fenced.pipeline() as pipe:
            pipe.hset("record", "status", "finished")
            pipe.publish("events", "job")
            pipe.execute()
        assert fenced.hgetall("record") == {}  # reads still pass
    fenced.hset("record", "status", "unfenced")  # outside ``holding`` the client is a plain one
    assert redis.hget("record", "status") == b"unfenced"


def test_a_fence_taken_over_between_check_and_exec_writes_nothing(fenced: FencedRedis, redis: Redis) -> None:
    fence = claimed(fenced, "job")
    with holding(fence), fenced.pipeline() as pipe:
        # RQ's own way (handle_job_success): WATCH its key, read, MULTI, write, EXEC.
        pipe.watch("dependents")
        redis.set(keys.fence_key("job"), "newer-attempt")  # taken over after the check
        pipe.multi()
        pipe.hset("record", "status", "finished")
        with pytest.raises(Exception) as raised:
            pipe.execute()
        assert raised.type.__name__ == "WatchError"  # the caller's retry then meets the fence:
        with pytest.raises(StaleAttemptError):
            pipe.watch("dependents")
    assert redis.hgetall("record") == {}


def test_step_progress_checks_the_fence_in_its_own_script(fenced: FencedRedis, redis: Redis) -> None:
    job = Job.create("worker.tasks.generate", kwargs={"request": {}}, connection=fenced,
                     serializer=JSONSerializer)
    job.save()
    fence = claimed(fenced, job.id)
    redis.set(keys.cancel_key(job.id), 1)
    with holding(fence):
        assert records.report_progress([job], 1, 4) == [True]  # written, and the cancel seen
    assert Job.fetch(job.id, connection=redis, serializer=JSONSerializer).meta["progress"] == {
        "step": 1, "total": 4}
    redis.set(keys.fence_key(job.id), "newer-attempt")
    with holding(fence), pytest.raises(StaleAttemptError):
        records.report_progress([job], 2, 4)
    assert Job.fetch(job.id, connection=redis, serializer=JSONSerializer).meta["progress"]["step"] == 1


@pytest.fixture
def workers(settings: Settings, tmp_path: Path) -> Iterator[Callable[..., Process]]:
    started: list[Process] = []

    def start(name: str) -> Process:
        process = start_worker(settings, tmp_path / f"{name}.log", worker_name=name)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.popen.poll() is None:
            process.popen.send_signal(signal.SIGCONT)
        process.stop()


def holder(client: FlaskClient, redis: Redis, job_id: str, names: Iterable[str], attempt: int) -> str | None:
    """The worker running this attempt of the job, once it has taken two steps."""
    current = client.get(f"/v1/jobs/{job_id}").get_json()
    if current["attempt"] != attempt or (current["progress"] or {}).get("step", 0) < 2:
        return None
    return next((name for name in names if redis.lpos(keys.claims_key(name), job_id) is not None), None)


def await_old_attempt(client: FlaskClient, job_id: str, old: Process) -> list[int]:
    """Wait until the old attempt's worker says how that attempt ended; the steps clients saw meanwhile.

    It ends one way or another: fenced off ("dropped"), unable to store its images, or, were it not
    fenced, recorded as the job's end ("succeeded in").
    """
    steps: list[int] = []
    ends = ("dropped", "could not store", "succeeded in")

    def ended() -> bool:
        steps.append(client.get(f"/v1/jobs/{job_id}").get_json()["progress"]["step"])
        return any(job_id in line and any(end in line for end in ends) for line in old.output().splitlines())

    wait_for(ended, timeout=120, what="the old attempt's worker to end it")
    return steps


def assert_only_the_new_attempt_counts(client: FlaskClient, redis: Redis, settings: Settings, job_id: str,
                                       new_worker: str, steps: list[int]) -> None:
    """The job ends as its second attempt made it, and the first changed nothing clients see."""
    done = wait_for_status(client, job_id, "succeeded", timeout=120)
    assert done["attempt"] == 2
    assert steps == sorted(steps), "the stale attempt moved the progress of the new one"
    job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    assert job.worker_name == new_worker
    assert len(job.results()) == 1  # one end recorded, by the new attempt
    # Counted in the round trip after the status (shared/store/endings.py settle): wait for it.
    wait_for(lambda: redis.hget(keys.ended_key(settings.queue_name), "succeeded") == b"1",
             what="the end to be counted once")


@pytest.mark.slow
def test_a_paused_worker_that_comes_back_cannot_touch_the_new_attempt(
        client: FlaskClient, redis: Redis, settings: Settings, workers: Callable[..., Process]) -> None:
    """A worker frozen mid-job (SIGSTOP: a long pause, as a partition looks from Redis) is presumed
    dead; its job runs again on the other worker. Thawed while the new attempt runs, the old one
    must write nothing: not its progress, not its images, not its end."""
    pool = {name: workers(name) for name in ("fence-a", "fence-b")}
    job_id = post_job(client, width=512, height=512, steps=60).get_json()["id"]
    first = wait_for(lambda: holder(client, redis, job_id, pool, 1), timeout=120,
                     what="the first attempt to take two steps")
    zombie, survivor = pool[first], pool[next(name for name in pool if name != first)]
    zombie.popen.send_signal(signal.SIGSTOP)
    second = wait_for(lambda: holder(client, redis, job_id, pool, 2), timeout=60,
                      what="the job to run again on the other worker")
    assert second != first

    zombie.popen.send_signal(signal.SIGCONT)
    steps = await_old_attempt(client, job_id, zombie)
    assert_only_the_new_attempt_counts(client, redis, settings, job_id, second, steps)
    assert "newer attempt took over" in zombie.output()
    # The thawed worker lives on and takes new work.
    small = post_job(client, width=64, height=64, steps=1).get_json()["id"]
    assert wait_for_status(client, small, "succeeded")["attempt"] == 1
    assert zombie.popen.poll() is None and survivor.popen.poll() is None
