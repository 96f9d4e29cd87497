"""The single-slot worker process: load the pipeline once, then run one job at a time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Literal

import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.job import Job
from rq.queue import Queue
from rq.timeouts import JobTimeoutException
from rq.worker import WorkerStatus

from shared.contract import keys, logs
from shared.contract.errors import JobCanceledError, JobFailedError, WorkerFatalError
from shared.contract.settings import Settings, get_settings
from shared.store import estimates, records, results, waiting
from shared.store.claims import Claims
from shared.store.connection import job_queue
from shared.store.fencing import connect_worker, holding
from shared.store.waiting import Claimed
from worker import batching, lifecycle, memory, tasks
from worker.compile import CompileError
from worker.desk import JobDesk, Started, Taken
from worker.finisher import Finisher
from worker.joining import JoinedExecution, steppable_model
from worker.messages import Batch, Work
from worker.metrics import WorkerMetrics
from worker.models import Models
from worker.outcomes import Member, Outcomes, ids_of
from worker.pipeline import current_pipeline, load_pipeline, resolve_device, set_current_pipeline
from worker.rq import check_rq
from worker.sharing import DeviceSharing
from worker.sweeper import Sweeper
from worker.webhooks import Sender

log = logging.getLogger(__name__)
CLAIM_TIMEOUT_S = 1.0
KEPT_FREE_WAIT_S = 0.5  # how often a worker keeping its device free asks again whether it may claim
MAX_BACKOFF_S = 15.0
EXIT_FATAL = 3
ClaimAhead = Literal["thread", "sent", "off"]
ClaimedAhead = Callable[[], Taken | None]  # a claim made ahead: called once, it answers the jobs it took


class Mode(Enum):
    """What the main thread runs, for what an execution may do at its last step."""

    TAKING = "taking"  # executions from the line, one after another: the next one may be claimed ahead
    PREEMPTING = "preempting"  # a higher class's job, while a step-level loop's paused jobs wait to go on


class SlotWorker(Outcomes):
    """An RQ worker that runs jobs in its own process, so the model stays loaded on the device.

    No fork per job: CUDA does not survive fork, and reloading weights per job would waste the GPU.
    The GPU gate is narrow: the main thread runs only the GPU section of each job (and the few
    Redis calls that start it), and a finishing process encodes, stores and records each job's
    end through RQ while the next one runs (worker/finisher.py); worker/desk.py starts the claimed
    jobs and hands them over, worker/outcomes.py handles how each run ends. This class owns the loop
    around it: claims that survive a crash, a heartbeat, reconnection to Redis, and the stop signals.
    """

    def __init__(self, queue: Queue, settings: Settings) -> None:
        super().__init__(queue, settings, settings.worker_name)
        self.claims = Claims(queue, settings, self.name)
        self.models = Models(settings, current_pipeline())
        self.metrics = WorkerMetrics(self.models.device, self.models.device_time, settings, self.name)
        self.sharing = DeviceSharing(settings, self.models.device)  # when it lets go of the device
        # The next execution's claim, started while the current one decodes (SLOTQ_CLAIM_AHEAD).
        self.claims_ahead = claims_ahead(settings, current_pipeline().device)
        self._claimed_ahead: ClaimedAhead | None = None  # that claim, once made (at the last step)
        self._claimer = ThreadPoolExecutor(1, thread_name_prefix="claim-ahead")
        self.mode = Mode.TAKING
        self.desk = JobDesk(self)  # where jobs start, fail and are handed over (worker/joining.py's too)
        # By model: whether the step-level loop runs its jobs (SLOTQ_STEP_SCHEDULING), known once loaded.
        self._steppable: dict[str, bool] = {}
        if settings.step_scheduling:
            self._steppable[settings.served_models[0]] = steppable_model(current_pipeline())
        self._model_of_line = {settings.line_of(model): model for model in settings.served_models}

    def serve(self, burst: bool = False) -> int:
        """Take and run jobs until told to stop; the process's exit code."""
        finisher = self.desk.finisher = Finisher(self.settings, self.name, self.on_finished, self.on_lost)
        self._register()
        for line in self.claims.lines:
            waiting.recount_costs(self.connection, line)  # sums kept by an older version
        beating = threading.Event()
        heart = threading.Thread(target=self._beat, args=(beating,), name="heartbeat", daemon=True)
        heart.start()
        # Webhooks go out from a thread of their own, off the GPU path; without a secret, none go out.
        sender = Sender(self.queue, self.settings) if self.settings.webhook_secret else None
        if sender:
            sender.start()
        # A file store or a bucket keeps what it is given: the workers sweep it, one at a time.
        sweeper = None if results.of(self.settings).in_redis else Sweeper(self.connection, self.settings,
                                                                          self.name)
        if sweeper:
            sweeper.start()
        try:
            return self._loop(burst)
        except WorkerFatalError as exc:
            log.critical("device unusable, exiting for the supervisor to restart: %s", exc)
            return EXIT_FATAL
        finally:
            self._put_back_ahead()
            finisher.close()  # the last job's end is recorded before this worker says it is gone
            if sender:
                sender.close()  # what it has not sent stays in the outbox for the next worker
            if sweeper:
                sweeper.close()
            beating.set()
            self._unregister()

    def _loop(self, burst: bool) -> int:
        backoff = 0.5
        while not lifecycle.stopping.is_set():
            try:
                if self._kept_free():
                    lifecycle.stopping.wait(KEPT_FREE_WAIT_S)
                    continue
                taken = self._next(burst)
                if taken is None:
                    if self.get_state() != WorkerStatus.IDLE:
                        self.set_state(WorkerStatus.IDLE)  # for `rq info` and dashboards: nothing runs
                    if self.sharing.idle_due():
                        self._release("idle")
                    if burst:
                        break
                    continue
                try:
                    self._run(taken)
                except BaseException:
                    self.desk.unhold(taken.claims)  # not handed over: leftovers for recovery now
                    raise
                finally:
                    self.sharing.busy()
                backoff = 0.5
            except (RedisConnectionError, RedisTimeoutError) as exc:
                log.warning("Redis unreachable (%s); retrying in %.1fs", exc, backoff)
                lifecycle.stopping.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
        return 0

    def _kept_free(self) -> bool:
        """Whether the device is to stay free now (an operator's hold, or another program's need):
        then the worker lets go of it, claims nothing, and goes on recovering others' leftovers. Jobs
        claimed ahead run first: they left the line."""
        reason = self.sharing.keep_free() if self._claimed_ahead is None else None
        if reason is None:
            return False
        self._release(reason)
        self._recover_due()
        return True

    def _release(self, reason: str) -> None:
        """Let go of the device (worker/models.py), and say so in the next heartbeat."""
        if self.models.release():
            log.info("device released (%s)", reason)
            self.claims.describe_holding(self.models.holding.on_device, self.models.places)

    def _next(self, burst: bool) -> Taken | None:
        """The next execution's jobs: those claimed ahead, else a claim now (waiting a moment for one
        unless in burst mode), after the recovery and expiry that are due; None when none waits."""
        ahead = self._taken_ahead()  # first: recovery would take a claim in flight for a leftover
        try:
            self._recover_due()
        except BaseException:
            # Not run: what was claimed ahead is a leftover now, which recovery puts back once Redis
            # answers (held, it would stay claimed, and queued, for as long as this worker lives).
            self.desk.unhold(ahead.claims if ahead else [])
            raise
        return ahead or self._take(None if burst else CLAIM_TIMEOUT_S)

    def _recover_due(self) -> None:
        """Recover dead workers' claims and expire jobs past their deadline, at most once a second."""
        if self.claims.recover() is not None:
            for line in self.claims.lines:
                waiting.expire_due(self.queue, self.settings, line)

    def _take(self, timeout: float | None) -> Taken | None:
        """Claim the next execution's jobs (waiting up to ``timeout`` for one) and restore those
        that may start; None when none waits."""
        return self._taken(self.claims.claim(timeout, self.models.holding), time.monotonic())

    def _taken(self, claimed: Claimed | None, claimed_at: float) -> Taken | None:
        """The execution a claim starts: its companions gathered (batching), those that may start
        restored; None when the claim took nothing. ``claimed_at``: when, on this process's clock."""
        if claimed is None:
            return None
        batch = [claimed]  # with claimed.at: batching's gather is part of the wait
        try:
            loaded = self.models.current  # none known (nor any loaded): the settings' bound alone
            capacity = loaded.capacity.pixels if loaded is not None else None
            by: Literal["batch", "join"] = "join" if self._joins(claimed) else "batch"
            batch += batching.gather(self.claims, self.settings, claimed, capacity, by)
            return Taken(batch, self.desk.fenced(batch), claimed.at, claimed_at)
        except BaseException:
            self.desk.unhold(batch)  # not started: leftovers for recovery
            raise

    def _claim_ahead(self) -> None:
        """On the main thread at an execution's last denoising step: start the next one's claim
        while this one decodes (SLOTQ_CLAIM_AHEAD), so that its round trip is off the path between
        two GPU sections. Taken this late, a job leaves the line at most one decode before it would
        have."""
        if self._claimed_ahead is not None or self.mode is Mode.PREEMPTING or lifecycle.stopping.is_set() \
                or self.sharing.held.is_set():
            return
        if self.claims_ahead == "thread":  # the claim and the restore, on the claiming thread
            self._claimed_ahead = self._claimer.submit(self._take, None).result
        elif self.claims_ahead == "sent":
            self._claimed_ahead = self._send_claim()

    def _send_claim(self) -> ClaimedAhead | None:
        """The claim's script sent now, for Redis to run during the decode; what it took is read,
        and restored, after it. None when Redis could not be reached: the claim is made after the
        decode, as without claiming ahead."""
        try:
            sent = self.claims.send_claim(self.models.holding)
        except RedisError as exc:
            log.warning("could not send the next claim (%s): it is made after this execution", exc)
            return None
        at = time.monotonic()
        return lambda: self._taken(self.claims.received(sent), at)

    def _taken_ahead(self) -> Taken | None:
        """The jobs claimed ahead, once the claim is done; None when none was made or none waited."""
        ahead, self._claimed_ahead = self._claimed_ahead, None
        return ahead() if ahead is not None else None

    def _put_back_ahead(self) -> None:
        """Stopping: jobs claimed ahead go back to the head of the line (their claims, left behind by
        an error, are recovered once this worker is gone)."""
        try:
            taken = self._taken_ahead()
        except Exception as exc:  # the worker stops either way; _take let go of what it held
            log.warning("could not claim ahead (%s): any job it took is recovered", exc)
            taken = None
        finally:
            self._claimer.shutdown()
        for claimed in taken.claims if taken else []:
            try:
                self.claims.recover_now(claimed.job_id)
            except RedisError as exc:
                log.warning("job %s claimed ahead stays claimed (%s): it is recovered", claimed.job_id, exc)

    def _run(self, taken: Taken) -> None:
        """Run claimed jobs as one GPU execution (a single job unless batching is on).

        From its claim on, each job's writes are fenced with it: the main thread's under the
        fences of the whole batch, the ending of each under its own (see shared/store/fencing.py).
        """
        line = taken.claims[0].line or self.settings.line
        begun = self.desk.begin(taken, line)
        if not begun.members:
            return
        if self._joins(taken.claims[0]):
            refused = self._run_joined(taken, begun, line)
            if not refused:
                return
            begun = Started(refused, "", sum(records.cost_of(member.job) for member in refused), set())
        self._execute(begun, line)

    def _joins(self, claimed: Claimed) -> bool:
        """Whether this claim's execution runs through the step-level loop: step scheduling is on, the
        job has a join key, and its model's jobs are known to be steppable."""
        if not self.settings.step_scheduling or not claimed.record.get(b"join"):
            return False
        model = self._model_of_line.get(claimed.line or self.settings.line, "")
        return self._steppable.get(model, False)

    def _run_joined(self, taken: Taken, begun: Started, line: str) -> list[Member]:
        """Run started jobs through the step-level loop, which others join (worker/joining.py); the
        members it refused, for a whole-pipeline execution."""
        members = begun.members
        try:
            with holding(*(member.fence for member in members)), \
                    logs.about_job(*ids_of([member.job for member in members])):
                self._switch_to([member.job for member in members])
        except Exception as exc:
            estimates.clear_running(self.connection, line, self.name)
            for member in members:
                self.desk.fail(member, exc)
            return []
        started = time.perf_counter()  # a model's load is not the execution's
        execution = JoinedExecution(self.desk, line, taken, begun.running, begun.cost,
                                    run_preempting=self.run_preempting,
                                    death_penalty=self.death_penalty_class)
        refused = execution.run(members, begun.canceled)
        self.metrics.gpu_section.observe(time.perf_counter() - started)
        self._describe_capacity()
        return refused

    def run_preempting(self, line: str) -> None:
        """Claim the first job of the highest class in this line and run its execution, while the
        step-level loop's jobs are paused (worker/joining.py)."""
        claimed = self.claims.claim_from(line)
        if claimed is None:
            return  # taken by another worker, canceled or expired meanwhile
        taken = self._taken(claimed, time.monotonic())
        if taken is None:
            return
        self.mode = Mode.PREEMPTING
        try:
            self._run(taken)
        except BaseException:
            self.desk.unhold(taken.claims)
            raise
        finally:
            self.mode = Mode.TAKING

    def _execute(self, begun: Started, line: str) -> None:
        """Run started jobs as one whole-pipeline execution, and hand their ends over."""
        members = begun.members
        fences = [member.fence for member in members]
        live = [member.job for member in members if member.job.id not in begun.canceled]  # others: at start
        started = time.perf_counter()
        try:
            with holding(*fences), logs.about_job(*ids_of([member.job for member in members])):
                if live:
                    self._switch_to(live)
                started = time.perf_counter()  # a model's load is not the execution's (ETAs, drain rate)
                made = self._render(live) if live else []
                rendered = dict(zip([job.id for job in live], made, strict=True))
        except Exception as exc:
            estimates.clear_running(self.connection, line, self.name)
            rendered = dict.fromkeys([job.id for job in live], exc)
        outcomes = [rendered.get(member.job.id, JobCanceledError()) for member in members]
        self.metrics.gpu_section.observe(time.perf_counter() - started)
        self._describe_capacity()  # the execution's peak may move the fit
        self._end_execution(list(zip(members, outcomes, strict=True)), begun, line, started)

    def _end_execution(self, ends: list[tuple[Member, tasks.RenderResult]], begun: Started, line: str,
                       started: float) -> None:
        """Record the failure (or cancel) of each job that has no images, and hand the others' images
        over as one batch (``started``: when the execution did, on time.perf_counter())."""
        done = []
        for member, outcome in ends:
            if isinstance(outcome, Exception):
                self.desk.fail(member, outcome)
            else:
                done.append((member, outcome))
        if not done:
            return
        works = [Work.of(member.job, member.execution, member.fence, rendered) for member, rendered in done]
        for member, _ in done:  # RQ's cleanup of the execution runs in the finishing process
            self.desk.let_go(member)
        seconds = time.perf_counter() - started  # the drain rate Retry-After and ETAs need
        batch = Batch(works, begun.running, begun.cost, seconds, line)
        self.desk.hand_over([member for member, _ in done], batch)

    def _switch_to(self, jobs: list[Job]) -> None:
        """Make the model of these jobs (one line's) current, and record on each job how."""
        model = waiting.job_model(jobs[0])
        if model not in self.models.served:
            return  # never claimed from another model's line; the render refuses it plainly
        try:
            switch = self.models.use(model)
            if self.settings.step_scheduling and model not in self._steppable:
                self._steppable[model] = steppable_model(current_pipeline())
        except Exception as exc:
            log.exception("could not load model %s", model)
            raise JobFailedError("model_load_failed",
                                 f"the worker could not load model {model}: {exc}") from exc
        finally:
            self.claims.describe_holding(self.models.holding.on_device, self.models.places)
        for job in jobs:
            job.meta["model_load"] = {"source": switch.source, "seconds": round(switch.seconds, 3)}
        self.metrics.switched(switch)

    def _describe_capacity(self) -> None:
        """Say how large a job this worker can run now (its current model's fit; unchanged while none is
        loaded, as after a load that failed on a worker that had let go of its device)."""
        if self.models.current is None:
            return
        capacity = self.models.current.capacity
        self.claims.describe_capacity(capacity.pixels, capacity.total, capacity.free_after_load)

    def _render(self, jobs: list[Job]) -> list[tasks.RenderResult]:
        """Run the jobs' GPU section (their start and step 0 are recorded), under the shortest job
        timeout."""
        timeout = min(job.timeout or self.settings.job_timeout_s for job in jobs)
        with self.death_penalty_class(timeout, JobTimeoutException, job_id=jobs[0].id):
            return tasks.render(jobs, announced=True, last_step=self._claim_ahead)

    def _beat(self, done: threading.Event) -> None:
        interval = self.settings.heartbeat_ttl_s / 4
        while not done.wait(interval):
            try:
                beat = self.claims.beat()
                if beat.drain and not lifecycle.stopping.is_set():
                    log.info("drain requested by an operator: finishing the running job, taking no new one")
                    lifecycle.stopping.set()  # as the first SIGTERM: the main loop exits once it is done
                if beat.held != self.sharing.held.is_set():
                    log.info("held by an operator" if beat.held else "an operator's hold ended")
                    (self.sharing.held.set if beat.held else self.sharing.held.clear)()
                self.heartbeat()  # RQ's own registration, so `rq info` keeps listing a busy worker
            except RedisError as exc:
                log.debug("heartbeat failed: %s", exc)

    def check_ready(self) -> None:
        """Raise unless Redis and the result store answer (the worker's /readyz)."""
        self.connection.ping()
        results.of(self.settings).check()

    def _register(self) -> None:
        if self.connection.exists(self.key) and not self.connection.hexists(self.key, "death"):
            # A restarted worker with a fixed name: once the dead one's heartbeat has lapsed, its
            # registration is stale and its claims are ours to recover.
            alive = keys.alive_key(self.name)
            deadline = time.monotonic() + self.settings.heartbeat_ttl_s + 1
            while self.connection.exists(alive) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.connection.exists(alive):
                raise RuntimeError(f"a live worker is already named {self.name!r}")
            self.connection.delete(self.key)
        self.register_birth()
        # The device the pipeline resolved, named as in slotq_worker_info ("cuda", "cuda:1", "cpu").
        loaded = current_pipeline()
        self.claims.describe(self.hostname, self.pid, str(loaded.device), loaded.info.family,
                             loaded.info.loras)
        self.claims.describe_holding(self.models.holding.on_device, self.models.places)
        self._describe_capacity()
        self.claims.beat()
        log.info("worker %s ready on %s (models %s)", self.name, ", ".join(self.claims.lines),
                 ", ".join(self.claims.models))

    def _unregister(self) -> None:
        try:
            self.claims.gone()
            self.register_death()
        except RedisError as exc:
            log.warning("could not unregister: %s", exc)


