"""Where a later load's peak goes: resident memory after each stage of one process that imports torch, loads a
packed GGUF target (kept from an earlier load), reads a 91-token prompt and decodes 64 tokens; then the same file in
llama.cpp (llama-cpp-python, the bench's context of 1024) in a process of its own.
python memory_stages.py FILE [--llama-cpp]"""
import sys


def status() -> dict:
    return {l.split(':')[0]: int(l.split(':')[1].split()[0]) / 1e3 for l in open('/proc/self/status')
            if l.startswith(('VmHWM', 'VmRSS', 'RssAnon', 'RssFile'))}


def line(stage: str) -> None:
    s = status()
    print(f"{stage:34s} resident {s['VmRSS']:6.0f} MB (anon {s['RssAnon']:4.0f}, files {s['RssFile']:5.0f}), "
          f"peak {s['VmHWM']:6.0f} MB", flush=True)


PROMPT = 'Hello there, how are you doing today? ' * 10
if '--llama-cpp' in sys.argv:
    import llama_cpp
    line('import llama_cpp')
    llm = llama_cpp.Llama(sys.argv[1], n_threads=2, n_threads_batch=2, n_ctx=1024, n_batch=512, n_gpu_layers=0,
                          verbose=False)
    line('loaded')
    for n, _ in enumerate(llm.generate(llm.tokenize(PROMPT.encode()), top_k=1), 1):
        if n == 64:
            break
    line('91-token prompt + 64 tokens')
else:
    line('python')
    import torch  # noqa: F401
    line('import torch')
    from specdraft import SpeculativeDecoder
    from specdraft.models.loading import load_model
    line('import specdraft (+ transformers)')
    lm = load_model(sys.argv[1])
    line('loaded (tokenizer, modules)')
    decoder = SpeculativeDecoder(lm)
    ids = lm.tokenizer.encode(PROMPT)
    decoder.generate(ids, max_new_tokens=1)
    line(f'{len(ids)}-token prompt')
    decoder.generate(ids, max_new_tokens=64)
    line('again, + 64 tokens')
