"""Peak resident memory of one process that loads a GGUF target (a later load: the packed model kept by a first),
reads a 100-token prompt and decodes 64 tokens, as VmHWM says, with its steps' resident memory on the way.

    python peak_memory.py FILE.gguf [--no-triton]

`--no-triton` hides Triton (a development dependency here: `import torch._dynamo`, which transformers' modeling
imports, loads it where it is installed, 73 MB)."""

import sys


def status(tag: str) -> None:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    gb = {key: int(fields[key].split()[0]) / 1e6 for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    print(f"{tag:>12}: resident {gb['VmRSS']:.2f} GB (anonymous {gb['RssAnon']:.2f}, file {gb['RssFile']:.2f}), "
          f"peak {gb['VmHWM']:.2f} GB", flush=True)


class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("hidden")


if "--no-triton" in sys.argv:
    sys.meta_path.insert(0, _NoTriton())
import torch  # noqa: E402

status("torch")
from specdraft.models.loading import load_model  # noqa: E402

status("imports")
lm = load_model(sys.argv[1], verbose=False)
status("loaded")
g = torch.Generator().manual_seed(0)
lm.reset()
lm.prefill(torch.randint(1000, 30000, (1, 100), generator=g))
status("prompt")
for _ in range(64):
    lm.forward(torch.randint(1000, 30000, (1, 1), generator=g), 1)
status("64 tokens")
