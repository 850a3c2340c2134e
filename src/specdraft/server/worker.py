"""The one engine thread, with continuous batching, and the bounded queue in front of it.

The models are not thread-safe, so one thread runs them: queued requests step together on a `BatchedDecoder` (up to
`--max-batch` sequences; with 1, one request at a time, as a batch of one). Requests wait in a queue of bounded
length (full: 429 with Retry-After). Between steps, queued jobs join while the batch has room (each choice of `n` is
a sequence of its own; room: a free place and the cache its budget can fill within the KV budget, all choices of a
job or none; with `--max-batch 1` they join one after another), and sequences whose client went away (or the server is shutting down) or whose request ran past its
timeout leave; a finished sequence leaves by itself. Each step's events go back to their jobs as `Step`s, through
an asyncio queue per request, and a job whose choices have all finished gets its `Finished`. A sequence the batch
fails (its join or its step raised: `BatchedDecoder.take_failed`) ends its job with the error, a 500 naming it where
it is a bug; the other jobs and the engine thread go on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import reduce
from typing import Callable

from specdraft.batch_engine import DEFAULT_PREFIX_CACHE_BYTES, BatchedDecoder, BatchRequest, NoRoom, OverBudget
from specdraft.drafters.base import Drafter
from specdraft.errors import SpecdraftError
from specdraft.kernels import openmp
from specdraft.run import StepEvent
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


@dataclass
class _Admitted:
    """A job in the batch: its sequence ids by choice, and the statistics each choice fills in."""

    job: Job
    idents: list[int]
    stats: list[GenerationStats]
    left: set[int] = field(default_factory=set)  # sequence ids still generating
    later: int = 0  # choices still to join, one at a time (`--max-batch 1`)
    make_drafter: Callable[[], Drafter] | None = None  # its sequences' drafters


def internal_error(error: Exception) -> ApiError:
    """The 500 of a request a bug failed, naming the error (its traceback goes to the log)."""
    return ApiError(500, f"The server failed on this request ({type(error).__name__}: {error}); this is a bug, "
                         "please report it.", code="internal_error")


class Worker:
    """Runs queued jobs together on its own thread, up to `max_batch` sequences at a time within `kv_budget` bytes of
    cache (module doc), over the models and speculation settings of `pool`."""

    def __init__(self, pool: DecoderPool, metrics: Metrics | None = None, max_queue: int = 64,
                 timeout: float = 600.0, max_batch: int = 8, kv_budget: int | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        if max_queue < 1:
            raise SpecdraftError(f"--max-queue must be >= 1, got {max_queue}.")
        if not timeout > 0:
            raise SpecdraftError(f"--request-timeout must be > 0 seconds, got {timeout}.")
        self.pool, self.metrics, self.timeout = pool, metrics, timeout
        self.batch = BatchedDecoder(pool.target, None, max_batch=max_batch, kv_budget=kv_budget,
                                    tree_budget=pool.tree_budget, tree_branch=pool.tree_branch,
                                    prefix_cache_bytes=prefix_cache_bytes)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._accepting = False
        self._admitted: dict[int, _Admitted] = {}  # by sequence id
        self._waiting: Job | None = None  # taken from the queue, waiting for room in the batch
        self._thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the engine (not counting those it runs)."""
        return self._queue.qsize()

    @property
    def running(self) -> int:
        """Sequences generating now (or reading their prompt to)."""
        return self.batch.size

    def start(self) -> None:
        # the models were loaded on this thread: its idle OpenMP pool would make the engine's workers sleep
        # between parallel regions (kernels/openmp.py)
        openmp.release_thread_pool()
        self._accepting = True
        self._thread.start()

    def _refusal(self) -> ApiError:
        """The 429 (with Retry-After: a second for each request waiting, this one too) of a request that finds the
        queue full."""
        wait = self.queue_depth + 1
        return ApiError(429, f"Too many requests waiting ({self.queue_depth}); retry in about {wait} s.",
                        code="queue_full", headers={"Retry-After": str(wait)})

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

    def _jobs(self) -> list[_Admitted]:
        """The jobs in the batch, each once (a job of n choices holds n sequence ids)."""
        return list({id(admitted): admitted for admitted in self._admitted.values()}.values())

    def _cancel_running(self) -> None:
        """Ask what the engine runs now to stop at its next step (shutdown, past the grace period)."""
        for admitted in self._jobs():
            admitted.job.cancel()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while True:
            stopping = self._admit_waiting(stopping)
            if stopping and self._waiting is not None:  # it will not get room now
                self._waiting.put(Failed(ApiError(503, "The server shut down before this request ran; retry later.",
                                                  code="shutting_down")))
                self._waiting = None
            if not self.batch.size:
                if stopping:
                    return
                continue
            try:
                events = self.batch.step()
            except Exception as error:  # a bug the batch pinned on no sequence: fail what runs, keep serving
                log.exception("batched step failed")
                for admitted in self._jobs():
                    self._end(admitted, Failed(internal_error(error)))
                continue
            step = self.batch.last_step
            if self.metrics is not None and step is not None:
                self.metrics.record_batch_step(step.sequences, step.drafted, step.committed, step.seconds, step.width,
                                                step.pass_seconds)
            for ident, event in events:
                admitted = self._admitted[ident]
                admitted.job.put(Step(admitted.idents.index(ident), event, event.drafted))
                if event.finish_reason is not None:
                    admitted.left.discard(ident)
                    if admitted.later and not admitted.left:  # its next choice takes the room it left
                        self._join_next(admitted)
                    elif not admitted.left:
                        self._end(admitted, Finished(reduce(GenerationStats.merge, admitted.stats)))
            # after the events: a job whose choice failed may have another's event in this step
            for ident, error in self.batch.take_failed():  # joins and steps that failed
                if ident in self._admitted:
                    self._refuse(self._admitted[ident], error)
            for admitted in self._jobs():
                if admitted.job.cancelled:
                    self._end(admitted, None)
                elif admitted.job.expired:
                    self._end(admitted, Failed(timeout_error(admitted.job.timeout)))

    def _admit_waiting(self, stopping: bool) -> bool:
        """Let queued jobs join while they fit (blocking for one when the batch is idle); returns whether the
        queue has said to stop."""
        while not stopping:
            job = self._waiting
            if job is None:
                try:
                    job = self._queue.get(block=not self.batch.size)
                except queue.Empty:
                    return stopping
                if job is None:
                    return True
            if job.cancelled:
                self._waiting = None
                continue
            if job.expired:
                job.put(Failed(timeout_error(job.timeout)))
                self._waiting = None
                continue
            choices = len(job.generation.samplings)
            if choices > self.batch.max_batch > 1:
                job.put(Failed(ApiError(400, f"n={choices} asks for more sequences than the server batches "
                                             f"({self.batch.max_batch}); ask for fewer.", param="n")))
                self._waiting = None
                continue
            if self.batch.size + min(choices, self.batch.max_batch) > self.batch.max_batch or not self._start(job):
                self._waiting = job  # a later step frees room
                return stopping
            self._waiting = None
        return stopping

    def _start(self, job: Job) -> bool:
        """Add the job's choices to the batch (with `--max-batch 1` the first, the others one after another as each
        finishes: `_join_next`); False when they do not all fit now (none is added then: the job waits). A job that
        could never fit, or fails to join, ends here with its error."""
        choices = len(job.generation.samplings)
        admitted = _Admitted(job, [], [], later=choices - min(choices, self.batch.max_batch))
        try:
            admitted.make_drafter = self.pool.drafter_factory(job.generation.decoder)
            for _ in range(choices - admitted.later):
                self._add_choice(admitted)
        except NoRoom as error:
            for ident in admitted.idents:
                self.batch.cancel(ident)
                self._admitted.pop(ident, None)
            if self.batch.size:
                return False
            # alone in the batch and still no room: it never fits
            self._end(_Admitted(job, [], []), Failed(ApiError(
                400, f"n={choices} choices of this prompt and max_tokens do not fit the server's KV budget "
                     f"together ({error}); ask for fewer choices or fewer tokens.", param="n")))
        except OverBudget as error:
            self._refuse(admitted, error, param="max_tokens")
        except Exception as error:  # e.g. a drafter the batch cannot run
            self._refuse(admitted, error, param="speculative")
        return True

    def _add_choice(self, admitted: _Admitted) -> None:
        """Add the job's next choice to the batch as a sequence of its own."""
        generation, key = admitted.job.generation, admitted.job.generation.decoder
        sampling = generation.samplings[len(admitted.idents)]
        ident = self.batch.add(BatchRequest(generation.prompt_ids, sampling, generation.max_tokens, generation.stop,
                                            make_drafter=admitted.make_drafter,
                                            k=key.k if isinstance(key.k, int) and key.k > 0 else None,
                                            logprobs=generation.logprobs, constraint=generation.constraint,
                                            cache_salt=generation.cache_salt))
        admitted.idents.append(ident)
        admitted.left.add(ident)
        admitted.stats.append(self.batch.stats(ident))
        self._admitted[ident] = admitted

    def _join_next(self, admitted: _Admitted) -> None:
        """The job's next choice joins in the room its last one left (one sequence at a time: `--max-batch 1`)."""
        admitted.later -= 1
        try:
            self._add_choice(admitted)
        except Exception as error:  # as its first choice joined, it fits: a drafter the batch cannot run, a bug
            self._refuse(admitted, error, param="speculative")

    def _refuse(self, admitted: _Admitted, error: Exception, param: str | None = None) -> None:
        """A job that failed to join, or whose sequence failed a step, ends: a user's mistake (SpecdraftError, about
        `param`) is a 400; anything else is a bug, logged, a 500 naming it for this request alone (the others and
        the engine thread go on)."""
        if isinstance(error, SpecdraftError):
            self._end(admitted, Failed(ApiError(400, str(error), param=param)))
            return
        log.error("a request in the batch failed", exc_info=error)
        self._end(admitted, Failed(internal_error(error)))

    def _end(self, admitted: _Admitted, result: Finished | Failed | None) -> None:
        """A job leaves the batch (its sequences still running stop) with `result` (None: cancelled, nobody
        listens); its statistics go to the metrics."""
        for ident in admitted.idents:
            self.batch.cancel(ident)
            self._admitted.pop(ident, None)
        if result is not None:
            admitted.job.put(result)
        if self.metrics is not None and admitted.stats:
            self.metrics.record_generation(reduce(GenerationStats.merge, admitted.stats))
            if result is None or isinstance(result, Failed):
                self.metrics.record_cancelled()
