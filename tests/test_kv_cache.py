"""The growing KV cache layer holds what transformers' DynamicLayer holds, through appends, growth,
crops and in-place edits, without copying the cache on every append."""

import torch
from transformers.cache_utils import DynamicLayer

from specdraft.models import kv_cache
from specdraft.models.kv_cache import GrowingLayer, growing_cache
from conftest import tiny_config


def states(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, length, 8, generator=g), torch.randn(1, 2, length, 8, generator=g)  # [B, kv, T, d]


def test_growing_layer_matches_dynamic_layer(monkeypatch):
    monkeypatch.setattr(kv_cache, "SPARE_TOKENS", 4)  # grow often
    growing, dynamic = GrowingLayer(), DynamicLayer()
    script = [("add", 5), ("add", 1), ("add", 3), ("crop", -2), ("add", 6), ("edit", 0), ("add", 1), ("crop", -7),
              ("add", 9)]
    for step, (action, n) in enumerate(script):
        if action == "add":
            key, value = states(n, seed=step)
            got, want = growing.update(key, value), dynamic.update(key, value)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        elif action == "crop":
            growing.crop(n)
            dynamic.crop(n)
        else:  # CausalLM.keep rewrites rows in place
            for layer in (growing, dynamic):
                layer.keys[:, :, 2] = layer.keys[:, :, 4]
                layer.values[:, :, 2] = layer.values[:, :, 4]
        assert torch.equal(growing.keys, dynamic.keys) and torch.equal(growing.values, dynamic.values)
        assert growing.get_seq_length() == dynamic.get_seq_length()


def test_appends_write_in_place_until_the_buffer_is_full(monkeypatch):
    """A buffer grows by as many tokens as it holds, at most SPARE_TOKENS; appends until it is full copy nothing."""
    monkeypatch.setattr(kv_cache, "SPARE_TOKENS", 8)
    layer = GrowingLayer()
    layer.update(*states(3, seed=0))
    assert layer.key_buffer.shape[-2] == 6  # 3 tokens and 3 spare
    for seed, room in ((1, 6), (2, 6), (3, 6), (4, 14)):  # 7 tokens: room for 7 more
        layer.update(*states(1, seed=seed))
        assert layer.key_buffer.shape[-2] == room
    buffer = layer.key_buffer
    layer.update(*states(7, seed=5))
    assert layer.key_buffer is buffer and layer.keys.data_ptr() == buffer.data_ptr()  # 14 tokens: no copy yet
    layer.update(*states(1, seed=9))
    assert layer.key_buffer is not buffer and layer.key_buffer.shape[-2] == 15 + 8 and layer.keys.shape[-2] == 15


def test_reset_starts_over_and_sliding_layers_grow_too():
    layer = GrowingLayer()
    layer.update(*states(4, seed=0))
    layer.reset()
    key, value = states(2, seed=1)
    got = layer.update(key, value)
    assert torch.equal(got[0], key) and torch.equal(got[1], value)
    config = tiny_config(layers=2)
    config.use_sliding_window, config.sliding_window = True, 8
    config.layer_types = ["full_attention", "sliding_attention"]
    # a sliding layer holds every token too: the masks hide what lies past its window (`kv_cache`'s text)
    assert [type(layer).__name__ for layer in growing_cache(config).layers] == ["GrowingLayer", "GrowingLayer"]


def test_sliding_layers_on_the_growing_cache_attend_to_their_window():
    """Decoding token by token past a sliding window of 4, and again after a cut back past it, gives the logits of
    one uncached pass over the sequence (transformers' own masks); with full attention they differ."""
    from conftest import tiny_model
    from specdraft.models.causal_lm import CausalLM

    config = tiny_config(layers=2)
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["full_attention", "sliding_attention"]
    model = tiny_model(config, seed=3)
    tokens = torch.arange(1, 17).unsqueeze(0)  # [1, 16]
    lm = CausalLM(model)
    lm.forward(tokens[:, :6])
    steps = [lm.forward(tokens[:, i : i + 1]).logits[0, -1] for i in range(6, 16)]  # [V] each
    lm.truncate(9)  # a rejected draft, back past the window
    again = [lm.forward(tokens[:, i : i + 1]).logits[0, -1] for i in range(9, 16)]
    with torch.inference_mode():
        want = model(tokens).logits[0]  # [16, V]
    torch.testing.assert_close(torch.stack(steps), want[6:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(again), want[9:], rtol=1e-4, atol=1e-4)
    config.layer_types = ["full_attention", "full_attention"]
    with torch.inference_mode():
        assert not torch.allclose(model(tokens).logits[0, 6:], want[6:], atol=1e-3)
