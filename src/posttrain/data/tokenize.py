"""Tokenizing SFT rows into input ids and loss masks.

loss_mask[t] = 1 marks input_ids[t] as a target predicted from positions < t; position 0 is never a target.

- text: every token but the first is a target; EOS is appended when the tokenizer has one.
- prompt/completion strings: the prompt is tokenized with the tokenizer's special tokens (BOS), the
  completion without them and followed by EOS. Tokenizing the two separately, as TRL does, can split the
  boundary differently from tokenizing their concatenation; it matches how prompts are fed at generation.
- conversations: rendered with the tokenizer's chat template. Real templates carry no
  {% generation %} markers, so assistant tokens are located by rendering: for assistant message i the
  text between the rendering of messages[:i] with the generation prompt and the rendering of
  messages[:i+1] is its span (content plus end-of-turn token). The whitespace a template writes after
  the end-of-turn token (ChatML's newline) is never generated, so it is not a target.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal


from jinja2.exceptions import TemplateError

from posttrain.data.errors import DataError
from posttrain.data.formats import Message, Messages, MessagesRow, PromptCompletionRow, TextRow
from posttrain.data.types import TokenizedExample

if TYPE_CHECKING:  # annotations only: importing transformers takes seconds
    from transformers import PreTrainedTokenizerBase


def tokenize_sft_row(
    row: TextRow | PromptCompletionRow | MessagesRow,
    tokenizer: PreTrainedTokenizerBase,
    completion_only_loss: bool,
    source: str,
) -> TokenizedExample:
    """Token ids and loss mask of one SFT row.

    completion_only_loss: targets are only the completion (prompt/completion) or the assistant messages
        (conversations); False makes every token but the first a target. Text rows ignore it.
    source: the row's location, kept on the example and used in errors.
    Raises DataError for a conversation with no assistant message to learn, ValueError when the tokenizer
    cannot render it (no chat template, or one that does not render conversations incrementally).
    """
    eos = tokenizer.eos_token_id
    match row:
        case TextRow(text=text):
            ids = list(tokenizer(text)["input_ids"])
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            return _example(ids, [1] * len(ids), source)
        case PromptCompletionRow(prompt=str() as prompt, completion=str() as completion):
            prompt_ids = list(tokenizer(prompt)["input_ids"])
            completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
            if eos is not None:
                completion_ids.append(eos)
            mask = [int(not completion_only_loss)] * len(prompt_ids) + [1] * len(completion_ids)
            return _example(prompt_ids + completion_ids, mask, source)
        case PromptCompletionRow(prompt=list() as prompt, completion=list() as completion):
            return _chat_example(
                prompt + completion, tokenizer, completion_only_loss, len(prompt), "completion", source
            )
        case MessagesRow(messages=messages):
            return _chat_example(messages, tokenizer, completion_only_loss, 0, "messages", source)
    raise ValueError(
        f"{source}: a {type(row).__name__} has no SFT target; SFT takes text, prompt/completion or messages rows"
    )


def truncate_or_drop(
    example: TokenizedExample, max_length: int, overlong: Literal["truncate", "drop"]
) -> TokenizedExample | None:
    """The example if it fits in max_length tokens; else its first max_length tokens (truncate) or None (drop)."""
    if len(example) <= max_length:
        return example
    if overlong == "truncate":
        return replace(example, input_ids=example.input_ids[:max_length], loss_mask=example.loss_mask[:max_length])
    if overlong == "drop":
        return None
    raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")


def _example(ids: list[int], mask: list[int], source: str) -> TokenizedExample:
    # Nothing precedes position 0, so it can never be a target.
    return TokenizedExample(input_ids=tuple(ids), loss_mask=tuple([0] + mask[1:]) if mask else (), source=source)


def _chat_example(
    messages: Messages,
    tokenizer: PreTrainedTokenizerBase,
    completion_only_loss: bool,
    first_target_message: int,
    field: str,
    source: str,
) -> TokenizedExample:
    """Render a conversation; with completion_only_loss, the assistant messages from first_target_message on
    are the targets."""
    if tokenizer.chat_template is None:
        raise ValueError(
            f"tokenizer {_tokenizer_name(tokenizer)} has no chat template, so conversational data cannot be "
            "rendered; give prompt/completion strings instead, or set tokenizer.chat_template"
        )
    text = _render(tokenizer, messages)
    # The rendered text already holds the template's special tokens (BOS, turn markers).
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    if not completion_only_loss:
        return _example(ids, [1] * len(ids), source)
    spans = [
        _assistant_span(tokenizer, messages, index, text)
        for index in range(first_target_message, len(messages))
        if messages[index]["role"] == "assistant"
    ]
    if not spans:
        raise DataError(source, "has no assistant message to train on", field)
    mask = [
        int(any(start < span_end and end > span_start for span_start, span_end in spans))
        for start, end in encoding["offset_mapping"]
    ]
    return _example(ids, mask, source)


def _assistant_span(tokenizer: PreTrainedTokenizerBase, messages: Messages, index: int, text: str) -> tuple[int, int]:
    """Character span of assistant message `index` (content and end-of-turn token) in the rendered text."""
    before = _render(tokenizer, messages[:index], add_generation_prompt=True)
    through = _render(tokenizer, messages[: index + 1])
    if not (through.startswith(before) and text.startswith(through)):
        raise ValueError(
            f"the chat template of tokenizer {_tokenizer_name(tokenizer)} does not render conversations "
            f"incrementally (the first {index + 1} messages, rendered alone, are not the beginning of the whole "
            "conversation rendered), so assistant tokens cannot be located for completion_only_loss; "
            "set data.completion_only_loss=false, or give the data as prompt/completion strings"
        )
    return len(before), max(len(before), len(through.rstrip()))


def _render(tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool = False,
            tools: Sequence[dict[str, Any]] | None = None) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=list(tools) if tools else None)


def _tokenizer_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return repr(tokenizer.name_or_path) if tokenizer.name_or_path else type(tokenizer).__name__


def render_generation_prompt(messages: Messages, tokenizer: PreTrainedTokenizerBase,
                             tools: Sequence[dict[str, Any]] | None = None) -> str:
    """A conversation rendered with the chat template and its generation prompt (and `tools`), as the text
    `tokenize_prompt` encodes (without special tokens: the template writes its own)."""
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer {_tokenizer_name(tokenizer)} has no chat template, so conversational prompts "
                         "cannot be rendered; give prompts as strings, or set tokenizer.chat_template")
    return _render(tokenizer, messages, add_generation_prompt=True, tools=tools)


def tokenize_prompt(prompt: str | Messages, tokenizer: PreTrainedTokenizerBase,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids a model is asked to continue, encoded as the SFT path encodes prompts.

    A string gets the tokenizer's special tokens (BOS), like an SFT prompt; a conversation is rendered
    with the chat template and its generation prompt (the assistant turn's opening), with `tools` (JSON schemas)
    passed to the template as `tools=`.
    """
    if isinstance(prompt, str):
        if tools:
            raise ValueError("tools are rendered by the chat template, so a prompt offered tools must be a "
                             "conversation (prompt.use_chat_template=true turns string prompts into one)")
        return list(tokenizer(prompt)["input_ids"])
    text = render_generation_prompt(prompt, tokenizer, tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_next_turn(history: Messages, observation: Message | Messages, tokenizer: PreTrainedTokenizerBase,
                       tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Tokens that follow a finished assistant turn to open the next one: the chat template's rendering of
    `observation` (a user or tool message, or several appended together, such as one turn's tool results) and the
    generation prompt, as the difference between the rendering of history + observation (with generation prompt)
    and of history (less the whitespace the template writes after the last turn's end, which the model did not
    sample), both with `tools`. The episode's earlier tokens are never re-tokenized: these are appended.
    Raises ValueError naming the template when the longer rendering does not begin with the shorter one (a template
    that rewrites history)."""
    observations = [observation] if isinstance(observation, Mapping) else list(observation)
    # The model's turn ended with its end-of-turn token; whitespace the template writes after that token (ChatML's
    # newline) was never sampled, so it opens the appended tokens, and the episode reads as the template renders it.
    before = _render(tokenizer, history, tools=tools).rstrip()
    after = _render(tokenizer, [*history, *observations], add_generation_prompt=True, tools=tools)
    if not after.startswith(before):
        raise ValueError(f"the chat template of tokenizer {_tokenizer_name(tokenizer)} does not render "
                         "conversations incrementally (it rewrites earlier messages when one is added: "
                         f"{_first_difference(before, after)}), so a multi-turn episode cannot be extended token "
                         "by token")
    return list(tokenizer(after[len(before):], add_special_tokens=False)["input_ids"])


PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "A tool to probe the template.",
                                               "parameters": {"type": "object", "properties": {
                                                   "x": {"type": "string", "description": "Anything."}}}}}


def check_prefix_preserving(tokenizer: PreTrainedTokenizerBase, tools: Sequence[dict[str, Any]] | None,
                            user_follow_up: bool = False) -> None:
    """Refuse (ValueError naming the template and the first rewritten text) a chat template that rewrites history:
    rendered after each message of a probe episode (a question, a reply that thinks and calls a tool, the tool's
    result, a reply; with `user_follow_up` then a second question and reply), every rendering must begin with the
    previous one, so that an episode's tokens can be built by appending. Qwen3's template strips the thinking of
    replies before the latest user question: it passes episodes whose observations are tool results and fails
    those with a follow-up question."""
    if tokenizer.chat_template is None:
        raise ValueError(f"tokenizer {_tokenizer_name(tokenizer)} has no chat template, so tools cannot be rendered")
    probe = [{"role": "user", "content": "What is 2 + 3?"},
             {"role": "assistant", "content": '<think>\nI should use the tool.\n</think>\n\n'
                                              '<tool_call>\n{"name": "probe_tool", "arguments": {"x": "2 + 3"}}\n'
                                              '</tool_call>'},
             {"role": "tool", "name": "probe_tool", "content": "5", "tool_call_id": "c00010000"},
             {"role": "assistant", "content": "<think>\nThe tool said 5.\n</think>\n\nThe answer is 5."}]
    if user_follow_up:
        probe += [{"role": "user", "content": "And 5 + 5?"},
                  {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n10"}]
    tools = list(tools) if tools else [PROBE_TOOL]
    previous = ""
    for end in range(1, len(probe) + 1):
        try:
            text = _render(tokenizer, probe[:end], add_generation_prompt=probe[end - 1]["role"] != "assistant",
                           tools=tools)
        except TemplateError as error:  # the template's raise_exception: a role or a shape it does not take
            raise ValueError(f"the chat template of tokenizer {_tokenizer_name(tokenizer)} cannot render a tool-using "
                             f"conversation (message {end}, {probe[end - 1]['role']}): {error}") from error
        if not text.startswith(previous):
            raise ValueError(
                f"the chat template of tokenizer {_tokenizer_name(tokenizer)} is not prefix-preserving: adding "
                f"message {end} ({probe[end - 1]['role']}) to a conversation rewrites what came before "
                f"({_first_difference(previous, text)}), as templates that strip earlier thinking do (Qwen3's, "
                "before a new user question). Episode tokens are built by appending, never by re-rendering, so "
                "the model would be trained on contexts it never sees at inference; give the tokenizer a "
                "prefix-preserving chat template (one that keeps every reply as written)")
        previous = text


def _first_difference(before: str, after: str) -> str:
    index = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    return f"at character {index}, {before[index:index + 40]!r} became {after[index:index + 40]!r}"
