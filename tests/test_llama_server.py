"""llama.cpp's llama-server as a peer: its command lines, method keys, timings as α, the process's life (a fake
server stands in: tests/fake_llama_server.py), the bench and load test driving it, and `make peers`' choice of
build (the builds and smoke runs stubbed). With a kept build and the bundled files, one real run (slow)."""

import dataclasses
import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdraft.bench import METHODS, BenchConfig, parse_method, run_bench
from specdraft.bench import llama_cpp_build, llama_server_peer, peer_setup
from specdraft.bench.llama_cpp_build import BUILDS, builds_to_try
from specdraft.bench.llama_server import LlamaServer, ServerSettings, arguments, exit_text
from specdraft.bench.loadtest_peers import Peer, make_peer, peer_methods
from specdraft.bench.runs import Models
from specdraft.errors import SpecdraftError

FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture()
def fake_binary(tmp_path, monkeypatch):
    """An executable that runs the fake server, set as SPECDRAFT_LLAMA_SERVER; its processes write into `.dir`."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    folder = tmp_path / "started"
    folder.mkdir()
    monkeypatch.setenv("SPECDRAFT_LLAMA_SERVER", str(binary))
    monkeypatch.setenv("FAKE_LLAMA_DIR", str(folder))
    return SimpleNamespace(path=binary, dir=folder)


def started(fake) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every fake server started so far, in the order they started."""
    files = sorted(fake.dir.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    return [(int(p.stem), json.loads(p.read_text())) for p in files]


def ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture()
def gguf_files(tmp_path):
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    for path in (target, draft):
        path.write_bytes(b"GGUF")  # never opened by the fake server
    return target, draft


# ----- command lines and keys -------------------------------------------------------------------------------------
def test_the_command_line_sets_threads_context_slots_and_speculation(tmp_path):
    plain = arguments(ServerSettings(Path("t.gguf"), 3, 1024, slots=4, binary=Path("/bin/ls")), port=1234)
    assert plain[:3] == ["/bin/ls", "-m", "t.gguf"]
    assert ["--host", "127.0.0.1", "--port", "1234"] == plain[3:7]
    assert plain[plain.index("-t") + 1] == plain[plain.index("-tb") + 1] == "3"
    assert plain[plain.index("-c") + 1] == "4096" and plain[plain.index("-np") + 1] == "4"  # 4 slots of 1024
    assert "-td" not in plain and "--no-webui" in plain
    spec = ("-md", "d.gguf", "--spec-type", "draft-simple")
    drafting = arguments(ServerSettings(Path("t.gguf"), 2, 512, spec=spec, binary=Path("/bin/ls")), port=1)
    assert drafting[drafting.index("-td") + 1] == drafting[drafting.index("-tbd") + 1] == "2"
    assert drafting[-4:] == list(spec)


@pytest.mark.parametrize("text, flags", [
    ("llama-server", ()),
    ("llama-server-spec", ("-md", "D", "--spec-type", "draft-simple")),
    ("llama-server-spec:draft-n-max=8;draft-n-min=2",
     ("-md", "D", "--spec-type", "draft-simple", "--spec-draft-n-max", "8", "--spec-draft-n-min", "2")),
    ("llama-server-ngram", ("--spec-type", "ngram-simple")),
    ("llama-server-ngram:ngram-simple-size-n=4;ngram-simple-size-m=8",
     ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "8", "--spec-ngram-simple-size-n", "4")),
    ("llama-server-ngram:spec-type=ngram-mod;ngram-mod-n-min=4;ngram-mod-n-max=16",
     ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "16", "--spec-ngram-mod-n-min", "4")),
])
def test_method_keys_are_llama_cpps_spec_flags(text, flags):
    spec = parse_method(text)
    assert spec.info.own_numerics and spec.needs_draft == (spec.name == "llama-server-spec")
    assert llama_server_peer.spec_flags(spec.name, spec.params(16).peer_options, Path("D")) == flags


@pytest.mark.parametrize("text, message", [
    ("llama-server:draft-n-max=3", "Unknown option 'draft-n-max' for method 'llama-server'"),
    ("llama-server-spec:k=3", "Unknown option 'k'"),
    ("llama-server-spec:draft-n-max=x", "draft-n-max must be a whole number"),
    ("llama-server-spec:draft-n-max=-1", "draft-n-max must be >= 0"),
    ("llama-server-ngram:spec-type=ngram-cache", "spec-type must be one of ngram-simple, ngram-map-k, ngram-mod"),
    ("llama-server-ngram:ngram-mod-n-min=4", "ngram-mod-n-min is not an option of ngram-simple"),
    ("llama-server-ngram:spec-type=ngram-mod;ngram-simple-size-n=4", "ngram-simple-size-n is not an option of ngram-mod"),
])
def test_bad_method_keys_are_clear_errors(text, message):
    with pytest.raises(SpecdraftError, match=message):
        parse_method(text).params(16)


