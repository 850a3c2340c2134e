import time, sys; t=time.perf_counter()
from specdraft.models.loading import load_model
lm = load_model(sys.argv[1])
t1 = time.perf_counter()
from specdraft import SpeculativeDecoder
out = SpeculativeDecoder(lm).generate(lm.tokenizer.encode('Hello there, how are you doing today? ' * 10), max_new_tokens=64)
st = {l.split(':')[0]: l.split(':')[1].split()[0] for l in open('/proc/self/status') if l.startswith(('VmHWM', 'RssAnon', 'RssFile'))}
print(f"import+load {t1 - t:.2f} s, whole {time.perf_counter() - t:.2f} s, peak {int(st['VmHWM'])/1e6:.2f} GB (anon {int(st['RssAnon'])/1e6:.2f}, file {int(st['RssFile'])/1e6:.2f})")
import re, collections, os
if os.environ.get("SMAPS"):
    rss=collections.Counter(); cur=None
    for line in open('/proc/self/smaps'):
        if re.match(r'^[0-9a-f]+-[0-9a-f]+ ', line):
            parts=line.split(); cur=parts[5] if len(parts)>5 else '[anon]'
        elif line.startswith('Rss:'):
            rss[cur]+=int(line.split()[1])
    for k,v in rss.most_common(12): print(f"{v/1024:8.1f} MB {k}")
if os.environ.get("PAGES"):
    sys.path.insert(0, "/tmp/s8"); import gguf_pages; gguf_pages.report(sys.argv[1])
