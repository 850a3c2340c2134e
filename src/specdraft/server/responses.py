"""OpenAI response bodies and stream chunks, with this server's extensions.

Each stream chunk carries `"specdraft": {"kinds", "pieces", "drafted", "accepted", "depth"}`:
what happened to each token of the step (accepted / recovered / bonus / target), the text
each adds, and the step's draft counts. `usage` carries the speculation statistics.
"""

from __future__ import annotations

import json
import time
import uuid

from specdraft.server.prepare import Generation
from specdraft.server.worker import Step
from specdraft.stats import GenerationStats


class ResponseShape:
    """The id, timestamp and object names of one response (chat or text completion)."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.id = ("chatcmpl-" if generation.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._started: set[int] = set()  # choices whose first chunk went out (chat: it carries the role)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.generation.model,
                "choices": choices}

    def usage(self, stats: GenerationStats) -> dict:
        """OpenAI's token counts plus the speculation statistics of every choice together."""
        prompt = len(self.generation.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": stats.new_tokens,
                "total_tokens": prompt + stats.new_tokens, "steps": stats.steps, "drafted": stats.drafted,
                "accepted": stats.accepted, "acceptance_rate": stats.acceptance_rate,
                "mean_committed_per_step": stats.mean_committed_per_step,
                "accepted_at": list(stats.accepted_at), "drafted_at": list(stats.drafted_at),
                "tokens_per_second": stats.tokens_per_second,
                "drafter": self.generation.decoder.drafter, "k": self.generation.decoder.k}

    def chunk(self, step: Step) -> dict:
        """The stream chunk of one engine step."""
        event = step.event
        if self.generation.chat:
            delta = {"content": event.text}
            if step.index not in self._started:
                delta = {"role": "assistant", **delta}
            choice = {"index": step.index, "delta": delta, "logprobs": None, "finish_reason": event.finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": step.index, "text": event.text, "logprobs": None, "finish_reason": event.finish_reason}
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
        for step in steps:
            texts[step.index] += step.event.text
            finishes[step.index] = step.event.finish_reason or finishes[step.index]
        if self.generation.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": finish} for i, (text, finish) in enumerate(zip(texts, finishes))]
            body = self._envelope("chat.completion", choices)
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                       for i, (text, finish) in enumerate(zip(texts, finishes))]
            body = self._envelope("text_completion", choices)
        body["usage"] = self.usage(stats)
        return body


def sse(body: dict | str) -> str:
    """One server-sent event: `data: <json>` (or a literal such as `[DONE]`) and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"
