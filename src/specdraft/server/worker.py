"""The bounded queue in front of the engine and the one thread that runs it.

The models are not thread-safe, so one generation runs at a time on the engine thread;
requests wait in a queue of bounded length (full: 429 with Retry-After). Between steps the
engine thread checks whether the request was cancelled (its client went away, the server
is shutting down) or ran past its timeout, and stops there. Results travel back to the
event loop through an asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from functools import reduce

from specdraft.run import StepEvent
from specdraft.errors import SpecdraftError
from specdraft.kernels import openmp
from specdraft.server.decoders import DecoderPool
from specdraft.server.errors import ApiError
from specdraft.server.metrics import Metrics
from specdraft.server.prepare import Generation
from specdraft.stats import GenerationStats

log = logging.getLogger("specdraft.server")


@dataclass
class Step:
    """One engine step of choice `index`; `depth` is how deep its draft went (a chain: k)."""

    index: int
    event: StepEvent
    depth: int


@dataclass
class Finished:
    """Every choice is done; `stats` sums them."""

    stats: GenerationStats


@dataclass
class Failed:
    """The generation stopped with an error (before or after its first step)."""

    error: ApiError


def timeout_error(timeout: float) -> ApiError:
    """The 504 of a request that ran past the server's timeout (waiting included)."""
    return ApiError(504, f"The request ran past the server's timeout of {timeout:g} s; ask for fewer tokens or "
                         "retry when the server is less busy.", code="timeout")


class Job:
    """A queued generation and the channel its results come back on (to the event loop that submitted it)."""

    def __init__(self, generation: Generation, timeout: float, loop: asyncio.AbstractEventLoop) -> None:
        self.generation = generation
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.results: asyncio.Queue[Step | Finished | Failed] = asyncio.Queue()
        self._loop = loop
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the engine thread to stop this generation at its next step (or skip it if still queued)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def expired(self) -> bool:
        """Whether the request ran past its timeout."""
        return time.monotonic() > self.deadline

    def put(self, item: Step | Finished | Failed) -> None:
        """Hand a result to the event loop (from the engine thread); a loop already gone cancels the job."""
        try:
            self._loop.call_soon_threadsafe(self.results.put_nowait, item)
        except RuntimeError:  # the event loop closed: nobody is listening any more
            self.cancel()


class Worker:
    """Runs queued jobs one at a time on its own thread, over the decoders of `pool`."""

    def __init__(self, pool: DecoderPool, metrics: Metrics | None = None, max_queue: int = 64,
                 timeout: float = 600.0) -> None:
        if max_queue < 1:
            raise SpecdraftError(f"--max-queue must be >= 1, got {max_queue}.")
        if not timeout > 0:
            raise SpecdraftError(f"--request-timeout must be > 0 seconds, got {timeout}.")
        self.pool, self.metrics, self.timeout = pool, metrics, timeout
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._accepting = False
        self._running: Job | None = None
        self._mean_job_seconds = 1.0  # running mean, for Retry-After
        self._thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the engine (not counting the one it runs)."""
        return self._queue.qsize()

    @property
    def running(self) -> int:
        """1 while the engine generates, else 0."""
        return int(self._running is not None)

    def start(self) -> None:
        # the models were loaded on this thread: its idle OpenMP pool would make the engine's workers sleep
        # between parallel regions (kernels/openmp.py)
        openmp.release_thread_pool()
        self._accepting = True
        self._thread.start()

    def _refusal(self) -> ApiError:
        """The 429 (with Retry-After) of a request that finds the queue full."""
        wait = math.ceil(self._mean_job_seconds * (self.queue_depth + 1))
        return ApiError(429, f"Too many requests waiting ({self.queue_depth}); retry in about {wait} s.",
                        code="queue_full", headers={"Retry-After": str(max(1, wait))})

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise ApiError(503, "The server is shutting down; retry against another instance or later.",
                           code="shutting_down")

    def check_room(self) -> None:
        """What `submit` would answer now, asked before a request is read, parsed and tokenized (work a full queue
        would waste): ApiError 429 when the queue is full, 503 when stopping."""
        self._check_accepting()
        if self._queue.full():
            raise self._refusal()

    def submit(self, generation: Generation, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue `generation`; ApiError 429 (with Retry-After) when the queue is full, 503 when stopping."""
        job = Job(generation, self.timeout, loop)
        with self._lock:
            self._check_accepting()
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise self._refusal() from None
        return job

    def stop(self, grace: float) -> None:
        """Stop accepting, fail the queued jobs (503), let the running one finish for up to `grace`
        seconds, then cancel it at its next step and wait for the thread."""
        with self._lock:
            self._accepting = False
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.put(Failed(ApiError(503, "The server shut down before this request ran; retry later.",
                                            code="shutting_down")))
            self._queue.put_nowait(None)  # wakes the thread and tells it to end
        if not self._thread.is_alive():
            return
        self._thread.join(grace)
        self._cancel_running()
        self._thread.join()

    def _cancel_running(self) -> None:
        """Ask what the engine runs now to stop at its next step (shutdown, past the grace period)."""
        running = self._running
        if running is not None:
            running.cancel()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled:
                continue
            if job.expired:
                job.put(Failed(timeout_error(job.timeout)))
                continue
            self._running = job
            started = time.monotonic()
            try:
                self._execute(job)
            except SpecdraftError as error:  # e.g. a trained drafter without its file for this target
                job.put(Failed(ApiError(400, str(error), param="speculative")))
            except Exception:  # a bug: keep serving, tell the client, keep the traceback in the log
                log.exception("generation failed")
                job.put(Failed(ApiError(500, "The server failed while generating; this is a bug, please report it.",
                                        code="internal_error")))
            finally:
                self._running = None
                self._mean_job_seconds = 0.8 * self._mean_job_seconds + 0.2 * (time.monotonic() - started)

    def _execute(self, job: Job) -> None:
        generation = job.generation
        decoder = self.pool.decoder(generation.decoder)
        choices: list[GenerationStats] = []  # filled as the engine goes, so a stopped job still counts
        try:
            for index, sampling in enumerate(generation.samplings):
                stats = GenerationStats()
                choices.append(stats)
                events = decoder.stream(generation.prompt_ids, sampling, generation.max_tokens, generation.stop,
                                        stats=stats, logprobs=generation.logprobs, constraint=generation.constraint,
                                        cache_salt=generation.cache_salt)
                with closing(events):  # closing ends the drafter's request even when stopped early
                    for event in events:
                        job.put(Step(index, event, stats.depth_per_step[-1] if event.drafted else 0))
                        if job.cancelled:
                            return
                        if job.expired:
                            job.put(Failed(timeout_error(job.timeout)))
                            job.cancel()
                            return
            job.put(Finished(reduce(GenerationStats.merge, choices)))
        finally:
            if self.metrics is not None and choices:
                self.metrics.record_generation(reduce(GenerationStats.merge, choices))
                if job.cancelled:
                    self.metrics.record_cancelled()
