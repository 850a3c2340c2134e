"""`specdraft loadtest`: many clients at once against a live server, as users of a serving system measure it.

At each concurrency C, for each method in turn, `requests` chat requests (default 2·C) go out C at a time
through the official `openai` client, streamed, greedy, prompts taken in turn from the prompt files. The methods
alternate level by level, and `rounds` repeats the sweep with their order flipped, so the machine's drift weighs
on them alike. Methods are what each request asks of the server: `ar` sends `speculative: {"drafter": "none"}`
(plain decoding), `spec` nothing (the server's default speculation). With `--peer llama-server` the methods
`llama-server` and `llama-server-spec` join them: llama.cpp's server, plain and with its draft-model speculation,
started by the run with as many slots as the level has clients (`bench.loadtest_peers`), under the same clients,
prompts and budget, taking their turns among the methods at each level.

Per request: time to first token (TTFT: from sending to the first chunk with text), time per output token after
the first (TPOT: (end - first) / (tokens - 1)), and the gaps between chunks (ITL; a speculative step sends
several tokens in one chunk). Per level: aggregate tokens/s (completion tokens over the wall time from the first
request sent to the last answer), p50 / p95 of each latency, errors, and whether every greedy answer equals that
prompt's answer at concurrency 1 (batching must not change outputs).

Before each level and method the server forgets the prompts it keeps for their prefixes (`POST
/reset_prefix_cache`), so every prompt is read as by a cold server and only what different prompts share (the chat
template's system prompt) is reused, as in service; the run sends each prompt once a level and method.

Batching against the passes' cost: a specdraft server times every target pass it runs, by width
(`specdraft_target_pass_seconds` in /metrics); the run reads those sums before and after each level, so each level
has the mean cost of the passes it ran, timed while it ran. At C clients, where `ar` stepped w sequences a pass
most often (C, or the server's batch limit), the passes allow w · t(1) / t(w) times one client's `ar` tokens/s,
t(1) timed at the one-client level and t(w) at C: what batching would give if a pass of w tokens were all a step
cost and prompts read for free. The share of it the best method reached says how much of the machine batching
used; both timings come from the run itself, so a host whose speed drifts between a separate `specdraft costs`
and the levels does not move the ceiling.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from specdraft.analysis.charts import new_figure, note, save
from specdraft.bench.loadtest_peers import Peer
from specdraft.errors import SpecdraftError
from specdraft.prompts import Prompt

# What each method asks of the server in the request body (None: nothing: the server's defaults).
METHOD_BODIES: dict[str, dict | None] = {"ar": {"speculative": {"drafter": "none"}}, "spec": None}
RESULTS, SUMMARY, REPORT = "results.jsonl", "summary.json", "report.md"
THROUGHPUT_PLOT, LATENCY_PLOT = "tokens_per_second.png", "latency.png"


@dataclass
class RequestResult:
    """One streamed request: its timings (seconds) and answer, or the error it got."""

    method: str
    concurrency: int
    question_id: str
    tokens: int = 0
    ttft: float | None = None
    seconds: float = 0.0  # sending to the last chunk
    chunk_gaps: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None
    drafted: int | None = None  # a llama-server's own count (its last chunk's `timings`), where it speculated
    accepted: int | None = None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.seconds - self.ttft) / (self.tokens - 1)


def parse_methods(methods: str) -> list[str]:
    """The comma list of methods, checked."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHOD_BODIES]
    if not names or unknown:
        raise SpecdraftError(f"--methods takes a comma list of {', '.join(METHOD_BODIES)}; got {methods!r}.")
    return names


def parse_concurrency(levels: str) -> list[int]:
    """The comma list of concurrency levels (integers >= 1), checked."""
    try:
        values = [int(v) for v in levels.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SpecdraftError(f"--concurrency takes a comma list of integers >= 1 (e.g. 1,2,4,8); got {levels!r}.")
    return values


def client_for(url: str, api_key: str | None, timeout: float):
    """An `openai.OpenAI` client for the server at `url` (the `openai` package is the `loadtest` extra)."""
    try:
        import openai
    except ImportError:
        raise SpecdraftError("specdraft loadtest drives the server with the openai client: "
                             "pip install 'specdraft[loadtest]' (or pip install openai).") from None
    return openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=api_key or "unused", timeout=timeout, max_retries=0)


