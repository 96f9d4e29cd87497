"""Step-level scheduling in the worker (SLOTQ_STEP_SCHEDULING): one GPU execution that compatible
jobs join at step boundaries and leave as each is done, and that a job of a higher class preempts.

The denoising is worker/stepping.py's loop; this module is the worker's side of it. Each job in the
loop keeps everything a job of a whole-pipeline execution has, on its own: its attempt's fence
(its writes are checked against it), its progress and cancel at the reports, a NaN check, its job
timeout, its end handed to the finishing process as soon as its last step is decoded. A job that
joins is claimed by the same atomic claim as a batch's companions (``claim_compatible``, by join
key), from its own class, at most SLOTQ_MAX_BATCH jobs in the loop at once and never more pixels than
batching allows. Preemption pauses the loop's jobs (their state kept: on the CPU where the models
run on a GPU), runs the higher class's job as an execution of its own, then resumes them: a worker
crash meanwhile leaves them claimed, and recovery runs them again as after any crash. While they run,
each job's state is saved every SLOTQ_CHECKPOINT_EVERY_S (worker/resuming.py), and a later attempt at
it resumes at the step saved.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from redis.exceptions import RedisError
from rq.job import Job
from rq.timeouts import BaseDeathPenalty, JobTimeoutException

from shared.contract import logs
from shared.contract.errors import (
    JobCanceledError,
    JobFailedError,
    JobInterruptedError,
    StorageUnavailableError,
    WorkerFatalError,
)
from shared.contract.jobs import PRIORITIES, JobRequest
from shared.store import estimates, records, results, waiting
from shared.store.fencing import Fence, StaleAttemptError, holding
from shared.store.waiting import SentCompatible
from worker import batching, lifecycle, previews, progress, resuming, tasks
from worker.desk import JobDesk, Taken
from worker.messages import Batch, Rendered, Work
from worker.outcomes import Member, ids_of
from worker.pipeline import NAN_OUTPUT, ImagePipeline, current_pipeline, images_of
from worker.stepping import Flight, NotSteppableError, SteppingLoop, model_refusal
from worker.threads import work_of

log = logging.getLogger(__name__)
WINDOW = 64  # how far into its class a join looks for compatible jobs
LOOK_ABOVE_EVERY_S = 0.1  # how often the loop looks for a higher class's job (SLOTQ_PREEMPT_AFTER_S > 0)


@dataclass(eq=False)
class Seat:
    """One job in the loop: its member of the execution, its request and its flights (one per image)."""

    member: Member
    request: JobRequest
    flights: list[Flight]
    timeout_at: float  # time.perf_counter() past which its job timeout ends it
    previews: previews.Cadence
    checkpoints: resuming.Cadence

    @property
    def job(self) -> Job:
        return self.member.job

    @property
    def progress(self) -> tuple[int, int]:
        """Its steps done, of its total (its flights step together)."""
        return self.flights[0].step, self.flights[0].total

    @property
    def done(self) -> bool:
        return all(flight.step == flight.total for flight in self.flights)


def steppable_model(pipeline: ImagePipeline) -> bool:
    """Whether the loop runs this model's jobs (its family, its own sampler, its UNet)."""
    reason = model_refusal(pipeline.pipe, pipeline.samplers)
    if reason is not None:
        log.info("step-level scheduling is off for this model: %s", reason)
    return reason is None


