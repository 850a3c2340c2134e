"""A request checked and made ready for the engine: prompt ids, one sampling per choice, budget, stops, decoder.

Everything a user can get wrong is an `ApiError` (4xx) here, before the request is queued.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from specdraft.constraints import Constraint
from specdraft.constraints.grammar_state import check_constraint
from specdraft.run import MAX_TOP_LOGPROBS
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams
from specdraft.server.decoders import DecoderKey, DecoderPool
from specdraft.server.errors import ApiError
from specdraft.server.schemas import (MAX_STOP_LENGTH, MAX_STOPS, ChatCompletionRequest, CompletionRequest,
                                      ResponseFormat)
from specdraft.text import encode_messages, encode_prompt


MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' limit, as in OpenAI's API


@dataclass
class Generation:
    """One checked request: what the engine thread runs and how the answer is shaped."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str
    prompt_ids: list[int]
    samplings: list[SamplingParams]  # one per choice: the request's seed, seed + 1, ...
    seed: int  # the request's seed, or the one drawn for it (the response reports it)
    max_tokens: int
    stop: list[str]
    decoder: DecoderKey
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # alternatives per token returned with its log-probability; None: none
    constraint: Constraint | None = None  # what the answer must match (`response_format`)
    cache_salt: str = ""  # the partition of the server's cross-request memory this request reads and adds to


def _bad(error: SpecdraftError | str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, str(error), param=param, code=code)


def _chat_prompt(request: ChatCompletionRequest, tokenizer) -> list[int]:
    # Chat templates know system / user / assistant; OpenAI's newer "developer" is the system role.
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in request.messages]
    try:
        return encode_messages(tokenizer, messages)
    except TemplateError as error:
        raise _bad(f"The model's chat template refused these messages: {error}", param="messages") from None


def _completion_prompt(request: CompletionRequest, tokenizer) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise _bad(f"Send one prompt per request (got {len(prompt)}); use n for several completions.",
                       param="prompt")
        prompt = prompt[0]
    if not prompt or isinstance(prompt, str) and not prompt.strip():
        raise _bad("The prompt is empty; give some text or token ids.", param="prompt")
    return encode_prompt(tokenizer, prompt, chat=False) if isinstance(prompt, str) else list(prompt)