def _server_route(method: str, url: str, route: str, api_key: str | None, timeout: float):
    """A specdraft server's own route (`/reset_prefix_cache`, `/metrics`), with its key: the response if it answered
    200, else None (no server, another kind of server, an error)."""
    import httpx  # the openai client's own HTTP library

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.request(method, f"{url.rstrip('/')}{route}", headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return None
    return response if response.status_code == 200 else None


def reset_prefix_cache(url: str, api_key: str | None, timeout: float) -> bool:
    """Ask the server at `url` to forget the prompts it keeps for their prefixes; False where it keeps none (or is
    not a specdraft server that has the route)."""
    response = _server_route("POST", url, "/reset_prefix_cache", api_key, timeout)
    return response is not None and bool(response.json().get("cleared"))


def pass_sums(url: str, api_key: str | None, timeout: float) -> dict[int, tuple[float, int]]:
    """The server's target passes so far by width: (seconds summed, passes), from its /metrics
    (`specdraft_target_pass_seconds`); empty where it has none (a server that does not batch, or not specdraft)."""
    response = _server_route("GET", url, "/metrics", api_key, timeout)
    sums: dict[int, list[float]] = {}
    for line in response.text.splitlines() if response is not None else ():
        for part, slot in (("_sum", 0), ("_count", 1)):
            prefix = f'specdraft_target_pass_seconds{part}{{width="'
            if line.startswith(prefix):
                width, value = line[len(prefix):].split('"}')
                sums.setdefault(int(width), [0.0, 0])[slot] = float(value)
    return {width: (summed, int(count)) for width, (summed, count) in sums.items()}


def passes_between(before: dict[int, tuple[float, int]], after: dict[int, tuple[float, int]]) -> dict[int, tuple[float, int]]:
    """The passes run between two `pass_sums` readings, by width: (seconds summed, passes)."""
    ran = {}
    for width, (summed, count) in after.items():
        earlier_sum, earlier_count = before.get(width, (0.0, 0))
        if count > earlier_count:
            ran[width] = (summed - earlier_sum, count - earlier_count)
    return ran


def served_model(client) -> str:
    """The model id the server serves (its /v1/models), or a clear error when nobody answers there."""
    import openai

    try:
        return client.models.list().data[0].id
    except openai.APIConnectionError:
        raise SpecdraftError(f"No server answers at {client.base_url}; start one with `specdraft serve` "
                             "(or pass its address with --url).") from None
    except openai.AuthenticationError:
        raise SpecdraftError("The server wants an API key: pass --api-key (or set SPECDRAFT_API_KEY).") from None


def stream_one(client, model: str, method: str, concurrency: int, prompt: Prompt, max_tokens: int) -> RequestResult:
    """Send one streamed greedy chat request and time its chunks."""
    result = RequestResult(method, concurrency, prompt.question_id)
    started = last = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt.turns[0]}], max_tokens=max_tokens,
            temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_body=METHOD_BODIES.get(method))
        pieces = []
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
            timings = (getattr(chunk, "model_extra", None) or {}).get("timings") or {}
            if "draft_n" in timings:
                result.drafted, result.accepted = int(timings["draft_n"]), int(timings["draft_n_accepted"])
            if chunk.choices and chunk.choices[0].delta.content:
                if result.ttft is None:
                    result.ttft = now - started
                else:
                    result.chunk_gaps.append(now - last)
                last = now
                pieces.append(chunk.choices[0].delta.content)
        result.text = "".join(pieces)
    except Exception as error:  # any failure is a result of the load test, reported with its level
        result.error = f"{type(error).__name__}: {error}"
    result.seconds = time.perf_counter() - started
    return result


def run_level(client, model: str, method: str, concurrency: int, prompts: Sequence[Prompt], requests: int,
              max_tokens: int) -> tuple[list[RequestResult], float]:
    """`requests` requests, `concurrency` at a time, prompts in turn; the results and the level's wall seconds."""
    chosen = [prompts[i % len(prompts)] for i in range(requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda p: stream_one(client, model, method, concurrency, p, max_tokens), chosen))
    return results, time.perf_counter() - started


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}


def _tokens_per_second(results: Sequence[RequestResult], seconds: float) -> float | None:
    """Completion tokens of the requests that did not fail, over `seconds` (None for no time)."""
    return sum(r.tokens for r in results if r.error is None) / seconds if seconds > 0 else None


