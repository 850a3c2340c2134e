"""OpenAI response bodies and stream chunks, with this server's extensions.

Each stream chunk carries `"specdraft": {"kinds", "pieces", "drafted", "accepted", "depth"}`:
what happened to each token of the step (accepted / recovered / bonus / target), the text
each adds, and the step's draft counts. `usage` carries the speculation statistics. `logprobs`, when
asked for, are the target's own log-probabilities (before temperature, top-k and top-p). Every response object and
stream chunk carries `"seed"`: the request's own, or the one the server drew for it (choice i sampled with seed + i),
so sending it back as `seed` samples the same answer again (in a batch: with a fixed `speculative.k`).
"""

from __future__ import annotations

import json
import time
import uuid

from specdraft.run import StepEvent
from specdraft.server.prepare import Generation
from specdraft.server.worker import Step
from specdraft.stats import GenerationStats


class ResponseShape:
    """The id, timestamp and object names of one response (chat or text completion)."""

    def __init__(self, generation: Generation, tokenizer=None) -> None:
        self.generation, self.tokenizer = generation, tokenizer
        self.id = ("chatcmpl-" if generation.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._started: set[int] = set()  # choices whose first chunk went out (chat: it carries the role)
        self._text_offsets: dict[int, int] = {}  # completions' logprobs: each choice's text so far, in characters

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _logprobs(self, index: int, events: list[StepEvent]) -> dict | None:
        """OpenAI's `logprobs` object for the tokens of `events` (None when the request asked for none)."""
        if self.generation.logprobs is None:
            return None
        tokens = [self._token(t) for event in events for t in event.token_ids]
        values = [lp for event in events for lp in event.logprobs]
        alternatives = [[(self._token(t), lp) for t, lp in alts] for event in events for alts in event.top_logprobs]
        if self.generation.chat:
            def entry(token: str, logprob: float) -> dict:
                # A token that ends inside a character decodes to U+FFFD alone: no faithful bytes then.
                return {"token": token, "logprob": logprob, "bytes": None if "\ufffd" in token else list(token.encode())}
            return {"content": [{**entry(token, value), "top_logprobs": [entry(t, lp) for t, lp in alts]}
                                for token, value, alts in zip(tokens, values, alternatives)], "refusal": None}
        offsets = []
        for token in tokens:
            offsets.append(self._text_offsets.get(index, 0))
            self._text_offsets[index] = offsets[-1] + len(token)
        return {"tokens": tokens, "token_logprobs": values, "text_offset": offsets,
                # Texts that collide (tokens decoding to the same string) keep the likelier one.
                "top_logprobs": [dict(reversed(alts)) for alts in alternatives] if self.generation.logprobs else None}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.generation.model,
                "seed": self.generation.seed, "choices": choices}

    def usage(self, stats: GenerationStats) -> dict:
        """OpenAI's token counts plus the speculation statistics of every choice together."""
        prompt = len(self.generation.prompt_ids)
        # `stats` sums the choices: each of n reads the prompt (the later ones from the first's cached rows), and
        # the prompt counts once, so what this request did not read is the prompt less all that its choices read
        unread = max(0, prompt - (stats.prompt_tokens - stats.cached_prompt_tokens))
        return {"prompt_tokens": prompt, "completion_tokens": stats.new_tokens,
                "total_tokens": prompt + stats.new_tokens,
                "prompt_tokens_details": {"cached_tokens": unread},
                "steps": stats.steps, "drafted": stats.drafted,
                "accepted": stats.accepted, "acceptance_rate": stats.acceptance_rate,
                "mean_committed_per_step": stats.mean_committed_per_step,
                "accepted_at": list(stats.accepted_at), "drafted_at": list(stats.drafted_at),
                "tokens_per_second": stats.tokens_per_second, "forced_tokens": stats.forced_tokens,
                "drafter": self.generation.decoder.drafter, "k": self.generation.decoder.k}

    def chunk(self, step: Step) -> dict:
        """The stream chunk of one engine step."""
        event = step.event
        if self.generation.chat:
            delta = {"content": event.text}
            if step.index not in self._started:
                delta = {"role": "assistant", **delta}
            choice = {"index": step.index, "delta": delta, "logprobs": self._logprobs(step.index, [event]),
                      "finish_reason": event.finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": step.index, "text": event.text, "logprobs": self._logprobs(step.index, [event]),
                      "finish_reason": event.finish_reason}
            obj = "text_completion"
        self._started.add(step.index)
        body = self._envelope(obj, [choice])
        body["specdraft"] = {"kinds": event.kinds, "pieces": event.pieces, "drafted": event.drafted,
                             "accepted": event.accepted, "depth": step.depth}
        return body

    def usage_chunk(self, stats: GenerationStats) -> dict:
        """The last chunk when the client asked for `stream_options.include_usage`."""
        body = self._envelope("chat.completion.chunk" if self.generation.chat else "text_completion", [])
        body["usage"] = self.usage(stats)
        return body

    def complete(self, steps: list[Step], stats: GenerationStats) -> dict:
        """The whole (non-streamed) response from every step of every choice."""
        texts = [""] * len(self.generation.samplings)
        finishes = ["length"] * len(texts)
        events: list[list[StepEvent]] = [[] for _ in texts]
        for step in steps:
            texts[step.index] += step.event.text
            finishes[step.index] = step.event.finish_reason or finishes[step.index]
            events[step.index].append(step.event)
        logprobs = [self._logprobs(i, choice_events) for i, choice_events in enumerate(events)]
        if self.generation.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs[i],
                        "finish_reason": finish} for i, (text, finish) in enumerate(zip(texts, finishes))]
            body = self._envelope("chat.completion", choices)
        else:
            choices = [{"index": i, "text": text, "logprobs": logprobs[i], "finish_reason": finish}
                       for i, (text, finish) in enumerate(zip(texts, finishes))]
            body = self._envelope("text_completion", choices)
        body["usage"] = self.usage(stats)
        return body


def sse(body: dict | str) -> str:
    """One server-sent event: `data: <json>` (or a literal such as `[DONE]`) and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"
