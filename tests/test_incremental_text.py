"""Streamed text decoded a step at a time: every step's text is the whole answer's decode, from a few tokens."""

from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from specdraft.text import DECODE_CONTEXT, IncrementalText

TEXTS = st.text(st.characters(codec="utf-8"), max_size=80)  # any character (several bytes split across tokens)
CHUNKS = st.lists(st.integers(1, 5), min_size=1, max_size=40)  # tokens committed a step, cycled
EXTRA = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=6)  # (where, which id) inserted


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: ▁ for spaces, unknown characters as byte pieces, and a decoder that strips the
    first token's space (so a decode depends on where it starts)."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "é", "▁a", "▁b", "ab", "▁ab", "▁é"]
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "é")]
    model = models.BPE({piece: i for i, piece in enumerate(pieces)}, merges, byte_fallback=True, unk_token="<unk>",
                       fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


SENTENCEPIECE = sentencepiece_like()


def _ids(tokenizer, text: str, extra: list[tuple[int, int]]) -> list[int]:
    """`text`'s ids with arbitrary ids (special ones, lone bytes) inserted."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for where, which in extra:
        ids.insert(where % (len(ids) + 1), which % len(tokenizer))
    return ids


def _assert_streams_exactly(tokenizer, ids: list[int], chunks: list[int]) -> None:
    inc, before, step = IncrementalText(tokenizer), [], 0
    while len(before) < len(ids):
        new = ids[len(before) : len(before) + chunks[step % len(chunks)]]
        texts, stopped = inc.token_texts(before, new)
        assert not stopped
        assert texts == [inc.decode(before + new[:j]) for j in range(1, len(new) + 1)]
        before, step = before + new, step + 1


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, chunks=CHUNKS, extra=EXTRA)
def test_byte_level_text_is_the_whole_decode_at_every_token(tiny_tokenizer, text, chunks, extra):
    _assert_streams_exactly(tiny_tokenizer, _ids(tiny_tokenizer, text, extra), chunks)


@settings(max_examples=80, deadline=None)
@given(text=TEXTS, chunks=CHUNKS, extra=EXTRA)
def test_sentencepiece_text_is_the_whole_decode_at_every_token(text, chunks, extra):
    _assert_streams_exactly(SENTENCEPIECE, _ids(SENTENCEPIECE, text, extra), chunks)


class _Counting:
    """A tokenizer that records how many ids each decode was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **options):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **options)


def test_a_step_decodes_its_new_tokens_and_a_few_before_not_the_whole_answer(tiny_tokenizer):
    ids = tiny_tokenizer("The quick brown fox jumps over the lazy dog. " * 20, add_special_tokens=False)["input_ids"]
    assert len(ids) > 150
    counting = _Counting(tiny_tokenizer)
    inc, before = IncrementalText(counting), []
    for start in range(0, len(ids), 3):
        counting.lengths.clear()
        new = ids[start : start + 3]
        texts, _ = inc.token_texts(before, new)
        assert texts[-1] == tiny_tokenizer.decode(before + new)
        if start >= 30:
            assert max(counting.lengths) <= DECODE_CONTEXT + len(new)
        before += new
