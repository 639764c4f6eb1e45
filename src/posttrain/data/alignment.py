"""Aligning two tokenizations of the same text, for distillation from a teacher with another tokenizer.

A row is tokenized by the student's tokenizer and by the teacher's. Each token's text is known from its bytes, so
each side's token boundaries are byte offsets into the row's text. A **chunk** is a shortest span of text that both
sides cover with whole tokens: it starts and ends where a student-token boundary and a teacher-token boundary
coincide, and no such boundary lies inside it. "26+84=110" with student tokens 2|6|+|8|4|=|1|1|0 and teacher tokens
2|6|+|84|=|1|10 gives the chunks 2, 6, +, 84 (student 8|4, teacher 84), =, 1, 10 (student 1|0, teacher 10).

Token bytes (`TokenSurfaces`): for a byte-level BPE (GPT-2, Llama 3, Qwen), each character of the token string is
one byte through GPT-2's byte-to-unicode table; for a SentencePiece-style vocabulary, "▁" is a space and "<0xNN>"
byte-fallback tokens are the byte NN; special and added tokens are their content, except the end-of-sequence,
beginning-of-sequence and padding tokens, which are the bytes b"\\xffEOS", b"\\xffBOS", b"\\xffPAD" on both sides (0xFF
never occurs in UTF-8 text), so a teacher's "</s>" and a student's "<|endoftext|>" align as one chunk. These offsets
are exact where they reproduce the tokenizer's own decoding of the row (checked row by row).

Fallback: where a side's token bytes are unknown or do not reproduce its decoding (a normalizer, a decoder that
writes spaces its tokens do not hold), each token's text is its bytes where known, else its decoding alone, and the two sides' texts are aligned
by a sequence alignment (difflib's longest matching blocks, on bytes); boundaries coincide where the alignment maps
one onto the other inside a matched block. The same alignment serves rows whose two texts differ (a truncation
that cut one side shorter, a character one tokenizer cannot encode): only chunks of matched text are produced there.

Departures from the peers: TRL's GOLD groups tokens where their byte offsets coincide, as here; NeMo-RL aligns the
token sequences by dynamic programming on token strings. Here offsets come from the token ids themselves (no second
tokenization of the text, which would have to repeat the chat template and the prompt/completion split exactly).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing transformers takes seconds
    from transformers import PreTrainedTokenizerBase

ROLE_SURFACES = {"eos_token": b"\xffEOS", "bos_token": b"\xffBOS", "pad_token": b"\xffPAD"}
"""The bytes the end/beginning-of-sequence and padding tokens stand for on either side, whatever their text."""

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class Chunk:
    """One aligned span: student tokens [student_start, student_end) and teacher tokens [teacher_start, teacher_end)
    of the row cover the same text (each side at least one token)."""

    student_start: int
    student_end: int
    teacher_start: int
    teacher_end: int

    @property
    def one_to_one(self) -> bool:
        return self.student_end - self.student_start == 1 and self.teacher_end - self.teacher_start == 1


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character a byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


GPT2_BYTES = _gpt2_byte_table()


class TokenSurfaces:
    """Each token id's bytes in the text (see the module docstring), or None where they cannot be known."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        byte_level = _decoder_kind(tokenizer) == "ByteLevel"
        special: dict[int, bytes] = {}
        for token_id, added in tokenizer.added_tokens_decoder.items():
            special[token_id] = added.content.encode()
        for role, surface in ROLE_SURFACES.items():
            token_id = getattr(tokenizer, f"{role}_id")
            if token_id is not None:
                special[token_id] = surface
        self.table: dict[int, bytes | None] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id in special:
                self.table[token_id] = special[token_id]
            elif byte_level:
                self.table[token_id] = (bytes(GPT2_BYTES[ch] for ch in token)
                                        if all(ch in GPT2_BYTES for ch in token) else None)
            elif match := _BYTE_FALLBACK.fullmatch(token):
                self.table[token_id] = bytes([int(match.group(1), 16)])
            else:
                self.table[token_id] = token.replace("▁", " ").encode()

    def exact(self, ids: Sequence[int]) -> list[bytes] | None:
        """The tokens' bytes when they reproduce the tokenizer's decoding of `ids`, else None. A SentencePiece
        decoder drops the space its pre-tokenizer prepended to the first word ("▁hello" decodes as "hello" at the
        start): when that alone tells the two apart, the first token's leading space is dropped too."""
        pieces = [self.table.get(token_id) for token_id in ids]
        if any(piece is None for piece in pieces):
            return None
        decoded = self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        roles = {surface: getattr(self.tokenizer, role) for role, surface in ROLE_SURFACES.items()
                 if getattr(self.tokenizer, role) is not None}
        text = b"".join(roles[p].encode() if p in roles else p for p in pieces).decode("utf-8", errors="replace")
        if text == decoded:
            return pieces
        if pieces and pieces[0][:1] == b" " and text[1:] == decoded:
            return [pieces[0][1:], *pieces[1:]]
        return None

    def decoded(self, ids: Sequence[int]) -> list[bytes]:
        """The fallback's token texts: each token's bytes where the vocabulary tells them (byte-fallback tokens are
        no character alone), else the token decoded alone."""
        return [self.table[t] if self.table.get(t) is not None
                else self.tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode()
                for t in ids]