class JoinedExecution:
    """One GPU execution through the stepping loop. Its jobs start, fail and are handed over through
    the worker's :class:`~worker.desk.JobDesk`; ``run_preempting(line)`` runs the first job of a higher
    class in the line as an execution of its own, while the loop's jobs are paused."""

    def __init__(self, desk: JobDesk, line: str, first: Taken, running: str, cost: float, *,
                 run_preempting: Callable[[str], None], death_penalty: type[BaseDeathPenalty]) -> None:
        self.desk, self.settings, self.line = desk, desk.settings, line
        self.run_preempting, self.death_penalty = run_preempting, death_penalty
        self.first, self.like = first, first.claims[0]  # joiners are claimed like its first job
        self.connection = desk.connection
        self.results = results.of(self.settings)
        self.pipeline = current_pipeline()
        self.loop = SteppingLoop(self.pipeline.for_stepping(), self.pipeline.samplers)
        self.priority = self.like.record.get(b"priority", b"normal").decode()
        self.running, self.cost = running, cost  # the worker's running entry, and its jobs' cost
        self.stepped: int | None = 0  # loop steps since the running entry was marked (None: unknown)
        self.seats: list[Seat] = []
        self.done: list[tuple[Member, Work]] = []  # decoded, not yet handed to the finishing process
        self.joining: SentCompatible | None = None  # a join's claim sent, its answer not yet read
        self.cadence = progress.Cadence(self.settings.progress_interval_ms / 1000)
        self.slot_since = time.perf_counter()  # since the last job left: its share of the slot's time
        self.looked_above = 0.0  # when the loop last looked for a higher class's job (time.monotonic())
        self.looked_aside, self.others_wait = 0.0, False  # the other lines of a worker of several models

    def run(self, members: list[Member], canceled: set[str]) -> list[Member]:
        """Run these started jobs and those that join them until all have ended; the members the loop
        refused (they run as a whole-pipeline execution instead)."""
        refused = self._seat(members, canceled)
        self._pausing(True)
        try:
            try:
                while self.seats or self.joining is not None:
                    self._step()
            except (WorkerFatalError, RedisError):
                raise  # the device is lost, or Redis: the jobs stay claimed, to run again after recovery
            except Exception as exc:  # a fault of the device or the loop: every job in it ends by it
                estimates.clear_running(self.connection, self.line, self.desk.name)
                for seat in list(self.seats):
                    self._end(seat, exc)
            finally:
                self._pausing(False)
                self._put_back_joiners()
                self._hand_over(wait=True)  # the decoded ones are done whatever became of the others
        except BaseException:
            # Not ended, or not handed over: leftovers, which recovery runs again.
            for job in [seat.job for seat in self.seats] + [member.job for member, _ in self.done]:
                self.desk.claims.unhold(job.id)
            raise
        return refused

    # --- the loop's turn -----------------------------------------------------------------------------

    def _step(self) -> None:
        """One step boundary: joiners, reports and cancels, a preemption, then one denoising step
        (while Redis claims the next joiners)."""
        self._take_joiners()
        self._check_in()
        if self.seats and self._preemption_due():
            self._preempt()
        if not self.seats:
            return
        if not lifecycle.stopping.is_set():
            self._send_join()
        first = {seat for seat in self.seats if seat.progress[0] == 0}
        left = max(1, math.ceil(min(seat.timeout_at for seat in self.seats) - time.perf_counter()))
        with holding(*self._fences()), logs.about_job(*ids_of([seat.job for seat in self.seats])), \
                self.death_penalty(left, JobTimeoutException, job_id=self.seats[0].job.id), \
                self.pipeline.section():
            self.loop.step()
            if self.stepped is not None:
                self.stepped += 1
            if self.settings.fault_injection:  # a test's device fault, at step 1 as in a whole execution
                for seat in first:
                    tasks.inject_fault(seat.request)
        self._offer_previews()
        self._end_overflowed([seat for seat in self.seats if seat in first])  # as a whole execution looks
        self._finish([seat for seat in self.seats if seat.done])
        self._save_checkpoints(self.seats)
        self._hand_over(wait=not self.seats and self.joining is None)

    def _check_in(self) -> None:
        """Interrupt, timeouts; when a report is due, each job's progress and whether it was canceled,
        and a NaN check."""
        if lifecycle.interrupting.is_set():
            self._save_checkpoints(self.seats, at_once=True)  # the next attempt goes on from here
            for seat in list(self.seats):
                self._end(seat, JobInterruptedError())
            return
        now = time.perf_counter()
        for seat in [seat for seat in self.seats if now > seat.timeout_at]:
            timeout = seat.job.timeout or self.settings.job_timeout_s
            self._end(seat, JobTimeoutException(f"Task exceeded maximum timeout value ({timeout} seconds)"))
        reporting = [seat for seat in self.seats if seat.progress[0] > 0]  # step 0: announced at start
        if not reporting or not self.cadence.due(len(self.seats), -1):  # a loop has no last step
            return
        try:
            left = max(total - step for step, total in (seat.progress for seat in self.seats))
            timed = (self.stepped, self.stepped + left) if self.stepped else None
            with holding(*self._fences(reporting)):
                canceled = records.report_steps([seat.job for seat in reporting],
                                                [seat.progress for seat in reporting], timed)
        except StaleAttemptError:
            canceled = [False] * len(reporting)
            self._drop_stale(reporting)
        except RedisError as exc:  # progress is best effort, as in a whole execution
            log.warning("could not report progress of %d job(s): %s", len(reporting), exc)
            return
        for seat, flag in zip(reporting, canceled, strict=True):
            if flag and seat in self.seats:
                self._end(seat, JobCanceledError())
        self._end_overflowed([seat for seat in reporting if seat in self.seats])

    # --- jobs in and out -----------------------------------------------------------------------------

    def _seat(self, members: Sequence[Member], canceled: set[str]) -> list[Member]:
        """Admit started jobs' images as flights; the members the loop refused."""
        prepared = [tasks.prepared_request(member.job) for member in members]
        refused = []
        for member, each in zip(members, prepared, strict=True):
            if member.job.id in canceled:
                self.desk.fail(member, JobCanceledError())
            elif isinstance(each, Exception):
                self.desk.fail(member, each)
            else:
                try:
                    flights = self.loop.admit_all(each[0])
                except NotSteppableError as exc:
                    log.info("job %s runs as a whole-pipeline execution: %s", member.job.id, exc)
                    refused.append(member)
                    continue
                if int(member.job.meta.get("attempt", 1)) > 1:  # a first attempt has no checkpoint
                    flights = self._resume(member.job, each[0], flights)
                now = time.perf_counter()
                timeout = member.job.timeout or self.settings.job_timeout_s
                cadence = previews.Cadence(self.settings.preview_interval_ms / 1000)
                checkpoints = resuming.Cadence(self.settings.checkpoint_every_s, saved_step=flights[0].step)
                self.seats.append(Seat(member, each[0], flights, now + timeout, cadence, checkpoints))
        if self.seats:
            self.pipeline.threads.use(work_of([seat.request for seat in self.seats]))
        return refused

    def _resume(self, job: Job, request: JobRequest, flights: list[Flight]) -> list[Flight]:
        """A later attempt's flights, put where the job's step checkpoint says where it has one that
        fits (its meta then says ``resumed_from_step``); else as they are, at step 0."""
        job.meta.pop("resumed_from_step", None)  # an earlier attempt's
        try:
            found = self.results.checkpoint(job)
        except (RedisError, StorageUnavailableError) as exc:
            log.warning("job %s: could not read its step checkpoint (%s): it starts at step 0", job.id, exc)
            return flights
        if found is None:
            return flights
        flights = resuming.resume(self.loop, job, request, flights, found)
        if flights[0].step:
            job.meta["resumed_from_step"] = flights[0].step
        return flights

    def _save_checkpoints(self, seats: list[Seat], at_once: bool = False) -> None:
        """Save the step checkpoint of each of these jobs that is due one (``at_once``: each that has
        taken a step since its last), under its attempt's fence; a write that fails is logged, and the
        job goes on."""
        now = time.monotonic()
        due = [seat for seat in seats if seat.checkpoints.due(seat.progress[0], now, at_once)]
        if not due:
            return
        pipe_class = type(self.loop.pipe).__name__
        with self.pipeline.section():  # the latents are read off the device
            saved = [(seat, resuming.dump(resuming.fingerprint(seat.job, pipe_class),
                                          [self.loop.state_of(flight) for flight in seat.flights]))
                     for seat in due]
        for seat, data in saved:
            step = seat.progress[0]
            try:
                with holding(seat.member.fence):
                    self.results.save_checkpoint(seat.job, step, data)
            except StaleAttemptError as exc:
                self._end(seat, exc)
                continue
            except (RedisError, StorageUnavailableError) as exc:  # best effort, as progress is
                log.warning("job %s: could not save its step checkpoint (%s)", seat.job.id, exc)
            seat.checkpoints.saved(step, now)

    def _send_join(self) -> None:
        """Send the claim of compatible jobs waiting in the first job's class, as many as there is room
        for: Redis runs it during this step's compute, and they join at the next boundary."""
        room = self._room()
        if room > 0 and not self._other_lines_wait():
            self.joining = self.desk.claims.send_join(self.like, room, WINDOW)

    def _other_lines_wait(self) -> bool:
        """Whether another of this worker's lines (another model's) has a job of this class or a higher
        one waiting: then nothing joins, the loop drains, and the next claim chooses between the lines
        as it always does (looked at most every LOOK_ABOVE_EVERY_S; never for a worker of one model)."""
        others = [line for line in self.desk.claims.lines if line != self.line]
        if not others:
            return False
        now = time.monotonic()
        if now - self.looked_aside < LOOK_ABOVE_EVERY_S:
            return self.others_wait
        self.looked_aside = now
        classes = PRIORITIES[:PRIORITIES.index(self.priority) + 1]
        try:
            # A paused line's jobs wait for its resume, not for this loop to drain.
            states = [waiting.line_state(self.connection, line) for line in others]
            self.others_wait = any(counts[name] for counts, paused in states if not paused
                                   for name in classes)
        except RedisError as exc:
            log.warning("could not look at the other lines (%s): no job joins now", exc)
            self.others_wait = True
        return self.others_wait

    def _take_joiners(self) -> None:
        """Read the join sent during the last step and start its jobs: they take this step with the
        others."""
        sent, self.joining = self.joining, None
        if sent is None:
            return
        claims = self.desk.claims.received_compatible(sent)
        if not claims:
            return
        taken = self.desk.taken_with(self.first, claims)
        try:
            members, running, cost, canceled = self.desk.begin(taken, self.line, running_cost=self.cost)
        except BaseException:
            self.desk.unhold(claims)  # not started (Redis went away): leftovers, which recovery puts back
            raise
        if not members:
            return
        self.running, self.cost, self.stepped = running, cost, 0  # marked anew, from the joiners' start
        log.info("%d job(s) joined the running batch at a step boundary", len(members))
        for member in self._seat(members, canceled):  # the model refused none before: it cannot now
            self.desk.fail(member, JobFailedError("invalid_request", "the job cannot join the loop"))

    def _put_back_joiners(self) -> None:
        """The loop ends with a join's answer unread (an error): the jobs it took go back to the head of
        the line (if it cannot be read, their claims are leftovers, which recovery puts back)."""
        sent, self.joining = self.joining, None
        if sent is None:
            return
        try:
            for claimed in self.desk.claims.received_compatible(sent):
                self.desk.claims.recover_now(claimed.job_id)
        except RedisError as exc:  # what it took stays claimed, not held: leftovers
            log.warning("could not put back the last join's jobs (%s): recovery does", exc)

    def _room(self) -> int:
        """How many more jobs may join: SLOTQ_MAX_BATCH jobs in all, and no more pixels than batching
        allows (each newcomer counted at the most images a job may ask)."""
        width, height = self.seats[0].request.width, self.seats[0].request.height
        held = sum(len(seat.flights) for seat in self.seats) * width * height
        free = batching.pixel_bound(self.settings, self.pipeline.capacity.pixels) - held
        fits = free // (width * height * 4)
        return min(self.settings.max_batch - len(self.seats), fits)

    def _finish(self, seats: list[Seat]) -> None:
        """Jobs past their last step: decode their images (one VAE call), out of the loop, ready to be
        handed over."""
        if not seats:
            return
        with self.pipeline.section():
            pixels = self.loop.decode([flight for seat in seats for flight in seat.flights])
        for seat in seats:
            mine, pixels = pixels[:len(seat.flights)], pixels[len(seat.flights):]
            made = images_of(np.stack(mine))
            if isinstance(made, JobFailedError):
                self._ended(seat, made)
                continue
            self.seats.remove(seat)
            self.cost -= records.cost_of(seat.job)
            rendered: Rendered = (seat.request, made)
            member = seat.member
            self.desk.let_go(member)  # its run is cleaned up by the finishing process
            self.done.append((member, Work.of(seat.job, member.execution, member.fence, rendered)))

    def _hand_over(self, wait: bool) -> None:
        """Hand the decoded jobs to the finishing process as one batch; without ``wait``, only if it
        is free (it finishes one batch at a time: the loop goes on rather than wait for it)."""
        if not self.done:
            return
        members, works = [member for member, _ in self.done], [work for _, work in self.done]
        now = time.perf_counter()
        # The running entry is cleared with the loop's last jobs only; each batch feeds the drain rate
        # with its cost and the slot time since the one before it.
        batch = Batch(works, "" if self.seats else self.running, sum(records.cost_of(m.job) for m in members),
                      now - self.slot_since, self.line)
        if self.desk.hand_over(members, batch, wait=wait):
            self.done, self.slot_since = [], now

    def _end(self, seat: Seat, error: Exception) -> None:
        """End one job before its last step (canceled, timed out, NaN); the others go on."""
        for flight in seat.flights:
            if flight in self.loop.running or flight in self.loop.paused:
                self.loop.cancel(flight)
        self._ended(seat, error)

    def _ended(self, seat: Seat, error: Exception) -> None:
        """Record a job's failure (or cancel), then let go of it: a failure that could not be recorded
        leaves it in the loop's seats, for the caller to hand to recovery."""
        self.desk.fail(seat.member, error)
        if seat in self.seats:
            self.seats.remove(seat)
        self.cost -= records.cost_of(seat.job)
        if not self.seats:
            estimates.clear_running(self.connection, self.line, self.desk.name)

    def _end_overflowed(self, seats: list[Seat]) -> None:
        """End each of these jobs whose latents hold NaN (one read of the device for all)."""
        if not seats:
            return
        flags = torch.stack([torch.isnan(flight.latents).any() for seat in seats for flight in seat.flights])
        overflowed = flags.tolist()
        for seat in seats:
            mine, overflowed = overflowed[:len(seat.flights)], overflowed[len(seat.flights):]
            if any(mine):
                self._end(seat, JobFailedError("nan_output", NAN_OUTPUT))

    def _drop_stale(self, seats: list[Seat]) -> None:
        """A report found a newer attempt at some of these jobs: find which, and drop them unwritten."""
        for seat in seats:
            try:
                with holding(seat.member.fence):
                    records.report_steps([seat.job], [seat.progress])
            except StaleAttemptError as exc:
                self._end(seat, exc)
            except RedisError:
                pass

    # --- preemption ----------------------------------------------------------------------------------

    def _preemption_due(self) -> bool:
        """Whether a job of a higher class has waited SLOTQ_PREEMPT_AFTER_S (negative: never)."""
        after = self.settings.preempt_after_s
        if after < 0 or self.priority == "high" or lifecycle.stopping.is_set():
            return False
        if sum(len(seat.flights) for seat in self.seats) > self.loop.max_paused - len(self.loop.paused):
            return False  # no room to keep their state: they finish first
        now = time.monotonic()
        if after > 0 and now - self.looked_above < min(after / 4, LOOK_ABOVE_EVERY_S):
            return False  # a round trip at every step would cost more than the wait it saves
        self.looked_above = now
        try:
            waited = waiting.waited_above(self.connection, self.line, self.priority)
        except RedisError as exc:
            log.warning("could not look for a higher class's job (%s): no preemption now", exc)
            return False
        return waited is not None and waited >= after

    def _preempt(self) -> None:
        """Pause every job in the loop, run the higher class's job as an execution of its own, then
        resume them where they stopped."""
        self._hand_over(wait=True)  # before the preempting execution's own
        paused, self.seats = self.seats, []
        for seat in paused:
            for flight in seat.flights:
                self.loop.pause(flight)
        self._mark_paused(paused, True)
        log.info("%d job(s) paused at a step boundary for a job of a higher class", len(paused))
        self._pausing(False)  # the preempting execution pauses for no one
        try:
            self.run_preempting(self.line)
        finally:
            for seat in paused:
                for flight in seat.flights:
                    self.loop.resume(flight)
            self.seats = paused
            self._pausing(True)
            try:
                with holding(*self._fences()), self.connection.pipeline(transaction=False) as pipe:
                    self.running = estimates.mark_running(pipe, self.line, self.desk.name, self.cost,
                                                          self.first.starts_at())
                    # Since the first job's start, which the preempting execution's time is part of:
                    # no step time from this entry.
                    self.stepped = None
                    pipe.execute()
            except (RedisError, StaleAttemptError) as exc:
                log.warning("could not mark the resumed jobs running: %s", exc)
            self._mark_paused(paused, False)
            self.slot_since = time.perf_counter()  # the preempting execution's time was its own

    def _pausing(self, pausing: bool) -> None:
        """Say whether this worker's running execution is this loop, which a higher class's job pauses
        after SLOTQ_PREEMPT_AFTER_S: that job's estimated start (its ETA, a deadline's admission) then
        does not wait for the loop's end."""
        if self.settings.preempt_after_s < 0 or (pausing and not self.seats):
            return
        try:
            if pausing:
                estimates.mark_pausing(self.connection, self.line, self.desk.name, self.priority,
                                       self.settings.preempt_after_s)
            else:
                estimates.clear_pausing(self.connection, self.line, self.desk.name)
        except RedisError as exc:  # an estimate the less: the loop goes on
            log.warning("could not note whether the loop pauses for a higher class: %s", exc)

    def _mark_paused(self, seats: list[Seat], paused: bool) -> None:
        """Say on each job whether it is paused (``GET /v1/jobs/<id>``: running, ``"paused": true``)."""
        for seat in seats:
            seat.job.meta["paused"] = paused
        try:
            with holding(*(seat.member.fence for seat in seats)):
                records.report_steps([seat.job for seat in seats], [seat.progress for seat in seats])
        except StaleAttemptError:
            self._drop_stale(seats)
        except RedisError as exc:
            log.warning("could not mark %d job(s) %s: %s", len(seats), "paused" if paused else "resumed", exc)

    # --- helpers -------------------------------------------------------------------------------------

    def _fences(self, seats: Sequence[Seat] | None = None) -> list[Fence]:
        return [seat.member.fence for seat in (self.seats if seats is None else seats)]

    def _offer_previews(self) -> None:
        """The first image's latents of jobs that asked for previews and are due one, those at the step
        of the first of them (the preview thread takes one offer at a time)."""
        wanted = [seat for seat in self.seats if seat.request.previews]
        due = [seat for seat in wanted if seat.previews.due(*seat.progress)]
        if not due:
            return
        step = due[0].progress[0]
        group = [seat for seat in due if seat.progress[0] == step]
        latents = torch.cat([seat.flights[0].latents for seat in group])
        width, height = group[0].request.width, group[0].request.height
        with holding(*self._fences(group)):  # each preview is written under its job's attempt
            self.pipeline.previewer.offer([seat.job for seat in group], step, latents, width, height)


