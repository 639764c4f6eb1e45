"""The cross-tokenizer aligner (posttrain.data.alignment) on strings whose two tokenizations split differently:
merges on one side, splits on the other, both at once, unicode, whitespace, special tokens with other texts, chat
templates, tokenizers whose offsets cannot be read (the sequence-alignment fallback) and text one side cannot
encode. Every expected chunk is written out as (student tokens, teacher tokens), each token's text joined by "|"."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from posttrain.config.schema import ModelConfig
from posttrain.data.alignment import Chunk, TokenSurfaces, align_tokens, chunks_of, exact_projection
from posttrain.data.formats import MessagesRow
from posttrain.data.tokenize import tokenize_sft_row
from posttrain.models.loading import load_tokenizer
from posttrain.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS


def byte_bpe(merges: list[tuple[str, str]], eos: str = "<|endoftext|>", specials: tuple[str, ...] = SPECIAL_TOKENS,
             chat: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE with the given merges (in GPT-2's byte characters: "Ġ" is a space)."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    specials = tuple(dict.fromkeys((eos, *specials)))
    for token in specials:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token="<|pad|>",
                                        clean_up_tokenization_spaces=False)
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def word_level(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer (whitespace split, [UNK] for anything else) with no decoder: its tokens carry no
    spaces and decoding joins them with one, so byte offsets cannot be read from it."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer(ModelConfig(name_or_path="posttrain/tiny"))


@pytest.fixture(scope="module")
def tiny_bpe():
    return load_tokenizer(ModelConfig(name_or_path="posttrain/tiny-bpe"))


def written(student, teacher, student_ids, teacher_ids) -> list[tuple[str, str]]:
    """The alignment's chunks as (student tokens, teacher tokens), each token's bytes as text joined by "|"."""
    s, t = TokenSurfaces(student), TokenSurfaces(teacher)
    alignment = align_tokens(student_ids, teacher_ids, s, t)

    def text(surfaces, ids):
        return "|".join(surfaces.table[i].decode("utf-8", errors="backslashreplace") for i in ids)

    return [(text(s, student_ids[c.student_start:c.student_end]), text(t, teacher_ids[c.teacher_start:c.teacher_end]))
            for c in alignment.chunks]


def both(student, teacher, text: str) -> list[tuple[str, str]]:
    return written(student, teacher, student(text, add_special_tokens=False)["input_ids"],
                   teacher(text, add_special_tokens=False)["input_ids"])


def test_merges_on_the_teacher_side(tiny, tiny_bpe):
    # tiny-bpe: 2|6|+|8|4|=|1|10 (its 20 merges join "10"); the byte-level student splits every digit.
    assert tiny_bpe.convert_ids_to_tokens(tiny_bpe("26+84=110")["input_ids"]) == ["2", "6", "+", "8", "4", "=", "1",
                                                                                "10"]
    assert both(tiny, tiny_bpe, "26+84=110") == [("2", "2"), ("6", "6"), ("+", "+"), ("8", "8"), ("4", "4"),
                                                 ("=", "="), ("1", "1"), ("1|0", "10")]
    assert both(tiny, tiny_bpe, "69+72=141") == [("6", "6"), ("9", "9"), ("+", "+"), ("7", "7"), ("2", "2"),
                                                 ("=", "="), ("1|4", "14"), ("1", "1")]


def test_splits_on_the_teacher_side(tiny, tiny_bpe):
    assert both(tiny_bpe, tiny, "69+72=141") == [("6", "6"), ("9", "9"), ("+", "+"), ("7", "7"), ("2", "2"),
                                                 ("=", "="), ("14", "1|4"), ("1", "1")]


def test_overlapping_merges_make_one_chunk_of_both():
    left, right = byte_bpe([("1", "2")]), byte_bpe([("2", "3")])
    # "1234": left 12|3|4, right 1|23|4: no boundary inside "123" is shared.
    assert both(left, right, "1234") == [("12|3", "1|23"), ("4", "4")]


def test_unicode_multibyte_characters():
    # é is two bytes (Ã© in GPT-2's characters), 日 three (æĹ¥); the student merges them, the teacher does not.
    student, teacher = byte_bpe([("Ã", "©"), ("æ", "Ĺ"), ("æĹ", "¥")]), byte_bpe([])
    assert both(student, teacher, "é日x") == [("é", "\\xc3|\\xa9"), ("日", "\\xe6|\\x97|\\xa5"), ("x", "x")]
    # A merge across a character boundary (the last byte of é with "x") is aligned on bytes, not characters.
    student = byte_bpe([("©", "x")])
    assert both(student, teacher, "éx") == [("\\xc3", "\\xc3"), ("\\xa9x", "\\xa9|x")]


def test_whitespace_runs_and_leading_spaces():
    student = byte_bpe([("Ġ", "h"), ("Ġh", "i"), ("Ġ", "Ġ"), ("Ċ", "Ċ")])
    teacher = byte_bpe([("h", "i"), ("i", "Ġ"), ("ĠĠ", "Ġ"), ("Ġ", "Ġ")])
    # " hi   \n\n": student Ġhi|ĠĠ|Ġ|ĊĊ ; teacher Ġ|hi|ĠĠĠ|Ċ|Ċ (BPE applies "hi" before "iĠ").
    assert both(student, teacher, " hi   \n\n") == [(" hi", " |hi"), ("  | ", "   "), ("\n\n", "\n|\n")]


def test_end_of_sequence_tokens_with_other_texts_align_by_role(tiny):
    teacher = byte_bpe([("1", "0")], eos="</s>")
    student_ids = tiny("110", add_special_tokens=False)["input_ids"] + [tiny.eos_token_id]
    teacher_ids = teacher("110", add_special_tokens=False)["input_ids"] + [teacher.eos_token_id]
    assert written(tiny, teacher, student_ids, teacher_ids) == [("1", "1"), ("1|0", "10"), ("\\xffEOS", "\\xffEOS")]
    # The projection maps the two end-of-sequence tokens onto each other, "10" onto nothing, "1" onto "1".
    projection = exact_projection(TokenSurfaces(teacher), TokenSurfaces(tiny))
    assert projection[teacher.eos_token_id] == tiny.eos_token_id
    assert projection[teacher.convert_tokens_to_ids("10")] == -1
    assert projection[teacher.convert_tokens_to_ids("1")] == tiny.convert_tokens_to_ids("1")


def test_special_tokens_inside_the_text_are_one_token_each_side(tiny, tiny_bpe):
    text = "<|im_start|>user\n12<|im_end|>"
    assert both(tiny, tiny_bpe, text) == [("<|im_start|>", "<|im_start|>"), ("u", "u"), ("s", "s"), ("e", "e"),
                                          ("r", "r"), ("\n", "\n"), ("1|2", "12"), ("<|im_end|>", "<|im_end|>")]


def test_chat_template_rows_align_and_the_assistant_span_is_marked_on_both_sides(tiny, tiny_bpe):
    row = MessagesRow(messages=[{"role": "user", "content": "26+84="}, {"role": "assistant", "content": "110"}])
    student = tokenize_sft_row(row, tiny, completion_only_loss=True, source="row 1")
    teacher = tokenize_sft_row(row, tiny_bpe, completion_only_loss=True, source="row 1")
    s, t = TokenSurfaces(tiny), TokenSurfaces(tiny_bpe)
    chunks = align_tokens(student.input_ids, teacher.input_ids, s, t).chunks
    completion = [c for c in chunks if all(student.loss_mask[c.student_start:c.student_end])
                  and all(teacher.loss_mask[c.teacher_start:c.teacher_end])]
    assert [(tiny.decode(student.input_ids[c.student_start:c.student_end]),
             tiny_bpe.decode(teacher.input_ids[c.teacher_start:c.teacher_end])) for c in completion] == [
        ("1", "1"), ("10", "10"), ("<|im_end|>", "<|im_end|>")]
    assert [c.student_end - c.student_start for c in completion] == [1, 2, 1]


def test_unreadable_offsets_fall_back_to_sequence_alignment(tiny):
    teacher = word_level(["hello", "world"])
    student_ids = tiny("hello world", add_special_tokens=False)["input_ids"]
    teacher_ids = teacher("hello world", add_special_tokens=False)["input_ids"]
    alignment = align_tokens(student_ids, teacher_ids, TokenSurfaces(tiny), TokenSurfaces(teacher))
    assert not alignment.exact  # the teacher's decoding puts a space its tokens do not hold
    # Each word is a chunk; the student's space, which the teacher's tokens never hold, is in none.
    assert written(tiny, teacher, student_ids, teacher_ids) == [("h|e|l|l|o", "hello"), ("w|o|r|l|d", "world")]


def test_text_one_side_cannot_encode_is_in_no_chunk(tiny):
    teacher = word_level(["12", "+", "=", "3"])
    student_ids = tiny("12 + x = 3", add_special_tokens=False)["input_ids"]
    teacher_ids = teacher("12 + x = 3", add_special_tokens=False)["input_ids"]
    assert teacher.convert_ids_to_tokens(teacher_ids) == ["12", "+", "[UNK]", "=", "3"]
    assert written(tiny, teacher, student_ids, teacher_ids) == [("1|2", "12"), ("+", "+"), ("=", "="), ("3", "3")]


def test_chunks_of_zero_byte_tokens_join_the_chunk_before():
    assert chunks_of([b"a", b"", b"b"], [b"ab"]) == [Chunk(0, 3, 0, 1)]
    assert chunks_of([b"a", b"", b"b"], [b"a", b"b"]) == [Chunk(0, 2, 0, 1), Chunk(2, 3, 1, 2)]
    assert chunks_of([b"", b"a"], [b"a"]) == [Chunk(0, 2, 0, 1)]


def test_the_same_tokenizer_gives_one_token_chunks_and_the_identity_projection(tiny):
    ids = tiny("<|im_start|>hé 12<|endoftext|>", add_special_tokens=False)["input_ids"]
    surfaces = TokenSurfaces(tiny)
    chunks = align_tokens(ids, ids, surfaces, surfaces).chunks
    assert chunks == tuple(Chunk(i, i + 1, i, i + 1) for i in range(len(ids)))
    assert exact_projection(surfaces, surfaces) == list(range(len(tiny)))


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A Llama-style BPE: "▁" marks a space (prepended to the first word), bytes it lacks fall back to <0xNN>
    tokens, and its decoder strips the space it prepended."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in ["▁", "h", "e", "l", "o", "1", "0", "▁h", "▁he", "ll", "▁hell", "▁hello", "10"]:
        vocab.setdefault(token, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("1", "0")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_sentencepiece_spaces_and_byte_fallback_tokens(tiny):
    teacher = sentencepiece_like()
    teacher_ids = teacher("hello 日10", add_special_tokens=False)["input_ids"]
    assert teacher.convert_ids_to_tokens(teacher_ids) == ["▁hello", "▁", "<0xE6>", "<0x97>", "<0xA5>", "10"]
    student_ids = tiny("hello 日10", add_special_tokens=False)["input_ids"]
    alignment = align_tokens(student_ids, teacher_ids, TokenSurfaces(tiny), TokenSurfaces(teacher))
    assert alignment.exact  # the prepended space, which the decoder strips, is dropped from the first token
    assert written(tiny, teacher, student_ids, teacher_ids) == [
        ("h|e|l|l|o", " hello"), (" ", " "), ("\\xe6", "\\xe6"), ("\\x97", "\\x97"), ("\\xa5", "\\xa5"),
        ("1|0", "10")]