def summarize_level(results: Sequence[RequestResult], seconds: float, alone: dict[str, str]) -> dict:
    """A level's figures; `alone` maps question ids to the answer at concurrency 1 (outputs must not change)."""
    done = [r for r in results if r.error is None]
    compared = [r for r in done if r.question_id in alone]
    return {
        "requests": len(results), "errors": len(results) - len(done), "tokens": sum(r.tokens for r in done),
        "seconds": seconds, "tokens_per_second": _tokens_per_second(results, seconds),
        "ttft": _percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot": _percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl": _percentiles([gap for r in done for gap in r.chunk_gaps]),
        "same_as_alone": (sum(alone[r.question_id] == r.text for r in compared) / len(compared)) if compared else None,
        "acceptance_rate": _acceptance(done),
    }


def _acceptance(results: Sequence[RequestResult]) -> float | None:
    """Σ accepted / Σ drafted over the requests whose server counted its drafts (llama-server's timings); None
    where none did or nothing was drafted."""
    counted = [r for r in results if r.drafted is not None]
    drafted = sum(r.drafted for r in counted)
    return sum(r.accepted for r in counted) / drafted if drafted else None


def summarize_rounds(rounds: Sequence[tuple[Sequence[RequestResult], float]], alone: dict[str, str],
                     passes: Sequence[dict[int, tuple[float, int]]] = ()) -> dict:
    """A level's figures over its rounds (their requests and seconds pooled), with each round's tokens/s; `passes`:
    each round's target passes by width (`passes_between`), pooled into `pass_seconds` (mean seconds by width) and
    `pass_counts`."""
    figures = summarize_level([r for results, _ in rounds for r in results], sum(seconds for _, seconds in rounds),
                              alone)
    figures["tokens_per_second_by_round"] = [_tokens_per_second(results, seconds) for results, seconds in rounds]
    pooled: dict[int, list[float]] = {}
    for ran in passes:
        for width, (summed, count) in ran.items():
            total = pooled.setdefault(width, [0.0, 0])
            total[0] += summed
            total[1] += count
    figures["pass_seconds"] = {str(w): pooled[w][0] / pooled[w][1] for w in sorted(pooled)}
    figures["pass_counts"] = {str(w): int(pooled[w][1]) for w in sorted(pooled)}
    return figures


def batching_ceilings(methods: dict, plain: str = "ar") -> dict[str, dict]:
    """Per concurrency above one: the tokens/s the passes timed in this run allow (module doc) and the share of it
    the best method reached; empty without `plain` at one client, or without its passes' timings."""
    levels = methods.get(plain, {})
    alone = levels.get("1")
    if not alone or not alone.get("pass_seconds", {}).get("1") or not alone.get("tokens_per_second"):
        return {}
    one_pass = alone["pass_seconds"]["1"]
    ceilings = {}
    for clients, figures in levels.items():
        counts = figures.get("pass_counts") or {}
        if clients == "1" or not counts:
            continue
        width = max(counts, key=lambda w: (counts[w], int(w)))  # the batch `ar` ran most: C, or the server's limit
        ceiling = int(width) * one_pass / figures["pass_seconds"][width] * alone["tokens_per_second"]
        best = max(((method, by_level[clients]["tokens_per_second"]) for method, by_level in methods.items()
                    if clients in by_level and by_level[clients]["tokens_per_second"] is not None),
                   key=lambda pair: pair[1])
        ceilings[clients] = {"width": int(width), "one_pass_seconds": one_pass,
                             "pass_seconds": figures["pass_seconds"][width], "ceiling_tokens_per_second": ceiling,
                             "best_method": best[0], "best_tokens_per_second": best[1], "share": best[1] / ceiling}
    return ceilings


@contextlib.contextmanager
def _endpoint(method: str, concurrency: int, ours: tuple, peer: Peer | None, timeout: float) -> Iterator[tuple]:
    """(client, model id, whether it is the specdraft server) for a level of `method`: the specdraft server's
    (`ours`: its client and model), or a peer server with `concurrency` slots, started here and stopped after."""
    if method in METHOD_BODIES:
        yield (*ours, True)
        return
    if peer is None:
        raise SpecdraftError(f"Method {method!r} is a peer's; give the peer (--peer llama-server).")
    with peer.serving(method, concurrency) as url:
        client = client_for(url, None, timeout)
        yield client, served_model(client), False


