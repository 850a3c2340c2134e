"""The one model interface the engine sees: a causal LM with its own KV cache.

`CausalLM` runs `tokens[1, T]` at the positions that follow its cache, returns
`logits[1, T', V]` for the last T' positions asked for, and can cut its cache back to a
length (rollback after a rejected draft) or to an accepted tree path. No model-name special cases live above this file.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdraft.errors import SpecdraftError
from specdraft.kernels import numerics, prompt_pass, tiles
from specdraft.models.attention import FEW_QUERIES, attends_token_by_token, use_grouped_sdpa
from specdraft.models.fused_decoder import fused_decoder
from specdraft.models.graph_decoder import StaticDecoder, static_obstacle
from specdraft.models.kv_cache import growing_cache

if TYPE_CHECKING:  # transformers' modeling is imported where a model is built, not with this module
    from transformers import PreTrainedModel

# Prompt tokens one prefill pass reads at most. A batch reads a joining prompt this much between its steps, so a
# long prompt stalls the running answers for one chunk's time at a step, not for the whole prompt's.
PREFILL_CHUNK = 128
# Where a model keeps the feature layers its drafters asked for (`CausalLM.read_features_at`): an attribute of the
# transformers model, so every `CausalLM` over the same weights (a batch's prompt reader too) returns the same states.
FEATURE_CLAIMS = "_specdraft_feature_claims"


class _FeatureClaims(weakref.WeakKeyDictionary):
    """Drafter -> the layers it reads (held weakly). A copy or a pickle of the model starts with none: the claims
    are of the live drafters over these very weights."""

    def __copy__(self) -> "_FeatureClaims":
        return _FeatureClaims()

    def __deepcopy__(self, memo: dict) -> "_FeatureClaims":
        return _FeatureClaims()

    def __reduce__(self):
        return _FeatureClaims, ()


@dataclass
class ForwardOutput:
    """Logits of the positions asked for, and the final hidden states when asked (or the states entering the
    layers `CausalLM.feature_layers` names, side by side, where a drafter asked for those)."""

    logits: torch.Tensor  # [1, T', V] float32 (the model's values, e.g. its bf16 logits, widened exactly)
    hidden_states: torch.Tensor | None = None  # [1, T'', hidden] after the final norm, or [1, T'', n * hidden]


def wants_static_cache(model: PreTrainedModel, static_cache: bool | None,
                       config: numerics.NumericConfig | None = None) -> bool:
    """Whether `model` runs on a `StaticDecoder`: `static_cache` if given, else `config.static_cache`
    (`SPECDRAFT_STATIC_CACHE`: `1` where the model qualifies, on any device; `0` never; `auto`: on CUDA where the
    model qualifies)."""
    setting = (config or numerics.current()).static_cache if static_cache is None else static_cache
    if setting in (False, "0"):
        return False
    qualifies = static_obstacle(model) is None
    if setting is True and not qualifies:
        raise SpecdraftError(f"This model cannot run on a static cache: {static_obstacle(model)}.")
    on_gpu = next(model.parameters()).device.type == "cuda"
    return qualifies and (on_gpu or setting in (True, "1"))


class CausalLM:
    """A Hugging Face causal LM, its tokenizer, and a KV cache that can be cut back.

    `cache_len` is how many tokens of the sequence the cache holds; `forward` appends the
    new tokens at positions `cache_len ..`, `truncate(n)` forgets everything past `n`.

    On CUDA (or with `static_cache=True`) a qualifying model runs on a `graph_decoder.StaticDecoder`: a
    preallocated cache and one captured CUDA graph per pass width, captured here, at load; with `warm=False` each
    as a pass first needs it (a batch's prompt reader and packed draft caches, made as requests come).

    `numerics`: the numeric choices the model runs with (`kernels.numerics`; default: the `SPECDRAFT_*` variables at
    load), kept for its life.
    """

    def __init__(self, model: PreTrainedModel, tokenizer=None, name: str = "model",
                 static_cache: bool | None = None, warm: bool = True,
                 numerics_config: numerics.NumericConfig | None = None) -> None:
        self.model = model.eval()
        self.numerics = numerics_config or numerics.current()
        use_grouped_sdpa(model)
        self._static = StaticDecoder(model) if wants_static_cache(model, static_cache, self.numerics) else None
        if self._static is not None and warm:
            self._static.warm_up()
        # transformers >= 5.24 takes the cache as `cache` (`past_key_values` is deprecated there)
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.reset()

    # ----- facts about the model -------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's hidden states: what its input embedding gives (a packed model also holds
        float32 parameters, so its first parameter's dtype can mislead)."""
        with torch.inference_mode():
            token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            return self.model.get_input_embeddings()(token).dtype

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's length when the embedding is padded)."""
        return int(self.model.get_output_embeddings().out_features)

    @property
    def static(self) -> bool:
        """Whether it runs on a preallocated (GPU) cache of one sequence, not the growing one."""
        return self._static is not None

    @property
    def widest_graph(self) -> int | None:
        """The widest pass that replays a captured CUDA graph (a wider one runs eagerly, at several times its cost);
        None where passes are not captured (the CPU)."""
        return self._static.widest_graph if self._static is not None else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached token takes: the keys and values of every layer (sliding-window layers counted in full)."""
        config = self.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return 2 * config.num_hidden_layers * kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def head_dim(self) -> int:
        """The size of one attention head."""
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    @property
    def reads_split_exactly(self) -> bool:
        """Whether a prompt read in any split (cached rows of its prefix, then the rest) holds the bits of one read,
        so cached rows may stand in for reading a prefix (`prefix_cache`). So where every token is computed alone
        whatever the pass: a growing cache over full attention, attention on the C kernel
        (`attention.attends_token_by_token`), every layer fused on the tile kernels (`fused_decoder`: they compute a
        token alone, and a pass of a few tokens runs fused, a wider one through transformers' layers on the same
        kernels, the same bits), and not AMX, whose fused layers keep its 16-bit tiles where a prompt's wide passes
        take int8 ones."""
        return (self._static is None and self._sliding_window() is None
                and attends_token_by_token(self.model, self.device, self.dtype, self.head_dim)
                and fused_decoder(self.model) is not None and tiles.tile_kernel(self.numerics) is not tiles.AMX)

    @property
    def max_context(self) -> int:
        """The longest sequence (prompt + generated) the model's positions allow."""
        return int(getattr(self.config, "max_position_embeddings", None) or 1 << 30)

    @property
    def eos_token_ids(self) -> set[int]:
        """Every end-of-sequence id that the model's generation config or tokenizer names."""
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is None:
                continue
            ids.update([value] if isinstance(value, int) else list(value))
        return ids

    def num_parameters(self) -> int:
        """Distinct weights (a tied embedding and LM head count once; packed weights count as weights)."""
        seen, total = set(), 0
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel()
        return total + _packed_weights(self.model)

    # ----- which hidden states a pass returns ----------------------------------------------------------------
    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The layers whose input states a pass returns as its hidden states (`hidden_to_keep`), side by side
        `[.., n * hidden]`: transformers' `hidden_states[i]` (0: the embeddings, i: decoder layer i - 1's output).
        None: the final hidden states (after the norm), as every drafter but EAGLE-3 reads them."""
        claims = getattr(self.model, FEATURE_CLAIMS, None)
        live = list(claims.values()) if claims is not None else []  # a dead drafter's claim has gone
        return live[-1] if live else None

    def read_features_at(self, owner: object, layers: tuple[int, ...] | None) -> None:
        """Make the passes of this model (every `CausalLM` over its weights) return the input states of `layers` as
        their hidden states (None: the final ones), for as long as `owner` (a drafter) lives: the claim is held
        weakly, and the last claim made of those alive decides (claiming again makes it the last). Passes on the fused
        C decoder copy those rows out on its way (`FusedDecoder.run`), the others read transformers' `hidden_states`
        (the same bits); a static (GPU) cache returns none and is refused."""
        count = self.config.num_hidden_layers
        if layers is not None and any(not 0 <= i < count for i in layers):
            raise SpecdraftError(f"{self.name} has {count} layers: layer inputs 0 .. {count - 1}, not {list(layers)}.")
        if layers is not None and self._static is not None:
            raise SpecdraftError(f"{self.name} runs on a static (GPU) cache, whose passes return only the final "
                                 "hidden states; a drafter that reads intermediate layers (eagle3) needs "
                                 "SPECDRAFT_STATIC_CACHE=0.")
        claims = getattr(self.model, FEATURE_CLAIMS, None)
        if claims is None:
            claims = _FeatureClaims()
            self.model.__dict__[FEATURE_CLAIMS] = claims  # a plain attribute: no module, parameter or buffer
        claims.pop(owner, None)  # to the end: the last claim decides
        claims[owner] = None if layers is None else tuple(layers)

    def _kept_states(self, states: tuple[torch.Tensor, ...], layers: tuple[int, ...] | None,
                     keep: int) -> torch.Tensor:
        """The last `keep` rows `[1, keep, H or n * H]` of transformers' hidden states: the final ones, or those
        entering `layers` side by side."""
        chosen = states[-1] if layers is None else torch.cat([states[i] for i in layers], dim=-1)
        return chosen[:, -keep:]

    # ----- the cache ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the whole sequence."""
        self.cache_len = 0
        if self._static is not None:
            return
        self._cache = growing_cache(self.config)
        # Layers of other kinds than `GrowingLayer` otherwise drop states they no longer need, and could not be cut back.
        self._cache.activate_past_recording()
        self.cache_len = 0

    def truncate(self, length: int) -> None:
        """Cut the cache back to its first `length` tokens (a no-op when it is not longer). Each layer is cut by
        what it holds, so this also undoes a pass that failed part-way: its first layers hold its rows, and
        `cache_len` does not count them yet."""
        if length < 0:
            raise ValueError(f"cannot truncate to a negative length {length}")
        if self._static is None:  # a static cache's slots past cache_len are simply overwritten
            for layer in self._cache.layers:
                excess = layer.get_seq_length() - length
                if excess > 0:
                    layer.crop(-excess)
        self.cache_len = min(self.cache_len, length)

    @torch.inference_mode()
    def append_cache(self, other: "CausalLM") -> None:
        """Append `other`'s cached tokens (the same model's: e.g. a prompt read alone into a cache of its own)
        after this cache's, as they are: how a packed batch takes in a joining sequence exactly as it would have
        read it alone (`batch_engine`). Both caches are growing ones, or both static (GPU) ones."""
        if (self._static is None) != (other._static is None):
            raise SpecdraftError("Cached tokens move between two growing KV caches or two static ones, not across.")
        if self._static is not None:
            self._static.append(self.cache_len, other._static, other.cache_len)
            self.cache_len += other.cache_len
            return
        self.append_rows(other.rows(other.cache_len))

    def rows(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer, the keys and values `[1, kv_heads, count, d]` of the first `count` cached tokens (views: clone
        to keep them past the next edit), None for a layer that holds none. Growing caches only."""
        if self._static is not None:
            raise SpecdraftError("Cached rows are read from a growing KV cache, not a static (GPU) one.")
        if not 0 <= count <= self.cache_len:
            raise ValueError(f"count must be in [0, {self.cache_len}], got {count}")
        return [None if layer.keys is None or layer.keys.numel() == 0
                else (layer.keys[..., :count, :], layer.values[..., :count, :]) for layer in self._cache.layers]

    @torch.inference_mode()
    def append_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Append cached rows of this model (`rows` of a cache over the same weights) after this cache's tokens."""
        if self._static is not None:
            raise SpecdraftError("Cached rows are appended to a growing KV cache, not a static (GPU) one.")
        added = 0
        for mine, theirs in zip(self._cache.layers, rows):
            if theirs is None:
                continue
            keys, values = theirs
            added = keys.shape[-2]
            length = mine.reserve(keys, values, added)
            mine.key_buffer[..., length : length + added, :] = keys
            mine.value_buffer[..., length : length + added, :] = values
            mine.advance(length + added)
        self.cache_len += added

    # ----- running it ----------------------------------------------------------------------
    @torch.inference_mode()
    def keep(self, start: int, rows: list[int]) -> None:
        """Keep the cache's first `start` tokens and, after them, the tokens fed at `start + r` for
        each r in `rows` (increasing): what is left of a tree pass once its accepted path is known.

        Example: start 10, rows [0, 2] after a pass that fed positions 10..13 -> the cache holds
        0..9, then what was fed at 10 and 12; cache_len 12.
        """
        if self._static is not None:
            self._static.cache.keep(start, rows)
        elif rows != list(range(len(rows))):
            span = self.cache_len - start  # tokens after `start`, the last `span` of every layer's states
            for layer in self._cache.layers:
                if layer.keys is None or layer.keys.numel() == 0:
                    continue
                first = layer.keys.shape[-2] - span
                source = torch.tensor(rows, device=layer.keys.device) + first
                layer.keys[:, :, first : first + len(rows)] = layer.keys[:, :, source]
                layer.values[:, :, first : first + len(rows)] = layer.values[:, :, source]
        self.truncate(start + len(rows))

    def _attention_mask(self, length: int, visible: torch.Tensor) -> torch.Tensor:
        """An additive mask `[1, 1, T, cache_len + T]`: the cache is visible except where `visible`
        (`[T, S]`, over the last S keys) says otherwise. For tree passes; full attention only."""
        keys = self.cache_len + length
        window = self._sliding_window()
        if window is not None and keys >= window:
            raise SpecdraftError(
                f"{self.name} uses a sliding attention window of {window} tokens and the sequence reaches {keys}: "
                "tree drafts need full attention there. Use a chain (--tree-budget 0)."
            )
        allowed = torch.ones(length, keys, dtype=torch.bool, device=visible.device)
        allowed[:, keys - visible.shape[1] :] = visible
        dtype = self.dtype  # (an embedding lookup: asked once)
        mask = torch.zeros(length, keys, dtype=dtype, device=visible.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min).view(1, 1, length, keys)

    def _sliding_window(self) -> int | None:
        """The smallest attention window of any layer, None when every layer attends to everything."""
        kinds = getattr(self.config, "layer_types", None)
        window = getattr(self.config, "sliding_window", None)
        if kinds is not None and "sliding_attention" not in kinds:
            return None
        return int(window) if window else None

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [1, T] int64, placed at positions cache_len .. cache_len + T - 1
        logits_to_keep: int = 1,
        hidden_to_keep: int = 0,
        offsets: torch.Tensor | None = None,  # [T] positions relative to cache_len (tree: depths); None = 0..T-1
        visible: torch.Tensor | None = None,  # [T, S] bool: which of the last S keys each token sees; None = causal
        prompt: bool = False,
        reach: int | None = None,  # the furthest position fed + 1, where the caller knows it (a packed batch)
    ) -> ForwardOutput:
        """Append `tokens` to the cache and return logits for the last `logits_to_keep` of them (and
        final hidden states for the last `hidden_to_keep`, when > 0).

        Logits come widened to float32 (exactly): on the CPU an argmax over 151,936 bf16 values took
        0.50 ms and over float32 0.09 ms, and every step takes several.

        `offsets` and `visible` run a tree pass (see `tree.TreeLayout.block_attention`): tokens
        share positions by depth and see only their ancestors among the last S keys.

        `reach`: how far the pass reaches into the sequence, checked against the context. A packed cache holds
        several sequences, so its length is no position there: its caller says how far its furthest token is.
        Without it, the cache length plus the offsets' reach (a tree's depths) or the pass's width.

        `prompt`: a prompt pass, where packed tile weights multiply int8 activations if the CPU has
        AVX-512 VNNI or AVX2 (each native library's `int8_tiles.h`: faster kernels, a slightly different
        function). For the prompt (`prefill`) and a draft's reads, never for a pass that scores a draft, unless
        every pass runs so (`kernels/prompt_pass`: the default on the AVX2 and AVX-512 kernels).
        """
        if self._static is None and (prompt or tiles.int8_every_pass(self.numerics)) and not prompt_pass.inside():
            first_position = self.cache_len + (int(offsets[0]) if offsets is not None else 0)
            with prompt_pass.prompt_pass(starts_sequence=first_position == 0):  # a packed batch's sequence too
                return self.forward(tokens, logits_to_keep, hidden_to_keep, offsets, visible, reach=reach)
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"tokens must be [1, T], got {tuple(tokens.shape)}")
        length = tokens.shape[1]
        if reach is None:  # on the static (GPU) cache reading the offsets would cost a device sync: the width bounds them
            reach = self.cache_len + (int(offsets.max()) + 1 if offsets is not None and self._static is None else length)
        if reach > self.max_context:
            raise SpecdraftError(
                f"The sequence would reach {reach} tokens, past {self.name}'s context of "
                f"{self.max_context}. Shorten the prompt or lower --max-new-tokens."
            )
        layers = self.feature_layers if hidden_to_keep > 0 else None  # intermediate layers a drafter reads
        if self._static is not None:
            if layers is not None:
                raise SpecdraftError("A static (GPU) cache returns no intermediate layers "
                                     "(set SPECDRAFT_STATIC_CACHE=0).")
            positions = None if offsets is None else offsets + self.cache_len  # None: consecutive
            return self._static_forward(tokens[0], positions, visible, logits_to_keep, hidden_to_keep)
        if offsets is None:
            offsets = torch.arange(length, device=tokens.device)
        mask = None if visible is None else self._attention_mask(length, visible)
        # Passes over a cache (and single tokens) may run fused: the same function, the layers in one C
        # call; prefills keep PyTorch's batched attention, as `attention.grouped_sdpa_forward` does.
        fused = fused_decoder(self.model) if length <= FEW_QUERIES and (self.cache_len or length == 1) else None
        if fused is not None:
            hidden, features = fused.run(self._cache, self.cache_len, tokens, (offsets + self.cache_len).unsqueeze(0),
                                         None if mask is None else mask.view(length, -1).float().contiguous(),
                                         layers)  # [1, T, H], and [1, T, n * H] where a drafter asked for layers
            self.cache_len += length
            logits = fused.logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)  # [1, T', V]
            kept = hidden if features is None else features
            return ForwardOutput(logits=logits.float(),
                                 hidden_states=kept[:, -hidden_to_keep:] if hidden_to_keep > 0 else None)
        out = self.model(
            input_ids=tokens,
            position_ids=(offsets + self.cache_len).unsqueeze(0),
            attention_mask=mask,
            **{self._cache_argument: self._cache},
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=hidden_to_keep > 0,
        )
        self.cache_len += length
        hidden = self._kept_states(out.hidden_states, layers, hidden_to_keep) if hidden_to_keep > 0 else None
        return ForwardOutput(logits=out.logits.float(), hidden_states=hidden)

    def _static_forward(self, tokens: torch.Tensor, positions: torch.Tensor | None, visible: torch.Tensor | None,
                        logits_to_keep: int, hidden_to_keep: int) -> ForwardOutput:  # tokens, positions: [T]
        hidden, logits = self._static.run(tokens, positions, self.cache_len, visible, logits_to_keep)
        self.cache_len += tokens.shape[0]
        return ForwardOutput(logits=logits.to(torch.float32, copy=True).unsqueeze(0),  # [1, T', V]: the buffers are reused
                             hidden_states=hidden[-hidden_to_keep:].clone().unsqueeze(0) if hidden_to_keep > 0 else None)

    def prefill(self, tokens: torch.Tensor, hidden: bool = False) -> torch.Tensor | None:  # tokens: [1, T]
        """Run `tokens` into the cache; no logits are needed (the engine scores the last token itself).
        With `hidden`, returns their final hidden states. # [T, H]

        A prompt pass (see `forward`): plain and speculative decoding prefill alike, and no pass
        that scores a draft runs this way, so speculation stays exact against plain decoding. It reads
        PREFILL_CHUNK tokens a pass, so a batch can read a joining prompt a chunk between its steps and hold
        the very states a request read alone holds."""
        if tokens.shape[1] == 0:
            width = self.config.hidden_size * len(self.feature_layers or (None,))
            return tokens.new_zeros(0, width, dtype=self.dtype) if hidden else None
        states = []
        for start in range(0, tokens.shape[1], PREFILL_CHUNK):
            chunk = tokens[:, start : start + PREFILL_CHUNK]
            out = self.forward(chunk, logits_to_keep=1, hidden_to_keep=chunk.shape[1] if hidden else 0, prompt=True)
            if hidden:
                states.append(out.hidden_states[0])
        return torch.cat(states) if hidden else None


def _packed_weights(module: torch.nn.Module) -> int:
    """The weights `module`'s packed parts hold, each counted once: a module that counts its own (`num_packed_weights`)
    is not looked into (a split linear's two 4-bit halves are one matrix's weights)."""
    if hasattr(module, "num_packed_weights"):
        return module.num_packed_weights()
    return sum(_packed_weights(child) for child in module.children())