def claims_ahead(settings: Settings, device: torch.device | str) -> ClaimAhead:
    """How the next execution's jobs are claimed while the current one decodes (SLOTQ_CLAIM_AHEAD).

    - ``thread``, on the claiming thread, the restore included (true; ``auto`` on a GPU, where the
      main thread waits on the device as it decodes and the thread takes nothing from it);
    - ``sent``, the claim's script sent at the last step and its answer read after the decode, on
      the main thread (``auto`` elsewhere: on the CPU the main thread computes, and the claiming
      thread's Python slowed its decode by more than the claim's round trip; docs/settings.md);
    - ``off``, after the decode (false).
    """
    if settings.claim_ahead == "auto":  # a benchmark's stand-in pipeline names no torch device
        return "thread" if str(device).startswith("cuda") else "sent"
    return "thread" if settings.claim_ahead else "off"


def run_worker(settings: Settings | None = None, *, burst: bool = False) -> int:
    """Load the model and serve jobs until told to stop; the exit code for the supervisor."""
    settings = settings or get_settings()
    logs.configure(settings, "worker")
    lifecycle.install(settings.stop_timeout_s)
    check_rq()  # an RQ outside the tested range fails here, plainly, not mid-job
    try:
        device = resolve_device(settings.device)
        for model in settings.served_models:  # each model's memory settings, before any is loaded
            memory.check(settings.memory_of(model), device)
        set_current_pipeline(load_pipeline(settings))  # the first model; the others when a job needs them
    except (memory.MemorySettingError, CompileError) as exc:
        log.critical("cannot start: %s", exc)
        return 1
    except Exception:
        # Worker-fatal: exit non-zero so the supervisor restarts us rather than failing every job.
        log.exception("could not load model %s", settings.source_of(settings.served_models[0]))
        return 1
    worker = SlotWorker(job_queue(connect_worker(settings), settings), settings)
    worker.metrics.serve(settings, ready=worker.check_ready)
    return worker.serve(burst=burst)

