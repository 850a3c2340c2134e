"""Logit error of a packed target's passes against the 16-bit path: variant given as argv[1] (A, B, C)."""
import json, os, sys
variant = sys.argv[1]
os.environ["SPECDRAFT_CACHE"] = f"/tmp/q4k/cache{variant}"
if variant == "A":
    os.environ["SPECDRAFT_INT8_ACTIVATIONS"] = "none"
import torch
from specdraft.kernels import q4k_tiles
if variant in "AB":
    q4k_tiles.available = lambda: False
from specdraft.models.loading import load_model
torch.set_num_threads(2)
lm = load_model(sys.argv[2], verbose=True)
qs = [json.loads(l) for l in open("../shared/data/spec_bench/question.jsonl")]
texts = [qs[i]["turns"][0] for i in (0, 100, 200, 300)]
out = {}
for j, text in enumerate(texts):
    ids = lm.tokenizer(text, return_tensors="pt")["input_ids"][:, :200]
    lm.reset()
    logits = lm.forward(ids, logits_to_keep=ids.shape[1], prompt=True).logits[0].float()  # [T, V]
    out[j] = logits
torch.save(out, f"/tmp/q4k/logits{variant}.pt")