def run_loadtest(url: str, prompts: Sequence[Prompt], methods: Sequence[str], levels: Sequence[int], out: Path,
                 max_tokens: int = 128, requests: int | None = None, api_key: str | None = None,
                 timeout: float = 600.0, rounds: int = 1, progress=None, peer: Peer | None = None) -> dict:
    """Drive the server at `url` at each concurrency of `levels` for each method; write OUT/ and return the summary.

    The methods take turns at each level (a level's methods run one after the other, before the next level), so
    the machine's drift over the run weighs on them alike; with `rounds` > 1 the whole sweep runs again, the
    methods' order flipped each round, and a level's figures pool its requests and seconds over the rounds.
    `requests` per level and round (None: 2 x the concurrency, at least one per prompt at concurrency 1);
    `progress(text)`, if given, hears of each level as it starts. Methods of `peer` (`bench.loadtest_peers`: the
    llama-server ones) each get a server of their own with as many slots as the level has clients, started before
    their turn and stopped after it."""
    if not prompts:
        raise SpecdraftError("No prompts to send; check --prompts and --categories.")
    if max_tokens < 1 or (requests is not None and requests < 1) or rounds < 1:
        raise SpecdraftError("--max-tokens, --requests and --rounds must be >= 1.")
    client = client_for(url, api_key, timeout)
    model = served_model(client)
    out.mkdir(parents=True, exist_ok=True)
    rounds_run: dict[tuple[str, int], list[tuple[list[RequestResult], float]]] = {}  # each round's results, seconds
    alone: dict[str, dict[str, str]] = {}  # by method: each prompt's answer at the lowest level, first round
    prefixes_reset = False  # whether the server keeps prompts for their prefixes (and forgot them before each level)
    passes: dict[tuple[str, int], list[dict[int, tuple[float, int]]]] = {}  # each round's target passes by width
    with open(out / RESULTS, "w", encoding="utf-8") as records:
        for round_ in range(rounds):
            for concurrency in sorted(levels):
                for method in (methods if round_ % 2 == 0 else list(reversed(methods))):
                    count = requests or max(2 * concurrency, len(prompts) if concurrency == 1 else 0)
                    if progress is not None:
                        turn = f" (round {round_ + 1} of {rounds})" if rounds > 1 else ""
                        progress(f"{method}: {count} requests, {concurrency} at a time{turn}")
                    with _endpoint(method, concurrency, (client, model), peer, timeout) as (level_client,
                                                                                            level_model, ours):
                        if ours:
                            prefixes_reset = reset_prefix_cache(url, api_key, timeout) or prefixes_reset
                            before = pass_sums(url, api_key, timeout)
                        results, seconds = run_level(level_client, level_model, method, concurrency, prompts, count,
                                                     max_tokens)
                        passes.setdefault((method, concurrency), []).append(
                            passes_between(before, pass_sums(url, api_key, timeout)) if ours else {})
                    for result in results:
                        records.write(json.dumps({**asdict(result), "round": round_, "tpot": result.tpot}) + "\n")
                    if method not in alone:
                        alone[method] = {r.question_id: r.text for r in results if r.error is None}
                    rounds_run.setdefault((method, concurrency), []).append((results, seconds))
    summary: dict = {"url": url, "model": model, "max_tokens": max_tokens, "rounds": rounds,
                     "prefix_cache": "reset before each level and method" if prefixes_reset else "none kept",
                     "methods": {method: {str(concurrency): summarize_rounds(rounds_run[(method, concurrency)],
                                                                           alone[method], passes[(method, concurrency)])
                                          for concurrency in sorted(levels)} for method in methods}}
    if peer is not None:
        from specdraft.bench.llama_server import build_info

        summary["peers"] = {"server": build_info(), "threads": peer.threads, "context_per_slot": peer.context,
                            "commands": {m: peer.command(m, max(levels)) for m in methods if m not in METHOD_BODIES}}
    summary["batching"] = batching_ceilings(summary["methods"])
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    plot_loadtest(summary, out)
    (out / REPORT).write_text(render_report(summary), encoding="utf-8")
    return summary


def plot_loadtest(summary: dict, out: Path) -> None:
    """Aggregate tokens/s, and p95 inter-token latency, against concurrency: one line per method."""
    for name, key, label in ((THROUGHPUT_PLOT, None, "aggregate tokens/s"),
                             (LATENCY_PLOT, "itl", "p95 gap between streamed chunks (ms)")):
        figure = new_figure()
        axes = figure.add_subplot()
        for method, levels in summary["methods"].items():
            xs = [int(c) for c in levels]
            ys = [(f["tokens_per_second"] if key is None else (f[key]["p95"] or 0) * 1000) for f in levels.values()]
            axes.plot(xs, ys, marker="o", label=f"`{method}`")
        if not summary["methods"]:
            note(axes, "no methods")
        axes.set(xscale="log", xlabel="concurrent clients", ylabel=label, title=f"{label}, {summary['model']}")
        axes.grid(alpha=0.3)
        if summary["methods"]:
            axes.legend()
        save(figure, out / name)