def _decoder_kind(tokenizer: PreTrainedTokenizerBase) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)  # slow (Python) tokenizers have none
    decoder = backend.decoder if backend is not None else None
    return type(decoder).__name__ if decoder is not None else None


@dataclass(frozen=True)
class Alignment:
    """The chunks of one row, in order, and whether the offsets were exact (False: the sequence-alignment
    fallback)."""

    chunks: tuple[Chunk, ...]
    exact: bool


def align_tokens(student_ids: Sequence[int], teacher_ids: Sequence[int], student: TokenSurfaces,
                 teacher: TokenSurfaces) -> Alignment:
    """The chunks of a row tokenized as `student_ids` by the student's tokenizer and `teacher_ids` by the
    teacher's (see the module docstring)."""
    student_pieces, teacher_pieces = student.exact(student_ids), teacher.exact(teacher_ids)
    exact = student_pieces is not None and teacher_pieces is not None
    if not exact:
        student_pieces, teacher_pieces = student.decoded(student_ids), teacher.decoded(teacher_ids)
    return Alignment(tuple(chunks_of(student_pieces, teacher_pieces)), exact and
                     b"".join(student_pieces) == b"".join(teacher_pieces))


def chunks_of(student_pieces: Sequence[bytes], teacher_pieces: Sequence[bytes]) -> list[Chunk]:
    """Chunks of two token sequences given each token's bytes: boundaries where both sides' cumulative byte offsets
    meet (the same text), else where a sequence alignment of the two texts maps one side's boundary onto the
    other's. A token of no bytes joins the chunk before it (the one after it at the start). Spans between two
    boundaries whose texts differ (only in the fallback) are no chunk."""
    student_ends, teacher_ends = _ends(student_pieces), _ends(teacher_pieces)
    student_text, teacher_text = b"".join(student_pieces), b"".join(teacher_pieces)
    if student_text == teacher_text:
        meet = {offset: offset for offset in student_ends}
    else:
        meet = {}
        matcher = difflib.SequenceMatcher(None, student_text, teacher_text, autojunk=False)
        for start_s, start_t, size in matcher.get_matching_blocks():
            for k in range(size + 1):
                meet.setdefault(start_s + k, start_t + k)
    # The last token index ending at each offset: zero-byte tokens join the chunk before them.
    last_student = {end: i + 1 for i, end in enumerate(student_ends)}
    last_teacher = {end: j + 1 for j, end in enumerate(teacher_ends)}
    boundaries = [(0, 0)]
    for offset in sorted(last_student):
        target = meet.get(offset)
        if offset > 0 and target is not None and target in last_teacher:
            boundaries.append((last_student[offset], last_teacher[target]))
    chunks: list[Chunk] = []
    s0, t0 = 0, 0
    for s1, t1 in boundaries[1:]:
        if s1 == s0 and t1 == t0:
            continue
        # Between boundaries the two texts may differ in the fallback: text only one side holds (one side does not
        # advance) or unmatched stretches. No chunk there.
        if s1 > s0 and t1 > t0 and b"".join(student_pieces[s0:s1]) == b"".join(teacher_pieces[t0:t1]):
            chunks.append(Chunk(s0, s1, t0, t1))
        s0, t0 = s1, t1
    return chunks


def _ends(pieces: Sequence[bytes]) -> list[int]:
    ends, offset = [], 0
    for piece in pieces:
        offset += len(piece)
        ends.append(offset)
    return ends


def exact_projection(teacher: TokenSurfaces, student: TokenSurfaces) -> list[int]:
    """For each teacher token id, the student token id with exactly the same bytes (role tokens: the same role),
    or -1: the one-to-one vocabulary matches through which a teacher's distribution is carried onto the student's
    vocabulary. Index = teacher id (0 .. max teacher id)."""
    by_bytes: dict[bytes, int] = {}
    for token_id in sorted(student.table):
        surface = student.table[token_id]
        if surface is not None:
            by_bytes.setdefault(surface, token_id)
    projection = [-1] * (max(teacher.table) + 1)
    for token_id, surface in teacher.table.items():
        if surface is not None:
            projection[token_id] = by_bytes.get(surface, -1)
    return projection