def test_the_request_sends_our_ids_with_no_prompt_reuse_and_our_warping_order():
    params = parse_method("llama-server").params(7)
    body = llama_server_peer.completion_body([5, 6, 7], params)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 7 and body["temperature"] == 0.0
    assert body["cache_prompt"] is False and body["return_tokens"] is True
    assert body["samplers"] == ["temperature", "top_k", "top_p"] and body["min_p"] == 0.0
    sampled = llama_server_peer.completion_body([1], parse_method("llama-server:temperature=0.7;top-k=5;seed=3").params(2))
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["seed"]) == (0.7, 5, 1.0, 3)


def test_timings_give_alpha_the_prompt_pass_and_tokens_cut_at_eos():
    answer = {"tokens": [4, 9, 2, 8], "timings": {"prompt_ms": 250.0, "draft_n": 12, "draft_n_accepted": 9}}
    out = llama_server_peer.run_output("llama-server-spec", answer, 1.5, eos_ids={2})
    assert out.token_ids == [4, 9, 2] and out.wall_seconds == 1.5  # up to and including EOS, as our loop
    assert (out.drafted, out.accepted, out.prefill_seconds, out.steps) == (12, 9, 0.25, None)
    quiet = llama_server_peer.run_output("llama-server-ngram", {"tokens": [1], "timings": {}}, 1.0, set())
    assert (quiet.drafted, quiet.accepted) == (0, 0)  # speculating, nothing drafted: 0 of 0 (α None, not 0)
    plain = llama_server_peer.run_output("llama-server", {"tokens": [1], "timings": {"prompt_ms": 1.0}}, 1.0, set())
    assert (plain.drafted, plain.accepted) == (None, None)
    with pytest.raises(SpecdraftError, match="no token ids"):
        llama_server_peer.run_output("llama-server", {"content": "x"}, 1.0, set())


# ----- the process --------------------------------------------------------------------------------------------------
def test_a_server_starts_answers_and_is_always_stopped(fake_binary, gguf_files, tmp_path):
    with LlamaServer(ServerSettings(gguf_files[0], 2, 512), log_dir=tmp_path) as server:
        answer = server.post("/completion", {"prompt": [3, 4], "n_predict": 3})
        assert answer["tokens"] == [3, 4, 3]
        (pid, argv), = started(fake_binary)
        assert argv[argv.index("--port") + 1] == str(server.port) and not ended(pid)
    assert server.process.returncode is not None and ended(pid)
    server.close()  # again: nothing happens
    assert "$ " in server.log_path.read_text()  # the command line heads the log


def test_a_server_that_dies_is_an_error_naming_its_binary_and_log(fake_binary, gguf_files, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "exit")
    with pytest.raises(SpecdraftError, match=r"exited with 3 before it was ready \(.*llama-server; log: .*\):\n"
                                             r"(.|\n)*failed to load model"):
        LlamaServer(ServerSettings(gguf_files[0], 2, 512), log_dir=tmp_path)
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    server = LlamaServer(ServerSettings(gguf_files[0], 2, 512), log_dir=tmp_path)
    with pytest.raises(SpecdraftError, match=r"crashed \(SIGSEGV\) at /completion"):
        server.post("/completion", {"prompt": [1]})
    server.close()
    assert exit_text(-11) == "crashed (SIGSEGV)" and exit_text(2) == "exited with 2"


def test_without_a_binary_the_error_says_make_peers(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDRAFT_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))  # nothing kept there
    target = tmp_path / "x.gguf"
    target.write_bytes(b"GGUF")  # (the target is checked first)
    with pytest.raises(SpecdraftError, match="make peers"):
        METHODS["llama-server"].check(str(target))


