"""Text in and out: prompts to token ids, generated ids to text deltas with stop strings."""

from __future__ import annotations

from specdraft.errors import SpecdraftError


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
    """Token ids of `prompt`: through the tokenizer's chat template when `chat` (default: if it has one)."""
    if not prompt or not prompt.strip():
        raise SpecdraftError("The prompt is empty; give some text (or --prompt-file with text in it).")
    if tokenizer is None:
        raise SpecdraftError("This model has no tokenizer; pass token ids instead of text.")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is None:
        chat = has_template
    if chat:
        if not has_template:
            raise SpecdraftError("This model's tokenizer has no chat template; use --no-chat for raw text.")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a whole chat (a list of {"role", "content"}) with the generation prompt appended."""
    if not messages:
        raise SpecdraftError("The chat has no messages.")
    if not getattr(tokenizer, "chat_template", None):
        raise SpecdraftError("This model's tokenizer has no chat template; send a plain completion prompt instead.")
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """The index in `text` where the earliest stop string begins (searching from `start`), or None."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def _finished_length(text: str) -> int:
    """`text`'s length without its trailing U+FFFD (the bytes of a character still to come), found from the end."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    return end


def _failure(stop: str) -> list[int]:
    """KMP's failure function of `stop`: [i] is the length of the longest proper prefix of stop[: i + 1] that is
    also its suffix."""
    fail, matched = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while matched and stop[i] != stop[matched]:
            matched = fail[matched - 1]
        if stop[i] == stop[matched]:
            matched += 1
        fail[i] = matched
    return fail


def _overlap(text: str, end: int, stop: str, fail: list[int]) -> int:
    """The length of the longest proper prefix of `stop` that text[:end] ends with: KMP over its last len(stop) - 1
    characters (`fail`: `_failure(stop)`), so O(len(stop)) where trying every prefix cost O(len(stop)²)."""
    if not end or stop.find(text[end - 1], 0, len(stop) - 1) < 0:  # the last character ends no prefix
        return 0
    matched = 0
    for char in text[max(0, end - len(stop) + 1) : end]:  # fewer than len(stop): `matched` stays a proper prefix
        while matched and stop[matched] != char:
            matched = fail[matched - 1]
        if stop[matched] == char:
            matched += 1
    return matched


DECODE_CONTEXT = 6  # tokens before the settled point decoded again with the new ones (see `IncrementalText.decoded`)


class IncrementalText:
    """Turns the growing list of generated ids into text deltas.

    A delta never ends in the middle of a multi-byte character (the tokenizer decodes a
    partial UTF-8 sequence as U+FFFD, which is held back), nor in text that may still turn
    into a stop string. `stop_at` reports where a stop string starts, so the caller can cut.

    The text of the ids so far is kept, so a step decodes its new tokens and a few before them, not the whole
    answer again (`decoded`). Stop strings are checked in linear time: each token's text is searched only where a
    stop string could end in what it added (the last characters before it, as many as the longest stop string
    less one), and what to hold back is found by KMP over the tail (`_overlap`).
    """

    def __init__(self, tokenizer, stops: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in (stops or []) if s]
        self._failures = [_failure(s) for s in self.stops]
        self._longest = max(map(len, self.stops), default=0)
        self.emitted = ""
        self._settled: list[int] = []  # ids whose text is known and ends on a whole character
        self._settled_text = ""  # decode(_settled)
        self._window_text = ""  # decode(_settled[-DECODE_CONTEXT:])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def decoded(self, ids: list[int]) -> str:
        """decode(ids), from the text kept for the ids they begin with (`settle`): the last DECODE_CONTEXT of those
        are decoded again with the rest, and what follows their own text is the new text. The context gives the
        tokenizer's decoder the same first token on both sides (a SentencePiece decoder strips the space of the
        first token it sees), and the kept text ends on a whole character (byte-level pieces of a character split
        across tokens decode alike on both sides). Where the window's text does not begin with the kept window's,
        the whole ids are decoded. Decoding the whole answer at every step cost O(length) a step."""
        settled = len(self._settled)
        if settled >= DECODE_CONTEXT and len(ids) >= settled and ids[:settled] == self._settled:
            window = self.decode(ids[settled - DECODE_CONTEXT :])
            if window.startswith(self._window_text):
                return self._settled_text + window[len(self._window_text) :]
        return self.decode(ids)

    def settle(self, ids: list[int], text: str) -> None:
        """Keep `text` (= decode(ids)) for `decoded`, where it ends on a whole character (`ids` is kept as given: the
        caller does not change it after)."""
        if len(ids) < DECODE_CONTEXT or text.endswith("\ufffd"):
            return
        window = self.decode(ids[-DECODE_CONTEXT:])
        if not window.endswith("\ufffd"):
            self._settled, self._settled_text, self._window_text = ids, text, window

    def token_texts(self, before: list[int], new: list[int]) -> tuple[list[str], bool]:
        """The decoded text after each token of `new`, cut at the first stop string.

        Returns the texts (one per kept token) and whether a stop string ended them. A stop
        string cannot begin inside text already emitted: any of its prefixes is held back.
        """
        if self.tokenizer is None:
            return [""] * len(new), False
        texts, ids = [], list(before)
        start = len(self.emitted)  # where a stop string may begin: text before it was searched already
        for token in new:
            ids = ids + [token]  # a new list each token: `settle` keeps the last one
            decoded = self.decoded(ids)
            at = find_stop(decoded, self.stops, start=start) if self.stops else None
            if at is not None:
                texts.append(decoded[:at])
                return texts, True
            texts.append(decoded)
            # the finished text held no stop string: one found later ends after it, so begins at most
            # longest - 1 characters before its end
            start = max(start, _finished_length(decoded) - self._longest + 1)
        if texts:
            self.settle(ids, texts[-1])
        return texts, False

    def cut(self, before: list[int], new: list[int], eos_ids: set[int]) -> tuple[list[int], list[str], str | None]:
        """`new` cut after its first end-of-sequence token and at the first stop string: the kept tokens, the
        decoded text after each, and "stop" when either cut them (else None)."""
        finish = None
        ends = [i for i, token in enumerate(new) if token in eos_ids]
        if ends:
            new, finish = new[: ends[0] + 1], "stop"
        texts, stopped = self.token_texts(before, new)
        if stopped:
            new, finish = new[: len(texts)], "stop"
        return new, texts, finish

    def delta(self, text: str, final: bool) -> str:
        """The new text to emit given the full decoded `text` so far."""
        stable = len(text) if final else len(text) - self._held_back(text)
        if stable <= len(self.emitted):
            return ""
        piece = text[len(self.emitted):stable]
        self.emitted = text[:stable]
        return piece

    def _held_back(self, text: str) -> int:
        """How many trailing characters of `text` could still become a stop string, or an unfinished character.

        A stop string may begin just before an unfinished character (decoded as U+FFFD for now), so its prefixes
        are looked for in the text without those."""
        finished = _finished_length(text)
        overlap = max((_overlap(text, finished, stop, fail) for stop, fail in zip(self.stops, self._failures)),
                      default=0)
        return overlap + len(text) - finished
