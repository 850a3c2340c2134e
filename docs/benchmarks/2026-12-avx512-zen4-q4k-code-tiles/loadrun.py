import time, sys; t=time.perf_counter()
from specdraft.models.loading import load_model
lm = load_model(sys.argv[1])
t1 = time.perf_counter()
from specdraft import SpeculativeDecoder
out = SpeculativeDecoder(lm).generate(lm.tokenizer.encode('Hello there, how are you doing today? ' * 10), max_new_tokens=64)
st = {l.split(':')[0]: l.split(':')[1].split()[0] for l in open('/proc/self/status') if l.startswith(('VmHWM', 'RssAnon', 'RssFile'))}
print(f"import+load {t1 - t:.2f} s, whole {time.perf_counter() - t:.2f} s, peak {int(st['VmHWM'])/1e6:.2f} GB (anon {int(st['RssAnon'])/1e6:.2f}, file {int(st['RssFile'])/1e6:.2f})")
