"""The engine thread with continuous batching: queued requests step together on a `BatchedDecoder`.

Between steps, queued jobs join while the batch has room (each choice of `n` is a sequence of its own; room: a
free place and the cache its budget can fill within the KV budget, all choices of a job or none), and
sequences whose client went away or whose request ran past its timeout leave; a finished sequence leaves by
itself. Each step's events go back to their jobs as `Step`s, and a job whose choices have all finished gets its
`Finished`. A sequence the batch fails (its join or its step raised: `BatchedDecoder.take_failed`) ends its job with
the error, a 500 naming it where it is a bug; the other jobs and the engine thread go on. The queue in front, its
429s, shutdown and the result channel are `Worker`'s.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass, field
from functools import reduce

from specdraft.batch_engine import DEFAULT_PREFIX_CACHE_BYTES, BatchedDecoder, BatchRequest, NoRoom, OverBudget
from specdraft.errors import SpecdraftError
from specdraft.server.decoders import DecoderPool
from specdraft.server.errors import ApiError
from specdraft.server.metrics import Metrics
from specdraft.server.worker import Failed, Finished, Job, Step, Worker, timeout_error
from specdraft.stats import GenerationStats

log = logging.getLogger("specdraft.server")


@dataclass
class _Admitted:
    """A job in the batch: its sequence ids by choice, and the statistics each choice fills in."""

    job: Job
    idents: list[int]
    stats: list[GenerationStats]
    left: set[int] = field(default_factory=set)  # sequence ids still generating


def internal_error(error: Exception) -> ApiError:
    """The 500 of a request a bug failed, naming the error (its traceback goes to the log)."""
    return ApiError(500, f"The server failed on this request ({type(error).__name__}: {error}); this is a bug, "
                         "please report it.", code="internal_error")


class BatchWorker(Worker):
    """Runs queued jobs together, up to `max_batch` sequences at a time within `kv_budget` bytes of cache (module
    doc)."""

    def __init__(self, pool: DecoderPool, metrics: Metrics | None = None, max_queue: int = 64,
                 timeout: float = 600.0, max_batch: int = 8, kv_budget: int | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        super().__init__(pool, metrics, max_queue=max_queue, timeout=timeout)
        self.batch = BatchedDecoder(pool.target, None, max_batch=max_batch, kv_budget=kv_budget,
                                    tree_budget=pool.tree_budget, tree_branch=pool.tree_branch,
                                    prefix_cache_bytes=prefix_cache_bytes)
        self._admitted: dict[int, _Admitted] = {}  # by sequence id
        self._waiting: Job | None = None  # taken from the queue, waiting for room in the batch

    @property
    def running(self) -> int:
        """Sequences generating now (or reading their prompt to)."""
        return self.batch.size

    def _jobs(self) -> list[_Admitted]:
        """The jobs in the batch, each once (a job of n choices holds n sequence ids)."""
        return list({id(admitted): admitted for admitted in self._admitted.values()}.values())

    def _cancel_running(self) -> None:
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
                    if not admitted.left:
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
            if choices > self.batch.max_batch:
                job.put(Failed(ApiError(400, f"n={choices} asks for more sequences than the server batches "
                                             f"({self.batch.max_batch}); ask for fewer.", param="n")))
                self._waiting = None
                continue
            if self.batch.size + choices > self.batch.max_batch or not self._start(job):
                self._waiting = job  # a later step frees room
                return stopping
            self._waiting = None
        return stopping

    def _start(self, job: Job) -> bool:
        """Add the job's choices to the batch; False when they do not all fit now (none is added then: the job
        waits). A job that could never fit, or fails to join, ends here with its error."""
        generation = job.generation
        key = generation.decoder
        admitted = _Admitted(job, [], [])
        try:
            make = self.pool.drafter_factory(key)
            for sampling in generation.samplings:
                ident = self.batch.add(BatchRequest(generation.prompt_ids, sampling, generation.max_tokens,
                                                    generation.stop, make_drafter=make,
                                                    k=key.k if isinstance(key.k, int) and key.k > 0 else None,
                                                    logprobs=generation.logprobs, constraint=generation.constraint,
                                                    cache_salt=generation.cache_salt))
                admitted.idents.append(ident)
                admitted.left.add(ident)
                admitted.stats.append(self.batch.stats(ident))
                self._admitted[ident] = admitted
        except NoRoom as error:
            for ident in admitted.idents:
                self.batch.cancel(ident)
                self._admitted.pop(ident, None)
            if self.batch.size:
                return False
            choices = len(generation.samplings)  # alone in the batch and still no room: it never fits
            self._end(_Admitted(job, [], []), Failed(ApiError(
                400, f"n={choices} choices of this prompt and max_tokens do not fit the server's KV budget "
                     f"together ({error}); ask for fewer choices or fewer tokens.", param="n")))
        except OverBudget as error:
            self._refuse(admitted, error, param="max_tokens")
        except Exception as error:  # e.g. a drafter the batch cannot run
            self._refuse(admitted, error, param="speculative")
        return True

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