def render_report(summary: dict) -> str:
    """report.md: one row per method and concurrency."""
    def ms(value):
        return "-" if value is None else f"{value * 1000:.0f}"

    rounds = summary.get("rounds", 1)
    methods = summary["methods"]
    first = next(iter(methods), None)
    pooled = (f", {rounds} rounds pooled (the methods' order flipped each round; each round's tokens/s in brackets)"
              if rounds > 1 else "")
    lines = ["# specdraft loadtest", "",
             f"Server `{summary['url']}`, model `{summary['model']}`, greedy, {summary['max_tokens']} tokens at most; "
             f"the methods take turns at each level{pooled}. Prefix cache: {summary.get('prefix_cache', 'none kept')}.",
             "",
             f"| method | clients | requests | errors | tokens/s | vs `{first}` | TTFT p50 / p95 (ms) "
             "| TPOT p50 / p95 (ms) | ITL p50 / p95 (ms) | same as alone | α |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method, levels in methods.items():
        for clients, f in levels.items():
            same = "-" if f["same_as_alone"] is None else f"{f['same_as_alone']:.0%}"
            rate = "-" if f["tokens_per_second"] is None else f"{f['tokens_per_second']:.1f}"
            by_round = f.get("tokens_per_second_by_round") or []
            if len(by_round) > 1:
                rate += " (" + " / ".join("-" if r is None else f"{r:.1f}" for r in by_round) + ")"
            base = methods[first][clients]["tokens_per_second"]
            ratio = "-" if not base or f["tokens_per_second"] is None else f"{f['tokens_per_second'] / base:.2f}x"
            lines.append(f"| `{method}` | {clients} | {f['requests']} | {f['errors']} | {rate} | {ratio} "
                         f"| {ms(f['ttft']['p50'])} / {ms(f['ttft']['p95'])} | {ms(f['tpot']['p50'])} / "
                         f"{ms(f['tpot']['p95'])} | {ms(f['itl']['p50'])} / {ms(f['itl']['p95'])} | {same} "
                         f"| {'-' if f.get('acceptance_rate') is None else format(f['acceptance_rate'], '.2f')} |")
    peers = summary.get("peers")
    if peers:
        build = peers["server"].get("build")
        built = f", build `{build}`" if build else ""
        lines += ["", f"Peers: llama.cpp's llama-server ({peers['server']['binary']}{built}), a cold server per level "
                  f"and method with as many slots as clients (`-np`), each slot {peers['context_per_slot']} tokens; "
                  "at the most clients:", ""]
        lines += [f"- `{method}`: `{command}`" for method, command in peers["commands"].items()]
    ceilings = summary.get("batching") or {}
    if ceilings:
        lines += ["", "Batching against the cost of the passes this run timed (`ar`'s: t(1) at one client, t(w) at "
                  "C clients, w the batch it stepped most); the ceiling is w · t(1) / t(w) times one client's `ar` "
                  "tokens/s:", "",
                  "| clients | batch w | t(1) (ms) | t(w) (ms) | ceiling tokens/s | best tokens/s | share |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for clients, c in ceilings.items():
            lines.append(f"| {clients} | {c['width']} | {c['one_pass_seconds'] * 1000:.1f} | "
                         f"{c['pass_seconds'] * 1000:.1f} | {c['ceiling_tokens_per_second']:.1f} | "
                         f"{c['best_tokens_per_second']:.1f} (`{c['best_method']}`) | {c['share']:.1%} |")
    lines += ["", "TTFT: sending to the first streamed text; TPOT: time per output token after the first; ITL: gaps "
              "between streamed chunks (a speculative step sends several tokens at once); same as alone: share of "
              "greedy answers equal to that prompt's answer at the lowest concurrency; α: accepted / drafted as a "
              "llama-server counts them in each answer (the specdraft server's are in its /metrics).", "",
              f"![tokens per second]({THROUGHPUT_PLOT})", f"![latency]({LATENCY_PLOT})", ""]
    return "\n".join(lines)
