import sys, os
def rss(tag):
    st = {l.split(':')[0]: int(l.split(':')[1].split()[0]) for l in open('/proc/self/status') if l.startswith(('VmRSS','VmHWM', 'RssAnon', 'RssFile'))}
    print(f"{tag:28s} rss {st['VmRSS']/1e3:7.0f} MB  anon {st['RssAnon']/1e3:6.0f}  file {st['RssFile']/1e3:6.0f}  hwm {st['VmHWM']/1e3:6.0f}")
rss("start")
import torch; rss("import torch")
import transformers; rss("import transformers")
from specdraft.models.loading import load_model; rss("import loading")
from specdraft import SpeculativeDecoder; rss("import specdraft")
lm = load_model(sys.argv[1]); rss("load_model")
ids = lm.tokenizer.encode('Hello there, how are you doing today? ' * 10); rss("encode")
dec = SpeculativeDecoder(lm)
out = dec.generate(ids, max_new_tokens=1); rss("prompt pass")
out = dec.generate(ids, max_new_tokens=64); rss("64 tokens")
import gc; gc.collect(); rss("gc")
