"""The embedded tool-use task (posttrain/arithmetic-tools): fixed rows on every machine, disjoint splits, right
answers, and SFT episodes whose calculator calls parse, compute the answer and are the only tool turns trained."""

import hashlib
import json

from posttrain.data.embedded import iter_embedded
from posttrain.data.formats import MessagesRow
from posttrain.data.tokenize import tokenize_sft_row
from posttrain.envs.tools.builtin import calculate
from posttrain.envs.tools.formats import parser_of
from posttrain.envs.word_problems import WordProblem, split_of
from posttrain.models.tiny import build_tokenizer


def rows(source):
    return [row for _, row in iter_embedded(source)]


def test_rows_are_fixed_and_the_splits_disjoint():
    train, heldout = rows("posttrain/arithmetic-tools:train"), rows("posttrain/arithmetic-tools:heldout")
    assert (len(train), len(heldout)) == (20_000, 2_000)
    assert train[0] == {"prompt": [{"role": "user", "content": "Sam had 54235 beads and got 25864 more. How many "
                                                               "beads now?"}], "answer": "80099"}
    questions = [row["prompt"][0]["content"] for row in train]
    assert len(set(questions)) == len(questions)
    assert not set(questions) & {row["prompt"][0]["content"] for row in heldout}
    assert hashlib.sha256(json.dumps(heldout).encode()).hexdigest()[:16] == HELDOUT_SHA256_PREFIX
    assert rows("posttrain/arithmetic-tools:heldout[:3]") == heldout[:3]


def test_answers_follow_the_verb_and_are_never_negative():
    for row in rows("posttrain/arithmetic-tools:heldout"):
        words = row["prompt"][0]["content"].split()
        a, b = int(words[2]), int(words[6] if "got" in words else words[7].rstrip("."))
        expected = a + b if "got" in words else a - b
        assert row["answer"] == str(expected) and expected >= 0 and 10_000 <= min(a, b) and max(a, b) <= 99_999
    assert split_of(WordProblem(12345, 54321, "+", "Ava", "coins")) in ("train", "heldout")


def test_sft_episodes_call_the_calculator_and_train_only_the_assistant_turns():
    tokenizer, hermes = build_tokenizer(), parser_of("hermes")
    episodes = rows("posttrain/arithmetic-tools-sft:train[:50]")
    assert [row["messages"][0] for row in episodes] == [row["prompt"][0] for row in rows(
        "posttrain/arithmetic-tools:train[:50]")]
    for row in episodes:
        user, call, result, answer = row["messages"]
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
        (parsed,) = hermes.parse(call["content"]).calls
        assert parsed.name == "calculator" and str(calculate(parsed.arguments["expression"])) == result["content"]
        assert answer["content"] == result["content"]
    example = tokenize_sft_row(MessagesRow(messages=episodes[0]["messages"]), tokenizer, True, "row 1")
    trained = tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])
    call, result = episodes[0]["messages"][1]["content"], episodes[0]["messages"][2]["content"]
    assert trained == f"{call}<|im_end|>{result}<|im_end|>"  # the call and the answer; not the tool's message
    assert len(example.input_ids) <= 256  # the presets' data.max_length


def test_the_mixed_sft_set_works_four_problems_in_ten_with_the_calculator_and_answers_the_rest_directly():
    mixed = rows("posttrain/arithmetic-tools-mixed-sft:train[:40]")
    worked = rows("posttrain/arithmetic-tools-sft:train[:40]")
    problems = rows("posttrain/arithmetic-tools:train[:40]")
    for index, (row, episode, problem) in enumerate(zip(mixed, worked, problems, strict=True)):
        if index % 10 < 4:
            assert row == episode
        else:  # the same question, answered at once: no call, no tool turn
            assert row["messages"] == [problem["prompt"][0], {"role": "assistant", "content": problem["answer"]}]
    assert sum(len(row["messages"]) == 4 for row in mixed) == 16


HELDOUT_SHA256_PREFIX = "672eb0d19dd57fc1"
