"""Per-token mask time of the constraint libraries on the bundled target's vocabulary (151,936 ids), CPU, one thread.

For each library and each constraint: compile it, then walk a valid answer token by token, timing the mask of the
allowed next tokens at every position (and the advance past the chosen token separately), and a rollback of 4
tokens (what a rejected draft costs). Run from the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python docs/benchmarks/2026-11-zen5-constraint-mask-libraries/measure.py
"""

from __future__ import annotations

import json
import statistics
import time
from importlib.metadata import version

import torch

SCHEMAS = {
    "tool call": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather", "search_flights", "convert_currency"]},
            "arguments": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "units": {"type": "string", "enum": ["metric", "imperial"]}},
                "required": ["city", "days", "units"], "additionalProperties": False},
        },
        "required": ["name", "arguments"], "additionalProperties": False,
    },
    "extraction": {
        "type": "object",
        "properties": {
            "people": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
                "required": ["name", "age"]}},
            "summary": {"type": "string", "maxLength": 200},
        },
        "required": ["people", "summary"],
    },
}
ANSWERS = {
    "tool call": {"name": "get_weather", "arguments": {"city": "Lisbon", "days": 3, "units": "metric"}},
    "extraction": {"people": [{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
                              {"name": "Charles Babbage", "age": 79}],
                   "summary": "Two mathematicians who worked on the Analytical Engine in London."},
}


def walk(name, answer_ids, mask, advance, rollback):
    """Time mask() before each token and advance(t) after it; then a rollback of 4 tokens. Milliseconds."""
    masks, advances = [], []
    for token in answer_ids:
        started = time.perf_counter()
        mask()
        masks.append(time.perf_counter() - started)
        started = time.perf_counter()
        advance(token)
        advances.append(time.perf_counter() - started)
    started = time.perf_counter()
    rollback(4)
    rolled = time.perf_counter() - started
    ms = lambda values: 1000 * statistics.mean(values)  # noqa: E731
    p95 = lambda values: 1000 * sorted(values)[int(0.95 * (len(values) - 1))]  # noqa: E731
    return {"mask_ms_mean": round(ms(masks), 4), "mask_ms_p95": round(p95(masks), 4),
            "advance_ms_mean": round(ms(advances), 4), "rollback4_ms": round(1000 * rolled, 4),
            "tokens": len(answer_ids)}


def main() -> None:
    from specdraft.models.loading import load_model

    torch.set_num_threads(1)
    target = load_model("qwen2.5-coder-1.5b-instruct", verbose=False)
    tokenizer, vocab = target.tokenizer, target.vocab_size
    eos = sorted(target.eos_token_ids)
    results: dict = {"vocab": vocab, "libraries": {}}

    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    results["libraries"]["llguidance"] = {"version": version("llguidance"),
                                          "tokenizer_s": round(time.perf_counter() - started, 3)}
    import xgrammar

    started = time.perf_counter()
    xg_info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
    xg_compiler = xgrammar.GrammarCompiler(xg_info, max_threads=1)
    results["libraries"]["xgrammar"] = {"version": version("xgrammar"),
                                        "tokenizer_s": round(time.perf_counter() - started, 3)}

    for name, schema in SCHEMAS.items():
        answer_ids = tokenizer.encode(json.dumps(ANSWERS[name]), add_special_tokens=False) + [eos[0]]

        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        compiled = time.perf_counter() - started
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        run = walk(name, answer_ids, lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
                   matcher.consume_token, matcher.rollback)
        assert not matcher.is_error(), matcher.get_error()
        results["libraries"]["llguidance"][name] = {"compile_s": round(compiled, 4), **run}

        started = time.perf_counter()
        compiled_grammar = xg_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        xg_matcher = xgrammar.GrammarMatcher(compiled_grammar, max_rollback_tokens=16)
        compiled = time.perf_counter() - started
        xg_mask = xgrammar.allocate_token_bitmask(1, vocab)
        run = walk(name, answer_ids, lambda: xg_matcher.fill_next_token_bitmask(xg_mask),
                   xg_matcher.accept_token, xg_matcher.rollback)
        results["libraries"]["xgrammar"][name] = {"compile_s": round(compiled, 4), **run}

    try:  # outlines-core: the schema becomes a regex, then an index over the whole vocabulary
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        inverse = {v: k for k, v in bytes_to_unicode().items()}
        tokens: dict = {}
        for token, ident in tokenizer.get_vocab().items():
            if ident in eos:
                continue
            try:
                text = bytes(inverse[ch] for ch in token)
            except KeyError:  # an added special token: leave it out
                continue
            tokens.setdefault(text, []).append(ident)
        started = time.perf_counter()
        vocabulary = Vocabulary(eos[0], tokens)
        results["libraries"]["outlines-core"] = {"version": version("outlines-core"),
                                                 "tokenizer_s": round(time.perf_counter() - started, 3)}
    except ImportError as error:
        results["libraries"]["outlines-core"] = {"error": str(error)}
        SCHEMAS.clear()
    for name, schema in SCHEMAS.items():
        answer_ids = tokenizer.encode(json.dumps(ANSWERS[name]), add_special_tokens=False) + [eos[0]]
        try:
            started = time.perf_counter()
            guide = Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))
            compiled = time.perf_counter() - started
            mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
            # the guide ends in a final state that has no transition on EOS: walk the answer without it
            run = walk(name, answer_ids[:-1], lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4),
                       guide.advance, lambda n: guide.rollback_state(n))
            results["libraries"]["outlines-core"][name] = {"compile_s": round(compiled, 4), **run}
        except Exception as error:  # recorded, not hidden
            results["libraries"]["outlines-core"][name] = {"error": f"{type(error).__name__}: {error}"}

    print(json.dumps(results, indent=1))


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): each byte's printable stand-in in token strings."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


if __name__ == "__main__":
    main()
