"""Tool calling: the formats models write (parse, render, round trip through local chat templates modelled on
Qwen2.5's, Llama 3.1's and Mistral v3's), the tool environment's error observations and counters, the built-in
tools, and tool declarations from JSON schemas and Python functions."""

import json
import os
import threading
from pathlib import Path

import pytest

from posttrain.config.environments import environment_section
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.data.tokenize import check_prefix_preserving, tokenize_next_turn, tokenize_prompt
from posttrain.envs.arithmetic_env import ArithmeticEnvironment
from posttrain.envs.registry import EnvironmentOptionError
from posttrain.envs.tools import (
    Tool,
    ToolCall,
    ToolEnvironment,
    ToolFailure,
    detect_tool_call_format,
    parser_of,
    tool_from_function,
    tool_from_schema,
)
from posttrain.envs.tools.builtin import calculate, calculator_tool, file_tools, load_corpus, search_tool
from posttrain.envs.tools.schema import ToolContext
from posttrain.models.tiny import build_tokenizer
from tool_templates import LLAMA31, MISTRAL_V3, QWEN25, QWEN3_THINKING_STRIP

CALCULATOR = calculator_tool(timeout_s=5.0)
CALLS = [ToolCall("calculator", {"expression": "123456 + 654321"}, "abcdefgh1"),
         ToolCall("search", {"query": "seconds in a day"}, "abcdefgh2")]


def tokenizer_with(template: str, name: str = "local/test-model"):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    tokenizer.name_or_path = name
    return tokenizer


