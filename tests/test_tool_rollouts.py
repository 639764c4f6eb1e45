"""Tool-using episodes in the rollout: token-in/token-out (ids built by appending what the model sampled and what
the environment appended, the loss on the model's tokens only), episodes advancing independently of a slow tool,
the token budget, and the per-turn metrics."""

import threading

from posttrain.algorithms.rollout import PromptRow, rollout_metrics, run_episodes, to_batch, tool_metrics
from posttrain.data.tokenize import tokenize_prompt
from posttrain.envs.arithmetic_env import ArithmeticEnvironment
from posttrain.envs.tools import Tool, ToolCall, ToolEnvironment, parser_of
from posttrain.envs.tools.builtin import calculator_tool
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams
from posttrain.models.tiny import build_tokenizer
from tool_templates import QWEN25

TOKENIZER = build_tokenizer()
TOKENIZER.chat_template = QWEN25
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
HERMES = parser_of("hermes")
CALCULATOR = calculator_tool(timeout_s=5.0)


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class ScriptedGenerator:
    """Replies from a script: script(prompt text, turn) -> the token ids the model "samples" (turn counts from 1);
    records every call's (prompt text, turn, max_new_tokens) in order."""

    weights_version = 0

    def __init__(self, script):
        self.script = script
        self.calls = []
        self.lock = threading.Lock()

    def generate(self, prompts, params, num_samples=1):
        completions = []
        for prompt in prompts:
            text = TOKENIZER.decode(prompt)
            turn = text.count("<|im_start|>assistant")
            with self.lock:
                self.calls.append((text, turn, params.max_new_tokens))
            samples = []
            for _ in range(num_samples):
                scripted = self.script(text, turn)
                token_ids = scripted[: params.max_new_tokens]
                samples.append(Completion(prompt, token_ids, [-0.5] * len(token_ids),
                                          TOKENIZER.decode(token_ids, skip_special_tokens=True),
                                          "stop" if len(token_ids) == len(scripted) else "length"))
            completions.append(samples)
        return GenerationOutput(completions, num_generated_tokens=sum(len(c[0].token_ids) for c in completions))

    def update_weights(self, version, weights):
        return 0


