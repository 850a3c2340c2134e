"""What `specdraft serve` sets besides the models: `ServerSettings`, and `CrossRequestMemory` (who shares what the
server remembers across requests)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from specdraft.batch_engine import DEFAULT_PREFIX_CACHE_BYTES
from specdraft.errors import SpecdraftError


class CrossRequestMemory(str, Enum):
    """Who shares what the server remembers across requests (the prefix cache, the `suffix` drafter's corpus), which
    `usage.prompt_tokens_details.cached_tokens`, the tokens' `kinds` and the time to the first token let a client
    probe. A request's `cache_salt` partitions it further in `shared` and `key`."""

    shared = "shared"  # every request (of the same cache_salt)
    key = "key"  # requests sent with the same API key (of the same cache_salt)
    off = "off"  # nobody: no prefix cache, and the drafters remember no earlier request


@dataclass
class ServerSettings:
    """What `specdraft serve` sets besides the models: names, limits, the keys (`api_key`: one, or several separated
    by commas), who shares cross-request memory."""

    served_model: str
    api_key: str | None = None
    max_queue: int = 64
    request_timeout: float = 600.0
    default_max_tokens: int = 256
    shutdown_grace: float = 10.0
    seed: int | None = None  # seeds the seeds of requests that give none; None: each drawn from the OS
    max_body_bytes: int = 2 << 20  # a larger request body is refused (413) before it is read
    max_batch: int = 1  # sequences generating together (continuous batching); 1: one request at a time
    kv_budget: int | None = None  # bytes of KV cache the batch's sequences may reserve together; None: unbounded
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # rows of prompts read before, kept for their prefixes; 0: none
    cross_request_memory: CrossRequestMemory = CrossRequestMemory.shared

    def __post_init__(self) -> None:
        try:
            self.cross_request_memory = CrossRequestMemory(self.cross_request_memory)
        except ValueError:
            modes = ", ".join(mode.value for mode in CrossRequestMemory)
            raise SpecdraftError(f"--cross-request-memory must be one of {modes}, got {self.cross_request_memory!r}."
                                 ) from None
        if self.api_key is not None and not self.api_keys():
            raise SpecdraftError("--api-key holds no key; give one, or several separated by commas.")

    def api_keys(self) -> list[str]:
        """The keys a client may send (none: the server is open)."""
        return [key.strip() for key in (self.api_key or "").split(",") if key.strip()]

    @property
    def remembers(self) -> bool:
        """Whether anything is remembered across requests at all."""
        return self.cross_request_memory != CrossRequestMemory.off