def structured(calls):
    """An assistant message with structured tool_calls, as chat templates take them."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}


def render(template, messages, **kwargs):
    return tokenizer_with(template).apply_chat_template(messages, tokenize=False, **kwargs)


QUESTION = {"role": "user", "content": "What is 123456 + 654321?"}


# ---- each format: parse, render, round trip through the chat template ---------------------------------------


def test_hermes_round_trip_through_a_qwen25_style_template():
    hermes = parser_of("hermes")
    text = render(QWEN25, [QUESTION, structured(CALLS)], tools=[CALCULATOR.schema])
    assert '"name": "calculator"' in text.split("\n</tools>")[0]  # the tools are in the system turn
    reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = hermes.parse(reply)
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in CALLS]
    assert parsed.content == "" and parsed.malformed == ()
    assert hermes.render(CALLS) == reply  # what the model writes is what the template renders
    with_text = hermes.parse("Let me compute.\n" + hermes.render(CALLS[:1]))
    assert with_text.content == "Let me compute." and with_text.calls[0].arguments == CALLS[0].arguments
    assert not hermes.parse("The answer is 777777.").calls_tools


def test_llama3_json_round_trip_through_a_llama31_style_template():
    llama = parser_of("llama3_json")
    text = render(LLAMA31, [QUESTION, structured(CALLS[:1])], tools=[CALCULATOR.schema])
    first_user = text.split("<|start_header_id|>user<|end_header_id|>\n\n")[1]
    assert '"name": "calculator"' in first_user and "What is 123456" in first_user  # tools in the first user turn
    reply = text.split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    parsed = llama.parse(reply)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "123456 + 654321"})]
    assert llama.render(CALLS[:1]) == reply
    assert len(llama.parse(llama.render(CALLS)).calls) == 2  # several calls joined by ';'
    assert llama.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "1"}}').calls
    assert not llama.parse("The answer is 777777.").calls_tools
    # the tool result is rendered in the ipython role
    result = render(LLAMA31, [QUESTION, structured(CALLS[:1]), {"role": "tool", "content": "777777"}],
                    tools=[CALCULATOR.schema])
    assert result.endswith("<|start_header_id|>ipython<|end_header_id|>\n\n777777<|eot_id|>")


def test_mistral_round_trip_through_a_mistral_v3_style_template():
    mistral = parser_of("mistral")
    text = render(MISTRAL_V3, [QUESTION, structured(CALLS)], tools=[CALCULATOR.schema])
    assert text.index("[AVAILABLE_TOOLS]") < text.index("[INST] What is")
    reply = text.split("[/INST]")[1].removesuffix("<|endoftext|>")
    parsed = mistral.parse(reply)
    assert [(c.name, c.arguments, c.id) for c in parsed.calls] == [(c.name, c.arguments, c.id) for c in CALLS]
    assert mistral.render(CALLS) == reply
    # [TOOL_CALLS] is a control token that decoding drops: the bare list still reads as calls
    assert mistral.parse(reply.removeprefix("[TOOL_CALLS]")).calls == parsed.calls
    assert not mistral.parse("The answer is 777777.").calls_tools


@pytest.mark.parametrize("template, model_type, expected", [
    (QWEN25, None, "hermes"), (LLAMA31, None, "llama3_json"), (MISTRAL_V3, None, "mistral"),
    (None, "qwen2", "hermes"), (None, "llama", "llama3_json"), (None, "mistral", "mistral"), (None, None, "hermes"),
    ("{{ '<|im_start|>' + message['content'] }}", "llama", "hermes")])
def test_format_detected_from_the_chat_template_then_the_model_type(template, model_type, expected):
    assert detect_tool_call_format(template, model_type)[0] == expected


def test_config_override_wins_over_the_detected_format():
    section = {"kind": "tools", "options": {"tools": ["calculator"]}}
    assert build_recipe_environment(section, tokenizer_with(LLAMA31)).format.name == "llama3_json"
    section["options"]["tool_call_format"] = "mistral"
    assert build_recipe_environment(section, tokenizer_with(LLAMA31)).format.name == "mistral"


# ---- malformed JSON, unknown tool, wrong argument types: an error observation and a count -------------------


def tool_step(environment, reply, metadata=None):
    result = environment.step([[QUESTION, {"role": "assistant", "content": reply}]], [metadata or {"answer": "777777"}])
    return result.observations[0], result.metadata[0], result


@pytest.mark.parametrize("format_name", ["hermes", "llama3_json", "mistral"])
def test_bad_calls_get_an_error_observation_and_are_counted(format_name):
    environment = ToolEnvironment(ArithmeticEnvironment(), [CALCULATOR], tool_call_format=format_name)
    writer = parser_of(format_name)
    cases = {
        "malformed": {"hermes": '<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>',
                      "llama3_json": '{"name": "calculator", "parameters": {"expression": }',
                      "mistral": '[TOOL_CALLS] [{"name": "calculator", "arguments": {]'}[format_name],
        "unknown_tool": writer.render([ToolCall("weather", {"city": "Paris"})]),
        "bad_arguments": writer.render([ToolCall("calculator", {"expression": 42})]),
    }
    for kind, reply in cases.items():
        observations, metadata, result = tool_step(environment, reply)
        assert result.done == [False] and result.rewards == [0.0]
        assert len(observations) == 1 and observations[0]["role"] == "tool"
        assert observations[0]["content"].startswith("error: ")
        assert metadata["tool_error_kinds"][kind] == 1 and metadata["tool_errors"] == 1, kind
        assert metadata["tool_calls"] == 1
    assert "weather" in tool_step(environment, cases["unknown_tool"])[0][0]["content"]
    assert "42 is not of type 'string'" in tool_step(environment, cases["bad_arguments"])[0][0]["content"]
    environment.close()


def test_counters_add_up_over_turns_and_the_final_answer_is_scored_by_the_task():
    environment = ToolEnvironment(ArithmeticEnvironment(), [CALCULATOR], max_calls_per_turn=2)
    hermes = parser_of("hermes")
    reply = hermes.render([ToolCall("calculator", {"expression": "123456 + 654321"})] * 3)
    observations, metadata, result = tool_step(environment, reply)
    assert [o["content"] for o in observations] == ["777777", "777777", "error: at most 2 tool calls per turn; "
                                                    "this call was not run"]
    assert (metadata["tool_calls"], metadata["tool_errors"]) == (3, 1)
    observations, metadata, _ = tool_step(environment, "<tool_call>{oops}</tool_call>", metadata)
    assert (metadata["tool_calls"], metadata["tool_errors"], metadata["tool_error_kinds"]["malformed"]) == (4, 2, 1)
    assert "tool_workdir" not in metadata  # only the file tools need a work directory
    _, final, result = tool_step(environment, "777777", metadata)
    assert result.rewards == [1.0] and result.done == [True] and final["correct"] is True
    assert (final["tool_calls"], final["tool_errors"]) == (4, 2)  # carried through the task's scoring
    environment.close()


def test_slow_tool_times_out_and_long_output_is_cut():
    never = threading.Event()
    slow = Tool("slow", "Waits.", {"type": "object", "properties": {}}, lambda a, c: never.wait(30) and "", 0.2)
    loud = Tool("loud", "Talks.", {"type": "object", "properties": {}}, lambda a, c: "x" * 5000)
    environment = ToolEnvironment(ArithmeticEnvironment(), [slow, loud], max_output_chars=100)
    hermes = parser_of("hermes")
    observations, metadata, _ = tool_step(environment, hermes.render([ToolCall("slow", {}), ToolCall("loud", {})]))
    assert observations[0]["content"] == "error: slow did not answer within 0.2 s"
    assert metadata["tool_error_kinds"]["timeout"] == 1
    assert observations[1]["content"] == "x" * 100 + "\n[... 4900 characters cut]"
    never.set()
    environment.close()


# ---- declaring tools ---------------------------------------------------------------------------------------


def multiply(a: int, b: int = 2) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def test_tool_from_a_python_function_and_from_a_json_schema():
    tool = tool_from_function(multiply)
    assert tool.schema == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first factor."},
            "b": {"type": "integer", "description": "The second factor."}}, "required": ["a"]}}}
    assert tool.run({"a": 6, "b": 7}, None) == "42"
    assert tool.argument_error({"a": "six"}) == "argument 'a': 'six' is not of type 'integer'"
    assert tool.argument_error({}) == "'a' is a required property"
    from_schema = tool_from_schema(tool.schema, multiply)
    assert from_schema.schema == tool.schema and from_schema.run({"a": 3}, None) == "6"

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="undocumented.*docstring with an Args: section"):
        tool_from_function(undocumented)


def test_tools_config_is_checked_at_load_and_at_build():
    with pytest.raises(Exception, match="the math task: options.timeout_s"):
        environment_section({"kind": "tools", "options": {"tools": ["calculator"],
                                                          "task": {"kind": "math", "options": {"timeout_s": "x"}}}})
    with pytest.raises(Exception, match=r"tools\[0\].timeout_s: expected a positive number of seconds, got True"):
        environment_section({"kind": "tools", "options": {"tools": [{"name": "python", "timeout_s": True}]}})
    with pytest.raises(Exception, match="give at least one tool"):
        environment_section({"kind": "tools", "options": {"tools": []}})
    with pytest.raises(EnvironmentOptionError, match=r"tools\[1\]: 'calculater' is neither a built-in tool"):
        build_recipe_environment({"kind": "tools", "options": {"tools": ["calculator", "calculater"]}})
    path = f"{__file__}:multiply"
    environment = build_recipe_environment({"kind": "tools", "options": {"tools": [
        "files", {"function": path, "timeout_s": 3}]}})
    assert sorted(environment.tools) == ["list_files", "multiply", "read_file", "write_file"]
    assert environment.tools["multiply"].timeout_s == 3
    environment.close()


# ---- built-in tools ----------------------------------------------------------------------------------------


def test_calculator_computes_arithmetic_and_evaluates_nothing_else():
    assert calculate("(123456789 + 987654321) * 3") == 3333333330
    assert calculate("7 / 2") == 3.5 and calculate("-2 ** 10") == -1024 and calculate("17 % 5") == 2
    for expression, why in [("__import__('os').system('true')", "found Call"), ("x + 1", "found Name"),
                            ("(1).real", "found Attribute"), ("9 ** 9 ** 9", "too large"),
                            ("1 / 0", "division by zero"), ("[1, 2]", "found List"), ("1 +", "not an arithmetic")]:
        with pytest.raises(ToolFailure, match=why):
            calculate(expression)


def test_file_tools_stay_inside_the_episode_work_directory(tmp_path):
    workdir = tmp_path / "episode"
    workdir.mkdir()
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", workdir / "link.txt")
    tools = {tool.name: tool for tool in file_tools(timeout_s=5.0)}
    context = ToolContext(workdir=workdir)
    assert tools["write_file"].run({"path": "notes/a.txt", "content": "hello"}, context) == \
        "wrote 5 bytes to notes/a.txt"
    assert tools["read_file"].run({"path": "notes/a.txt"}, context) == "hello"
    assert tools["list_files"].run({}, context) == "link.txt\nnotes/\nnotes/a.txt"
    for name, arguments in [("read_file", {"path": "../secret.txt"}), ("read_file", {"path": "link.txt"}),
                            ("read_file", {"path": str(tmp_path / "secret.txt")}),
                            ("write_file", {"path": "notes/../../x.txt", "content": "x"}),
                            ("list_files", {"path": ".."})]:
        with pytest.raises(ToolFailure, match="outside the work directory|absolute path"):
            tools[name].run(arguments, context)
    assert not (tmp_path / "x.txt").exists()


def test_each_episode_has_its_own_work_directory():
    environment = ToolEnvironment(ArithmeticEnvironment(), file_tools(5.0))
    hermes = parser_of("hermes")
    write = hermes.render([ToolCall("write_file", {"path": "a.txt", "content": "mine"})])
    result = environment.step([[QUESTION, {"role": "assistant", "content": write}]] * 2, [{"answer": "1"}] * 2)
    first, second = (Path(m["tool_workdir"]) for m in result.metadata)
    assert first != second and (first / "a.txt").read_text() == "mine" and (second / "a.txt").is_file()
    answer = [QUESTION, {"role": "assistant", "content": write}, *result.observations[0],
              {"role": "assistant", "content": "1"}]
    assert environment.step([answer], [result.metadata[0]]).rewards == [1.0]
    assert not first.exists() and second.is_dir()  # removed when its episode ended with an answer
    environment.close()
    assert not second.exists()  # the others when the environment closes


def test_search_ranks_the_bundled_corpus_with_bm25(tmp_path):
    search = search_tool(5.0, None)
    assert search.run({"query": "how many seconds are in a day"}, None).startswith("[Time units]")
    assert search.run({"query": "freezing point of water celsius"}, None).startswith("[Temperature]")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"title": "Cats", "text": "Cats purr."}) + "\n" +
                      json.dumps({"title": "Dogs", "text": "Dogs bark loudly."}) + "\n")
    assert search_tool(5.0, str(corpus)).run({"query": "bark"}, None) == "[Dogs] Dogs bark loudly."
    assert search_tool(5.0, str(corpus)).run({"query": "birds"}, None) == "no document matches the query"
    corpus.write_text('{"title": "ok", "text": "fine"}\n{not json}\n')
    with pytest.raises(ValueError, match="corpus.jsonl, line 2: not JSON"):
        load_corpus(str(corpus))


def test_python_tool_runs_in_the_sandbox():
    from posttrain.envs.sandbox import sandbox_info

    if not sandbox_info().namespaces:
        pytest.skip("the sandbox's namespace isolation does not work on this machine")
    environment = build_recipe_environment({"kind": "tools", "options": {"tools": ["python"], "timeout_s": 2}})
    hermes = parser_of("hermes")
    observations, metadata, _ = tool_step(environment, hermes.render([
        ToolCall("python", {"code": "print(6 * 7)"}),
        ToolCall("python", {"code": "import os\nprint(os.path.exists('/etc/shadow'))"}),
        ToolCall("python", {"code": "while True: pass"})]))
    assert observations[0]["content"] == "42\n"
    assert observations[1]["content"] == "False\n"  # the host's files are not in the sandbox
    assert observations[2]["content"] == "error: python: the program ran past 2 s and was stopped"
    assert metadata["tool_error_kinds"]["timeout"] == 1
    environment.close()


# ---- templates that rewrite history ------------------------------------------------------------------------


def test_a_template_that_rewrites_history_is_refused_by_name():
    thinking_strip = tokenizer_with(QWEN3_THINKING_STRIP, "Qwen/Qwen3-8B")
    check_prefix_preserving(thinking_strip, [CALCULATOR.schema])  # tool results alone keep the thinking
    with pytest.raises(ValueError, match="'Qwen/Qwen3-8B' is not prefix-preserving: adding message 5 \\(user\\)"):
        check_prefix_preserving(thinking_strip, [CALCULATOR.schema], user_follow_up=True)
    for template in (QWEN25, LLAMA31):
        check_prefix_preserving(tokenizer_with(template), [CALCULATOR.schema], user_follow_up=True)
    # Mistral v3 moves [AVAILABLE_TOOLS] to the latest user message: fine for tool results, not for a new question
    check_prefix_preserving(tokenizer_with(MISTRAL_V3), [CALCULATOR.schema])
    with pytest.raises(ValueError, match="not prefix-preserving"):
        check_prefix_preserving(tokenizer_with(MISTRAL_V3), [CALCULATOR.schema], user_follow_up=True)
    # a template without tool messages is refused by name too, not with the template's own exception
    plain = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('Only user and assistant roles are " \
            "supported!') }}{% endif %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="'local/old' cannot render a tool-using conversation \\(message 3, tool\\): "
                                         "Only user and assistant"):
        check_prefix_preserving(tokenizer_with(plain, "local/old"), [CALCULATOR.schema])
    # and when an episode would append such a message, the next turn's tokens are refused, naming the template
    history = [QUESTION, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\n777777"}]
    with pytest.raises(ValueError, match="'Qwen/Qwen3-8B' does not render conversations incrementally"):
        tokenize_next_turn(history, {"role": "user", "content": "Sure?"}, thinking_strip)


def test_tool_results_of_one_turn_are_appended_together():
    """Qwen2.5's template merges consecutive tool results into one user turn: appending them one at a time would
    not be prefix-preserving, appending the turn's results together is."""
    tokenizer = tokenizer_with(QWEN25)
    history = [QUESTION, {"role": "assistant", "content": parser_of("hermes").render(CALLS)}]
    results = [{"role": "tool", "content": "777777"}, {"role": "tool", "content": "86400"}]
    ids = tokenize_next_turn(history, results, tokenizer, [CALCULATOR.schema])
    assert tokenizer.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n777777\n</tool_response>\n<tool_response>\n"
                                     "86400\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tokenize_prompt([QUESTION], tokenizer, [CALCULATOR.schema])[:3] == tokenizer("<|im_start|>system")[
        "input_ids"][:3]