QUESTION = [{"role": "user", "content": "What is 123456 + 654321?"}]
CALL = HERMES.render([ToolCall("calculator", {"expression": "123456 + 654321"})])
# The first turn holds a pad token inside the call: decoding drops it, so re-tokenizing the rendered history would
# lose it; an episode built by appending keeps the ids the model sampled.
PAD = TOKENIZER.pad_token_id
TURN_1 = ids(CALL[:12]) + [PAD] + ids(CALL[12:]) + [IM_END]
TURN_2 = ids("777777") + [IM_END]
# The newline ChatML writes after <|im_end|> was never sampled: it opens the appended tokens.
OBSERVATION = ids("\n<|im_start|>user\n<tool_response>\n777777\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def calculator_episode(max_episode_tokens=None, max_turns=3):
    environment = ToolEnvironment(ArithmeticEnvironment(), [CALCULATOR], max_episode_tokens=max_episode_tokens)
    prompt_ids = tokenize_prompt(QUESTION, TOKENIZER, environment.tool_use.tools)
    generator = ScriptedGenerator(lambda text, turn: TURN_1 if turn == 1 else TURN_2)
    episodes, _ = run_episodes([PromptRow(QUESTION, prompt_ids, {"answer": "777777"})], 0, 1, generator,
                               environment, TOKENIZER, SamplingParams(max_new_tokens=200), max_turns)
    environment.close()
    return episodes[0], prompt_ids, generator


def test_episode_ids_are_what_the_model_sampled_and_the_environment_appended():
    episode, prompt_ids, _ = calculator_episode()
    assert episode.token_ids == prompt_ids + TURN_1 + OBSERVATION + TURN_2  # position by position
    assert episode.reward == 1.0 and episode.num_turns == 2 and episode.done
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.metadata["tool_calls"] == 1 and episode.metadata["tool_errors"] == 0
    batch = to_batch([episode], PAD, {}, overlong_filtering=False, penalties=[0.0])
    assert batch.loss_mask[0].tolist() == [0] * len(prompt_ids) + [1] * len(TURN_1) + [0] * len(OBSERVATION) + \
        [1] * len(TURN_2)
    assert batch.input_ids[0].tolist() == episode.token_ids
    assert batch.generator_logprobs[0].tolist() == [0.0] * len(prompt_ids) + [-0.5] * len(TURN_1) + \
        [0.0] * len(OBSERVATION) + [-0.5] * len(TURN_2)
    # Re-rendering the history and tokenizing it again would have given other ids.
    rendered = TOKENIZER.apply_chat_template(episode.messages, tokenize=False, tools=[CALCULATOR.schema])
    assert ids(rendered) != episode.token_ids
    # ... which differ from the episode's only where the model sampled what its text does not show (the pad token)
    assert [t for t in episode.token_ids if t != PAD] == ids(rendered.rstrip())


def test_per_turn_metrics_count_turns_tool_calls_and_tokens_by_role():
    episode, _, _ = calculator_episode()
    metrics = rollout_metrics([episode], {})
    assert metrics["turns/mean"] == 2 and metrics["turns/max"] == 2
    assert metrics["tokens/model_mean"] == len(TURN_1) + len(TURN_2)
    assert metrics["tokens/observation_mean"] == len(OBSERVATION)
    assert metrics["tools/calls_mean"] == 1.0 and metrics["tools/errors_mean"] == 0.0
    assert metrics["tools/calls_per_turn"] == 0.5 and metrics["tools/budget_stop_rate"] == 0.0
    assert metrics["tools/errors/malformed"] == 0.0
    assert tool_metrics([]) == {}


def test_the_token_budget_caps_turns_and_ends_an_episode_whose_observation_does_not_fit():
    budget = len(TURN_1) + len(OBSERVATION) + 3
    episode, prompt_ids, generator = calculator_episode(max_episode_tokens=budget)
    assert [max_new for _, _, max_new in generator.calls] == [budget, 3]  # the second turn samples what is left
    assert episode.token_ids == prompt_ids + TURN_1 + OBSERVATION + TURN_2[:3]
    assert len(episode.token_ids) - len(prompt_ids) == budget and episode.truncated
    episode, prompt_ids, generator = calculator_episode(max_episode_tokens=len(TURN_1) + 5)
    assert len(generator.calls) == 1 and episode.token_ids == prompt_ids + TURN_1
    assert episode.done and episode.truncated and episode.budget_exhausted and episode.reward == 0.0
    assert rollout_metrics([episode], {})["tools/budget_stop_rate"] == 1.0


def test_a_slow_tool_in_one_episode_does_not_hold_back_another():
    """Episode A calls a tool that blocks until episode B has sampled its third turn; B calls a fast tool twice
    meanwhile. Were episodes advanced in lockstep (or tools run serially), B's third turn would wait for A's tool
    and the tool would give up after its 20 s wait: the order of events shows which happened."""
    events, lock = [], threading.Lock()
    b_third_turn = threading.Event()

    def slow(arguments, context):
        released = b_third_turn.wait(20)
        with lock:
            events.append("slow tool returned")
        return "released" if released else "gave up"

    def record(event):
        with lock:
            events.append(event)

    tools = [Tool("slow", "Slow.", {"type": "object", "properties": {}}, slow, timeout_s=30),
             Tool("fast", "Fast.", {"type": "object", "properties": {}}, lambda a, c: "ok")]

    def script(text, turn):
        episode = "A" if "episode A" in text else "B"
        record(f"{episode} turn {turn}")
        if episode == "B" and turn == 3:
            b_third_turn.set()
        if episode == "A":
            return ids(HERMES.render([ToolCall("slow", {})])) + [IM_END] if turn == 1 else ids("1") + [IM_END]
        return ids(HERMES.render([ToolCall("fast", {})])) + [IM_END] if turn < 3 else ids("2") + [IM_END]

    environment = ToolEnvironment(ArithmeticEnvironment(), tools)
    rows = [PromptRow(q, tokenize_prompt(q, TOKENIZER, environment.tool_use.tools), {"answer": answer})
            for q, answer in [([{"role": "user", "content": "episode A"}], "1"),
                              ([{"role": "user", "content": "episode B"}], "2")]]
    episodes, _ = run_episodes(rows, 0, 1, ScriptedGenerator(script), environment, TOKENIZER,
                               SamplingParams(max_new_tokens=64), max_turns=4)
    environment.close()
    assert events.index("B turn 2") < events.index("slow tool returned")
    assert events.index("B turn 3") < events.index("slow tool returned") < events.index("A turn 2")
    assert episodes[0].messages[2]["content"] == "released"
    assert [e.reward for e in episodes] == [1.0, 1.0] and [e.num_turns for e in episodes] == [2, 3]


def test_an_episode_whose_environment_state_is_lost_restarts_from_its_first_turn():
    """An environment that raises EpisodeLost at an episode's second turn (the process holding its state died): the
    episode starts again from its prompt, keeps nothing of the lost attempt, and ends as an undisturbed one does."""
    from posttrain.envs.base import EpisodeLost

    class LosesTheFirstEpisodeOnce(ToolEnvironment):
        lost = False

        def step(self, message_logs, metadata):
            if len(message_logs[0]) == 4 and not self.lost:  # its second reply: the state is gone
                type(self).lost = True
                raise EpisodeLost("the environment worker holding the episode died")
            return super().step(message_logs, metadata)

    undisturbed, prompt_ids, _ = calculator_episode()
    environment = LosesTheFirstEpisodeOnce(ArithmeticEnvironment(), [CALCULATOR])
    generator = ScriptedGenerator(lambda text, turn: TURN_1 if turn == 1 else TURN_2)
    episodes, _ = run_episodes([PromptRow(QUESTION, prompt_ids, {"answer": "777777"})], 0, 1, generator,
                               environment, TOKENIZER, SamplingParams(max_new_tokens=200, seed=3), max_turns=3)
    environment.close()
    (episode,) = episodes
    assert LosesTheFirstEpisodeOnce.lost and episode.restarts == 1
    assert [turn for _, turn, _ in generator.calls] == [1, 2, 1, 2]  # the first turn sampled again
    assert episode.token_ids == undisturbed.token_ids and episode.sampled == undisturbed.sampled
    assert episode.generator_logprobs == undisturbed.generator_logprobs
    assert episode.reward == 1.0 and episode.num_turns == 2 and episode.metadata["tool_calls"] == 1
    assert rollout_metrics(episodes, {})["faults/restarted_episodes"] == 1
    assert "faults/restarted_episodes" not in rollout_metrics([undisturbed], {})


def test_a_later_turn_sampled_by_newer_weights_opens_a_version_span_and_the_age_counts_from_the_oldest():
    """As in an asynchronous multi-turn round: the first turn sampled by version 3, a weight push, the second turn by
    version 4. The episode records both spans and keeps policy_version 3, the oldest that sampled any token."""

    class Versioned(ScriptedGenerator):
        version = 3

        def generate(self, prompts, params, num_samples=1):
            output = super().generate(prompts, params, num_samples)
            output.extra["weights_versions"] = [self.version, self.version]  # what each Ray actor held
            type(self).version += 1  # a push between the turns
            return output

    environment = ToolEnvironment(ArithmeticEnvironment(), [CALCULATOR])
    prompt_ids = tokenize_prompt(QUESTION, TOKENIZER, environment.tool_use.tools)
    generator = Versioned(lambda text, turn: TURN_1 if turn == 1 else TURN_2)
    episodes, _ = run_episodes([PromptRow(QUESTION, prompt_ids, {"answer": "777777"})], 0, 1, generator,
                               environment, TOKENIZER, SamplingParams(max_new_tokens=200), max_turns=3)
    environment.close()
    (episode,) = episodes
    assert episode.reward == 1.0 and episode.num_turns == 2
    assert episode.policy_version == 3
    assert episode.version_spans == [(0, 3), (len(TURN_1) + len(OBSERVATION), 4)]  # the second turn's first token
    # One version throughout: no spans (the synchronous case).
    Versioned.version = 5
    environment = ToolEnvironment(ArithmeticEnvironment(), [CALCULATOR])

    class Fixed(Versioned):
        def generate(self, prompts, params, num_samples=1):
            output = ScriptedGenerator.generate(self, prompts, params, num_samples)
            output.extra["weights_versions"] = [5]
            return output

    episodes, _ = run_episodes([PromptRow(QUESTION, prompt_ids, {"answer": "777777"})], 0, 1,
                               Fixed(lambda text, turn: TURN_1 if turn == 1 else TURN_2), environment, TOKENIZER,
                               SamplingParams(max_new_tokens=200), max_turns=3)
    environment.close()
    assert episodes[0].policy_version == 5 and episodes[0].version_spans == []
