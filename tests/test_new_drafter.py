"""Adding a drafter is one registry entry: the toy drafter below, registered in the test alone, gets its `--KEY` flag
on `generate` and `serve`, is listed by `specdraft drafters` and the server, built by `make_drafter`, and covered by
the registry-wide exactness tests' list."""

from __future__ import annotations

import torch
import typer
from typer.testing import CliRunner

import specdraft.drafters as drafters_module
from registered_drafters import build, registered
from specdraft import SpeculativeDecoder
from specdraft.drafters import Draft, DraftContext, Drafter, DrafterInfo, Option
from specdraft.server.decoders import DecoderPool
from specdraft.surfaces.cli import app
from specdraft.surfaces.model_setup import drafter_flags, with_drafter_flags


class RepeatLast(Drafter):
    """Proposes the last committed token again, `k` times (right only on runs of one token)."""

    name = "repeat-last"

    def __init__(self, times: int) -> None:
        self.times = times

    def propose(self, ctx: DraftContext, k: int) -> Draft:
        return Draft.chain(ctx.sequence[-1:].repeat(min(k, self.times)))  # [k]


def test_a_toy_drafter_registered_once_is_available_everywhere(monkeypatch, tiny_target, make_lm):
    info = DrafterInfo("repeats the last token", lambda options, **_: RepeatLast(options["repeat-times"]), False,
                       {"repeat-times": Option(2, "how many times to repeat it", minimum=1)})
    monkeypatch.setitem(drafters_module.DRAFTERS, "repeat-last", info)

    assert "repeat-last" in registered()  # the tier 2 and tier 3 tests run over this list
    target = make_lm(tiny_target)
    drafter = build("repeat-last", target, None)
    assert isinstance(drafter, RepeatLast) and drafter.times == 2
    prompt = [5, 5, 5, 9, 9]
    expected = SpeculativeDecoder(make_lm(tiny_target)).generate(prompt, max_new_tokens=20).token_ids
    got = SpeculativeDecoder(target, drafter, k=2).generate(prompt, max_new_tokens=20)
    assert got.token_ids == expected and got.stats.drafted > 0

    listing = CliRunner().invoke(app, ["drafters"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0 and "repeat-last" in listing.stdout and "--repeat-times (2)" in listing.stdout
    assert "repeat-last" in DecoderPool(target, None, drafter="repeat-last").drafters()

    def command(drafter: str = "", k: str = "auto", **drafter_options) -> None:
        given.update(drafter_flags(**drafter_options))  # as `generate` and `serve` read their flags
    given = {}
    cli = typer.Typer()
    cli.command()(with_drafter_flags(command, after="k"))
    result = CliRunner().invoke(cli, ["--repeat-times", "5"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert given["repeat-times"] == 5 and given["ngram-max"] is None  # given, and left to its default
    assert CliRunner().invoke(cli, ["--repeat-times", "0"]).exit_code == 2  # below its declared minimum
    assert torch.equal(drafter.propose(DraftContext(torch.tensor(prompt), None, None, None), 3).tokens,
                       torch.tensor([9, 9]))