def _logprobs(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    """Alternatives per token the request wants with its log-probabilities (None: no log-probabilities)."""
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise _bad("top_logprobs needs logprobs: true.", param="top_logprobs")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _bad(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {request.top_logprobs}.",
                       param="top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise _bad(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {request.logprobs}.",
                   param="logprobs")
    return request.logprobs


def _constraint(response_format: ResponseFormat | None, target) -> Constraint | None:
    """The constraint `response_format` asks for, checked against the target's tokenizer (None: any text)."""
    if response_format is None or response_format.type == "text":
        fields = [] if response_format is None else [name for name in ("json_schema", "regex", "grammar")
                                                      if getattr(response_format, name) is not None]
        if fields:
            raise _bad(f"response_format of type text takes no {fields[0]}; set type to {fields[0]}.",
                       param="response_format")
        return None
    kind = response_format.type
    given = {name: getattr(response_format, name) for name in ("json_schema", "regex", "grammar")}
    extra = [name for name, value in given.items() if value is not None and name != kind]
    if extra:
        raise _bad(f"response_format of type {kind} takes no {extra[0]}.", param="response_format")
    if kind != "json_object" and given[kind] is None:
        raise _bad(f"response_format of type {kind} needs its {kind} field.", param="response_format")
    try:
        constraint = (Constraint.json_object() if kind == "json_object" else
                      Constraint.json_schema(given[kind].json_schema) if kind == "json_schema" else
                      Constraint.regex(given[kind]) if kind == "regex" else Constraint.grammar(given[kind]))
        check_constraint(constraint, target)
    except SpecdraftError as error:
        raise _bad(error, param="response_format") from None
    return constraint


def _stops(request: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """The request's stop strings, at most MAX_STOPS of at most MAX_STOP_LENGTH characters."""
    stops = request.stop_strings()
    if len(stops) > MAX_STOPS:
        raise _bad(f"At most {MAX_STOPS} stop strings, got {len(stops)}.", param="stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_LENGTH:
        raise _bad(f"A stop string may be at most {MAX_STOP_LENGTH} characters long, got one of {longest}; "
                   "shorten it.", param="stop")
    return stops


def _decoder(request: ChatCompletionRequest | CompletionRequest, pool: DecoderPool, cache_salt: str) -> DecoderKey:
    """The decoder the request's `speculative` settings ask for, a fixed k at most the server's `max_k`."""
    speculative = request.speculative
    k = speculative.k if speculative else None
    if isinstance(k, int) and k > pool.max_k:
        raise _bad(f"speculative.k may be at most {pool.max_k} on this server, got {k}; ask for fewer draft tokens "
                   "per step or 'auto' (the server's --max-k sets the limit).", param="speculative.k")
    try:
        return pool.resolve(speculative.drafter if speculative else None, k, cache_salt)
    except SpecdraftError as error:
        raise _bad(error, param="speculative") from None


def prepare(request: ChatCompletionRequest | CompletionRequest, pool: DecoderPool, served_model: str,
            default_max_tokens: int, seeds: random.Random, tenant: str = "") -> Generation:
    """Check `request` against the loaded models and turn it into a `Generation` (ApiError otherwise). A request
    without a seed gets the next of `seeds`; `tenant` is the part of the server's cross-request memory its client
    shares (its `cache_salt` partitions it further)."""
    if request.model != served_model:
        raise ApiError(404, f"The model {request.model!r} does not exist here; this server serves "
                            f"{served_model!r} (GET /v1/models).", param="model", code="model_not_found")
    if request.stream_options is not None and not request.stream:
        raise _bad("stream_options is only allowed with stream: true.", param="stream_options")
    chat = isinstance(request, ChatCompletionRequest)
    logprobs = _logprobs(request)
    target = pool.target
    try:
        prompt_ids = _chat_prompt(request, target.tokenizer) if chat else _completion_prompt(request, target.tokenizer)
    except SpecdraftError as error:
        raise _bad(error, param="messages" if chat else "prompt") from None
    vocab = target.vocab_size
    if not prompt_ids:
        raise _bad("The prompt has no tokens; give some text or token ids.", param="messages" if chat else "prompt")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise _bad(f"Prompt token ids must lie in [0, {vocab}); got one outside.", param="prompt")

    room = target.max_context - len(prompt_ids)
    asked = (request.max_completion_tokens or request.max_tokens) if chat else request.max_tokens
    max_tokens = asked if asked is not None else min(default_max_tokens, room)
    if max_tokens > room or room < 1:
        raise _bad(f"The prompt has {len(prompt_ids)} tokens and {max_tokens} more were asked for, but the model "
                   f"holds {target.max_context} in all; shorten the prompt or lower max_tokens.",
                   param="messages" if chat else "prompt", code="context_length_exceeded")

    stops = _stops(request)
    seed = request.seed if request.seed is not None else seeds.randrange(2**31)
    try:
        samplings = [SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                    min_p=request.min_p, repetition_penalty=request.repetition_penalty,
                                    seed=seed + i) for i in range(request.n)]
    except SpecdraftError as error:
        raise _bad(error) from None
    constraint = _constraint(request.response_format, target)
    cache_salt = tenant if request.cache_salt is None else f"{tenant}:{request.cache_salt}"
    return Generation(chat=chat, model=served_model, prompt_ids=prompt_ids, samplings=samplings, seed=seed,
                      max_tokens=max_tokens, stop=stops, decoder=_decoder(request, pool, cache_salt),
                      stream=request.stream,
                      include_usage=bool(request.stream_options and request.stream_options.include_usage),
                      logprobs=logprobs, constraint=constraint, cache_salt=cache_salt)