# ----- the bench methods --------------------------------------------------------------------------------------------
def test_the_methods_keep_one_server_per_setting_and_close_them(fake_binary, gguf_files, monkeypatch):
    monkeypatch.setattr(llama_server_peer.torch, "get_num_threads", lambda: 2)
    target, draft = gguf_files
    models = Models(SimpleNamespace(eos_token_ids={99}), target_spec=str(target), draft_spec=str(draft))
    for text in ("llama-server", "llama-server-spec:draft-n-max=5", "llama-server"):
        spec = parse_method(text)
        out = spec.info.run(models, [7, 8, 9], spec.params(4))
        assert out.token_ids == [7, 8, 9, 7]
    assert (out.drafted, out.accepted) == (None, None)
    assert len(models.peers) == 2  # plain, reused; and the speculative one
    spec = parse_method("llama-server-spec:draft-n-max=5")
    out = spec.info.run(models, [7] * 1100, spec.params(4))  # past the 1024-token context: started again, larger
    assert (out.drafted, out.accepted, out.prefill_seconds) == (8, 4, 11.0)
    servers = started(fake_binary)
    assert len(servers) == 3 and ended(servers[1][0])  # the small speculative one was stopped
    argv = servers[2][1]
    assert argv[argv.index("-c") + 1] == "2048" and argv[argv.index("-md") + 1] == str(draft)
    assert argv[argv.index("--spec-draft-n-max") + 1] == "5" and argv[argv.index("-t") + 1] == "2"
    models.close_peers()
    assert not models.peers and all(ended(pid) for pid, _ in started(fake_binary))


def _bench_config(tiny_model_dirs, tmp_path, methods):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": q, "category": "code", "turns": [t]}) + "\n"
                               for q, t in ((1, "def add(a, b)"), (2, "for i in range"))))
    return BenchConfig(out=tmp_path / "out", methods=methods, target=str(tiny_model_dirs["target"]),
                       draft=str(tiny_model_dirs["draft"]), prompts=prompts, max_new_tokens=6, dtype="float32",
                       threads=1, warmup_tokens=2)


def test_a_bench_with_the_server_peers_reports_alpha_and_stops_them_even_when_it_fails(
        fake_binary, gguf_files, tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(llama_server_peer, "target_gguf", lambda spec, method, role="target": gguf_files[role == "draft"])
    config = _bench_config(tiny_model_dirs, tmp_path, "ar,llama-server,llama-server-spec:draft-n-max=4")
    result = run_bench(config)
    figures = result.summary["methods"]
    assert figures["llama-server-spec:draft-n-max=4"]["acceptance_rate"] == pytest.approx(0.5)
    assert figures["llama-server"]["acceptance_rate"] is None and figures["llama-server"]["own_numerics"]
    assert result.summary["machine"]["llama_server"]["binary"] == str(fake_binary.path)
    assert len(started(fake_binary)) == 2 and all(ended(pid) for pid, _ in started(fake_binary))

    monkeypatch.setenv("FAKE_LLAMA_MODE", "fail-after-1")  # the warm-up answers, the first timed run gets a 500
    with pytest.raises(SpecdraftError, match="answered /completion with 500"):
        run_bench(dataclasses.replace(config, out=tmp_path / "failed", methods="ar,llama-server"))
    assert len(started(fake_binary)) == 3 and all(ended(pid) for pid, _ in started(fake_binary))


# ----- the load test's peer ----------------------------------------------------------------------------------------
def test_loadtest_peer_starts_a_server_per_level_with_as_many_slots_as_clients(fake_binary, gguf_files, tmp_path):
    from specdraft.bench.loadtest import run_loadtest
    from specdraft.prompts import Prompt

    assert peer_methods(None) == () and peer_methods("llama-server") == ("llama-server", "llama-server-spec")
    with pytest.raises(SpecdraftError, match="--peer takes llama-server"):
        peer_methods("vllm")
    peer = Peer(*gguf_files, threads=2, context=256)
    with LlamaServer(ServerSettings(gguf_files[0], 1, 256)) as ours:  # stands in for `specdraft serve`
        prompts = [Prompt("a", "code", ["one two three"]), Prompt("b", "code", ["four five"])]
        summary = run_loadtest(ours.url, prompts, ["ar", "llama-server", "llama-server-spec"], [1, 2],
                               tmp_path / "out", max_tokens=3, peer=peer)
    levels = summary["methods"]["llama-server-spec"]
    assert levels["2"]["errors"] == 0 and levels["2"]["tokens"] == 4 * 3 and levels["2"]["same_as_alone"] == 1.0
    assert levels["2"]["acceptance_rate"] == 0.5  # the server's own count, from its last chunk's timings
    assert summary["methods"]["llama-server"]["1"]["acceptance_rate"] is None
    peers = [argv for _, argv in started(fake_binary)][1:]  # after ours: a server per level and peer method
    slots = [(argv[argv.index("-np") + 1], "-md" in argv) for argv in peers]
    assert slots == [("1", False), ("1", True), ("2", False), ("2", True)]
    assert all(ended(pid) for pid, _ in started(fake_binary))
    assert "-np 2" in summary["peers"]["commands"]["llama-server-spec"]
    assert "llama-server-spec" in (tmp_path / "out" / "report.md").read_text()
    assert make_peer(None, "x", "y", 1) is None


# ----- make peers: which build is kept -----------------------------------------------------------------------------
def test_builds_to_try_put_native_first_and_drop_amx_where_it_cannot_run():
    def never():
        raise AssertionError("no AMX on the CPU: nothing to ask the OS")

    assert builds_to_try({"avx2"}, granted=never) == [BUILDS["native"]]
    assert builds_to_try({"amx_tile"}, granted=lambda: True) == [BUILDS["native"], BUILDS["no-amx"]]
    assert builds_to_try({"amx_tile"}, granted=lambda: False) == [BUILDS["no-amx"]]
    assert BUILDS["no-amx"].folder == "build"  # where llama-quantize has always been built


def test_a_build_whose_smoke_run_crashes_is_replaced_and_the_kept_one_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(peer_setup, "builds_to_try", lambda: [BUILDS["native"], BUILDS["no-amx"]])
    built, installed = [], []

    def build_tools(targets, build, jobs):
        built.append(build.name)
        build.bin.mkdir(parents=True, exist_ok=True)
        for tool in targets:
            (build.bin / tool).write_text("")
        return build.bin

    def smoke_bench(binary, model, threads):
        if "build-native" in str(binary):
            raise SpecdraftError("llama-bench crashed (SIGSEGV): ...")
        return "| tg8 | 13.9 |"

    monkeypatch.setattr(peer_setup, "build_tools", build_tools)
    monkeypatch.setattr(peer_setup, "smoke_bench", smoke_bench)
    monkeypatch.setattr(peer_setup, "smoke_server", lambda binary, model, threads: "8 tokens")
    monkeypatch.setattr(peer_setup, "installed_version", lambda: installed[-1] if installed else None)
    fetched = []  # the tools' builds done when the sdist was asked for: the tools build from its source too

    def sdist():
        fetched.append(len(built))
        return tmp_path / "llama_cpp_python-0.3.36.tar.gz"

    monkeypatch.setattr(peer_setup, "sdist", sdist)
    monkeypatch.setattr(peer_setup, "pip_install", lambda source, build, jobs: installed.append(peer_setup.PINNED))
    python_runs = iter([SpecdraftError("llama-cpp-python crashed (SIGSEGV)"), ("'x' -> 'y'", "CPU : AVX512 = 1")])

    def smoke_python(model, threads):
        outcome = next(python_runs)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(peer_setup, "smoke_python", smoke_python)
    record = peer_setup.setup_peers(tmp_path / "m.gguf", threads=2, say=lambda text: None)
    assert built == ["native", "no-amx"] and fetched[0] == 0
    tools = record["tools"]
    assert tools["build"] == "no-amx" and "-DGGML_AMX_INT8=OFF" in tools["cmake_args"]
    assert tools["failed"][0]["build"] == "native" and "SIGSEGV" in tools["failed"][0]["why"]
    assert tools["smoke"]["llama-server"] == "8 tokens"
    python = record["llama_cpp_python"]
    assert python["build"] == "no-amx" and python["failed"][0]["build"] == "native" and len(installed) == 2
    assert llama_cpp_build.kept_tool("llama-server") == BUILDS["no-amx"].bin / "llama-server"
    assert json.loads((tmp_path / "llama.cpp" / "peers.json").read_text()) == record

    monkeypatch.setattr(peer_setup, "build_tools", lambda *a: pytest.fail("a second make peers builds nothing"))
    monkeypatch.setattr(peer_setup, "smoke_python", lambda *a: pytest.fail("nor runs anything"))
    assert peer_setup.setup_peers(tmp_path / "m.gguf", threads=2, say=lambda text: None) == record


# ----- the real thing (a kept build and the bundled files) ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.alone  # llama-server's threads and ours
def test_the_kept_llama_server_speculates_with_the_bundled_pair(monkeypatch):
    from specdraft.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdraft.paths import cache_dir

    if llama_cpp_build.kept_tool("llama-server") is None:
        pytest.skip("no llama-server kept (make peers)")
    target, draft = (cache_dir() / f"{name}.gguf" for name in (DEFAULT_TARGET, DEFAULT_DRAFT))
    if not (target.is_file() and draft.is_file()):
        pytest.skip("the bundled GGUF files are not in the cache")
    monkeypatch.delenv("SPECDRAFT_LLAMA_SERVER", raising=False)
    models = Models(SimpleNamespace(eos_token_ids={151645}), target_spec=str(target), draft_spec=str(draft))
    try:
        spec = parse_method("llama-server-spec")
        prompt = [151644, 872, 198, 750, 912, 2877, 11, 293, 982, 151645, 198, 151644, 77091, 198]
        out = spec.info.run(models, prompt, spec.params(16))
        assert 0 < len(out.token_ids) <= 16 and out.drafted > 0 and 0 <= out.accepted <= out.drafted
    finally:
        models.close_peers()
