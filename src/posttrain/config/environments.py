"""The `environment` section: what scores the completions, one typed section per environment kind.

    environment:
      kind: math                  # picks the section (a union discriminated on kind; arithmetic when left out)
      options: {timeout_s: 5, num_workers: 2}
      max_error_fraction: 0.5     # keys every kind has

Each kind's options are a model of their own (`MathOptions`, `JudgeOptions`, ...) with a docstring per option, so a
misspelt or ill-typed option is refused when the config loads, naming `environment.options.NAME` and the
environment. Options are checked strictly: a string or a boolean is no number, since they come typed from YAML.
`posttrain.envs.registry.build_environment` takes the typed options; the models an environment scores with (a judge
model, a reward model) are built by the recipe (`posttrain.algorithms.environments`) and handed in, never loaded by
the environment itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from posttrain.config.sections import Section

DEFAULT_WORKER_MEMORY_MB = 4096
"""Address-space limit (MiB) of each reward worker process unless environment.worker_memory_mb says otherwise."""

DEFAULT_JUDGE_TEMPLATE = (
    "Rate the response to the prompt below from {min_score} (worst) to {max_score} (best).\n\n"
    "Prompt:\n{prompt}\n\nResponse:\n{response}\n\n"
    'End your answer with one line of the form "Score: N".'
)
DEFAULT_SCORE_PATTERN = r"(?i)\bscore\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?|[^\s*]+)"
"""'score' then ':' or '=' (markdown bold allowed), capturing a number, or else the word there (to report it)."""

REWARD_ONLY = frozenset({"python", "reward_model", "judge", "gdpval"})
"""The environments that give a reward and never say whether a reply is correct; the verifiers (arithmetic, math,
code) put `correct` in each episode's metadata, for accuracy and pass@k, and so does a mixture with a verifier."""

RESERVED_COMPONENT_NAMES = frozenset({"mean", "std", "errors", "errors_total"})
"""Names the loop already logs under reward/, which a mixture component would overwrite."""


class EnvironmentOptions(Section):
    """The options of one environment kind. Strict: a value must have its option's type as YAML gives it (an
    integer is a float; a string or a boolean is no number)."""

    model_config = ConfigDict(strict=True, frozen=True)

    kind: ClassVar[str]
    """The environment kind these options belong to (the section's `kind`)."""

    @model_validator(mode="before")
    @classmethod
    def _one_memory_limit(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and "worker_memory_mb" in value:
            raise ValueError("options.worker_memory_mb: set environment.worker_memory_mb instead, the one place for "
                             "the reward workers' memory limit")
        return value

    @property
    def loads_model(self) -> bool:
        """Whether the environment scores with a model the recipe must build and hand in."""
        return False


class ArithmeticOptions(EnvironmentOptions):
    """arithmetic: exact match of the sum against the row's `answer`. No options."""

    kind: ClassVar[str] = "arithmetic"


class MathOptions(EnvironmentOptions):
    """math: math-verify on the final or boxed answer against the row's `answer`."""

    kind: ClassVar[str] = "math"

    timeout_s: float = 5.0
    """Time limit per sample, in seconds."""

    num_workers: int = 2
    """Scorer processes (0: score in the calling thread, which must be the main thread)."""

    format_weight: float = 0.0
    """Weight of the boxed-answer format component."""

    reward_components: bool = False
    """Return {correct, format} rewards (logged and weighted per component) instead of their weighted sum."""


class PythonOptions(EnvironmentOptions):
    """python: your reward functions, by import path."""

    kind: ClassVar[str] = "python"

    functions: str | list[str | list[Any] | dict[str, Any]]
    """One import path ("my_pkg.rewards:fn" or "path/to/file.py:fn"), or a list of paths, [name, path, weight]
    triples or {name, path, weight} mappings (several give named reward components)."""

    timeout_s: float = 10.0
    """Time limit per sample, in seconds."""

    num_workers: int = 2
    """Worker processes (0: call in the training process without a time limit, for trusted, fast functions)."""

    samples_per_call: int = 1
    """Completions per call of a function."""

    reward_components: bool | None = None
    """Dict rewards keyed by function name (null: true for several functions, false for one)."""


class CodeOptions(EnvironmentOptions):
    """code: the program in the reply run against the row's `tests` (or `assert_code`) in a sandbox."""

    kind: ClassVar[str] = "code"

    time_limit_s: float = 5.0
    """Wall-clock limit of each test run."""

    memory_limit_mb: int = 512
    """Address-space limit of each test run."""

    output_limit_bytes: int = 1_000_000
    """stdout and stderr are each cut here, and a program writing more is stopped and fails."""

    num_workers: int = 2
    """Test runs executed at once (threads, each waiting on one sandboxed subprocess)."""

    all_or_nothing: bool = False
    """Reward 1.0 only when every test passes, else 0.0; otherwise the fraction passed."""

    allow_unisolated_fallback: bool = False
    """Run programs even where the sandbox has no namespace isolation: only for trusted programs, or on a throw-away
    machine (see docs/rl.md)."""


class RewardModelOptions(EnvironmentOptions):
    """reward_model: a trained reward model's score of (prompt, reply)."""

    kind: ClassVar[str] = "reward_model"

    path: str
    """The reward model directory (e.g. a `posttrain rm` run's final/) or hub id."""

    conversational: bool = False
    """Score the message log with the reward model's chat template (prompt = every message but the reply) instead
    of the last user message and the reply as plain strings."""

    batch_size: int = 32
    """Sequences scored together."""

    max_length: int | None = None
    """Longest (prompt, reply) in tokens the reward model reads (null: its own limit)."""

    device: str | None = None
    """Device of the reward model (null: CUDA when available, else CPU)."""

    @property
    def loads_model(self) -> bool:
        return True


class JudgeOptions(EnvironmentOptions):
    """judge: another language model's score of the reply, from a local model (path) or an OpenAI-compatible server
    (base_url with model); see posttrain.envs.judge."""

    kind: ClassVar[str] = "judge"

    path: str | None = None
    """A local Hugging Face chat model (directory, hub id or embedded name), loaded once and run greedily."""

    base_url: str | None = None
    """An OpenAI-compatible server (vLLM, SGLang, TGI, a hosted API): POST {base_url}/v1/chat/completions."""

    model: str | None = None
    """With base_url: the name the server serves the judge under."""

    api_key_env: str | None = None
    """With base_url: the environment variable holding the API key (so the key never appears in config.yaml)."""

    template: str = DEFAULT_JUDGE_TEMPLATE
    """What the judge reads: {prompt}, {response}, {min_score}, {max_score} and every column of the row by name."""

    system_prompt: str | None = None
    """A system message before the template's user message."""

    score_pattern: str = DEFAULT_SCORE_PATTERN
    """Regular expression with one capture group, the score (default: "Score: N")."""

    min_score: float = 1.0
    """Lowest score the judge may give."""

    max_score: float = 10.0
    """Highest score the judge may give."""

    normalize: bool = True
    """Reward (score − min_score) / (max_score − min_score), in [0, 1], instead of the score itself."""

    max_new_tokens: int = 64
    """Tokens per verdict."""

    timeout_s: float = Field(60.0, gt=0)
    """With base_url: the deadline of each request, whole: connecting, sending and reading the answer."""

    max_response_bytes: int = Field(4_000_000, ge=1)
    """With base_url: the largest answer read; a larger one (announced or read) fails that sample, unread."""

    max_retries: int = 3
    """With base_url: retries of a connection error, a timeout, HTTP 429 or 5xx."""

    retry_backoff_s: float = 1.0
    """With base_url: seconds before the first retry, doubled before each next one."""

    concurrency: int = 8
    """With base_url: requests at a time."""

    batch_size: int = 16
    """With path: conversations generated together."""

    use_chat_template: bool = True
    """With path: render the judge's messages with its chat template when it has one (else as plain text)."""

    device: str | None = None
    """With path: device of the judge model (null: CUDA when available, else CPU)."""

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeOptions:
        if (self.path is None) == (self.base_url is None):
            raise ValueError("give the judge as either path (a local model) or base_url (an OpenAI-compatible "
                             f"server), exactly one of them; got path={self.path!r}, base_url={self.base_url!r}")
        if self.base_url is not None and self.model is None:
            raise ValueError("base_url needs model, the name the server serves the judge under")
        if self.path is not None and (self.model is not None or self.api_key_env is not None):
            raise ValueError("model and api_key_env belong to a judge server (base_url), not a local path")
        return self

    @property
    def loads_model(self) -> bool:
        return self.path is not None


TOOL_TASK_OPTIONS: dict[str, type[EnvironmentOptions]] = {
    "arithmetic": ArithmeticOptions, "math": MathOptions, "python": PythonOptions, "code": CodeOptions,
    "reward_model": RewardModelOptions, "judge": JudgeOptions}
"""The environments a tools environment's task may be: those that score a final answer in one turn."""


class ToolTask(Section):
    """What scores a tool-using episode's final answer: {kind, options}, as the environment section of that kind."""

    kind: Literal["arithmetic", "math", "python", "code", "reward_model", "judge"] = "arithmetic"
    """The task environment's kind."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Its options (those of environment.options for that kind)."""

    @model_validator(mode="after")
    def _options_of_kind(self) -> ToolTask:
        self.typed_options  # validated when the config loads, naming the option
        return self

    @property
    def typed_options(self) -> EnvironmentOptions:
        """The options, validated as the kind's options class."""
        try:
            return TOOL_TASK_OPTIONS[self.kind].model_validate(self.options)
        except ValidationError as error:
            problems = "; ".join(f"options.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise ValueError(f"the {self.kind} task: {problems}") from None


class ToolsOptions(EnvironmentOptions):
    """tools: the model calls tools between turns (rollout.max_turns bounds the turns); a task environment scores
    its final answer, the reply that calls no tool (see docs/agents.md)."""

    kind: ClassVar[str] = "tools"

    task: ToolTask = Field(default_factory=ToolTask)
    """What scores the final answer: {kind, options} (default: arithmetic)."""

    tools: list[str | dict[str, Any]]
    """The tools: built-ins by name (calculator, python, files, search), Python functions by import path
    ("pkg.module:function" or "file.py:function"; signature and docstring become the schema), or mappings
    {name: BUILTIN} / {function: PATH, schema: {name, description, parameters}} with an optional timeout_s."""

    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    """How the model writes tool calls; auto: from the chat template (and model type) of the model."""

    timeout_s: float = Field(10.0, gt=0)
    """How long a tool call may run unless its entry says otherwise (the python tool's programs too)."""

    max_output_chars: int = Field(2000, ge=1)
    """A tool's answer is cut to this many characters (saying how many were cut)."""

    max_calls_per_turn: int = Field(4, ge=1)
    """Calls past this in one reply are answered with an error instead of run."""

    max_episode_tokens: int | None = Field(None, ge=1)
    """Budget of tokens after the prompt per episode (sampled and tool-result tokens); null: none besides
    rollout.max_turns x rollout.max_new_tokens."""

    python_memory_limit_mb: int = Field(512, ge=1)
    """Address-space limit of a python tool program."""

    search_corpus: str | None = None
    """The search tool's documents, a JSON-lines file of {"title", "text"} (null: the small bundled corpus)."""

    allow_unisolated_fallback: bool = False
    """Let the python tool run programs where the sandbox has no namespace isolation (trusted programs only)."""

    @field_validator("tools")
    @classmethod
    def _some_tools(cls, tools: list[Any]) -> list[Any]:
        if not tools:
            raise ValueError("give at least one tool (calculator, python, files, search, or an import path)")
        for index, entry in enumerate(tools):
            if isinstance(entry, dict):
                unknown = set(entry) - {"name", "function", "schema", "timeout_s"}
                if unknown or ("name" in entry) == ("function" in entry):
                    raise ValueError(f"tools[{index}]: a mapping is {{name: BUILTIN}} or {{function: PATH, schema?}}, "
                                     f"with an optional timeout_s; got keys {sorted(entry)}")
                timeout = entry.get("timeout_s", 1.0)
                if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
                    raise ValueError(f"tools[{index}].timeout_s: expected a positive number of seconds, "
                                     f"got {timeout!r}")
        return tools

    @property
    def loads_model(self) -> bool:
        return self.task.typed_options.loads_model


class SweOptions(EnvironmentOptions):
    """swe: repository tasks in the SWE-bench row schema; the agent edits a sandboxed checkout with bash, view and
    str_replace tools and is rewarded 1 when the task's tests pass (each data row names its task by an instance_id
    column; see docs/agents.md)."""

    kind: ClassVar[str] = "swe"

    tasks: str | None = None
    """The tasks, a JSON-lines file of SWE-bench rows (null: the bundled tasks)."""

    repos_dir: str | None = None
    """The folder holding the tasks' git repositories as owner__name (null: repos/ beside the tasks file)."""

    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    """How the model writes tool calls; auto: from the chat template (and model type) of the model."""

    command_timeout_s: float = Field(30.0, gt=0)
    """How long one bash command (or view, str_replace) may run."""

    test_timeout_s: float = Field(120.0, gt=0)
    """How long the test run that scores an episode may take."""

    max_output_chars: int = Field(4000, ge=1)
    """A tool's answer is cut to this many characters (saying how many were cut)."""

    max_calls_per_turn: int = Field(4, ge=1)
    """Calls past this in one reply are answered with an error instead of run."""

    max_episode_tokens: int | None = Field(None, ge=1)
    """Budget of tokens after the prompt per episode; null: none besides rollout.max_turns x max_new_tokens."""


class CuaOptions(EnvironmentOptions):
    """cua: computer-use tasks in OSWorld's task format on an Xvfb desktop; each reply is one computer_13 action
    (JSON), each observation the accessibility tree as text, the reward the task's evaluator (each data row names
    its task by a task_id column; see docs/agents.md)."""

    kind: ClassVar[str] = "cua"

    tasks: str | None = None
    """The tasks: a .jsonl file, a .json file or a folder of .json files in OSWorld's format (null: the bundled
    contact-form tasks)."""

    episodes_dir: str | None = None
    """Where each episode's folder (screenshots step_NNN.png, the app's files and logs) is kept; null: a temporary
    folder removed when the run ends."""

    max_steps: int = Field(10, ge=1)
    """Actions per episode: the episode ends after this many (and is scored); rollout.max_turns must be at least
    this."""

    screen_width: int = Field(640, ge=200, le=4096)
    """Width of the desktop in pixels."""

    screen_height: int = Field(480, ge=200, le=4096)
    """Height of the desktop in pixels."""

    start_timeout_s: float = Field(10.0, gt=0)
    """How long the desktop and the task's app may take to come up (and the app to answer for its tree)."""

    action_timeout_s: float = Field(10.0, gt=0)
    """How long one action (an xdotool call) may take."""

    save_screenshots: bool = True
    """Save a PNG screenshot after every action in the episode's folder."""

    keep_episodes: int | None = Field(64, ge=0)
    """Finished episodes whose folders stay (the newest; older ones are removed as episodes end, screenshots
    included), so that a long run's disk use stays bounded; null: every one (the folders named in earlier
    episodes' cua_workdir and cua_screenshots metadata may be gone)."""


JUDGE_VERDICT_OPTIONS = ("template", "system_prompt", "score_pattern", "min_score", "max_score", "normalize")
"""Judge options that say how a verdict reads: the hle and gdpval environments write their own judge prompts."""


class _JudgedTaskOptions(EnvironmentOptions):
    """Options the HLE- and GDPval-format task environments share."""

    tasks: str | None = None
    """The task file, .jsonl or .parquet in the set's row schema (null: the bundled synthetic sample)."""

    judge: JudgeOptions
    """The judge: {path: a local model} or {base_url, model, api_key_env, timeout_s, ...}, as the judge
    environment's options; its prompt and verdict format are the task environment's own."""

    @field_validator("judge")
    @classmethod
    def _own_prompt(cls, judge: JudgeOptions) -> JudgeOptions:
        given = [name for name in JUDGE_VERDICT_OPTIONS if name in judge.model_fields_set]
        if given:
            raise ValueError(f"judge.{given[0]}: the {cls.kind} environment writes its own judge prompt and reads "
                             "its own verdict format (see docs/agents.md); leave it out")
        return judge

    @property
    def loads_model(self) -> bool:
        return self.judge.loads_model


class HleOptions(_JudgedTaskOptions):
    """hle: questions in Humanity's Last Exam's row schema (id, question, answer, answer_type), the final answer
    judged against the reference by an LLM judge; each data row names its question by an id column (see
    docs/agents.md)."""

    kind: ClassVar[str] = "hle"


class GdpvalOptions(_JudgedTaskOptions):
    """gdpval: tasks in GDPval's row schema (task_id, prompt, reference_files, rubric_json), each rubric item scored
    by an LLM judge and summed; each data row names its task by a task_id column (see docs/agents.md)."""

    kind: ClassVar[str] = "gdpval"


class _ComponentSettings(Section):
    """Keys every mixture component has besides its kind and options."""

    name: str
    """The component's name: its reward is logged as reward/<name> and weighted by advantage.component_weights."""

    weight: float = 1.0
    """Weight of the component in the reward's weighted sum."""

    @field_validator("name")
    @classmethod
    def _a_metric_name(cls, name: str) -> str:
        if not name or "/" in name:
            raise ValueError(f"a non-empty name without '/' is required (it is logged as reward/<name>), got {name!r}")
        if name in RESERVED_COMPONENT_NAMES:
            raise ValueError(f"{name!r} is taken by the loop's own reward/{name}; choose another")
        return name

    @field_validator("weight", mode="before")
    @classmethod
    def _finite_number(cls, weight: Any) -> Any:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"expected a finite number, got {weight!r}")
        return weight


class _EnvironmentSettings(Section):
    """Keys the environment section has whatever its kind."""

    normalize_rewards: bool = False
    """Scale each training reward to (r - mean) / std, with the mean and standard deviation running over every
    valid reward of the run's training batches so far, this step's included (checkpointed, so a resumed run
    continues them; with dynamic sampling, the groups kept). For rewards without a fixed scale, such as a reward
    model's scores, under PPO, whose critic regresses on them. Under GRPO: the grpo estimator with normalize_std
    and reinforce++ give the same advantages; Dr. GRPO (normalize_std false), rloo and raw scale theirs by 1/std
    (so the KL penalty weighs more or less against them); gdpo, which normalizes each reward component itself, is
    refused. Logged rewards, validation and evaluation sets stay raw."""

    max_error_fraction: float = Field(0.5, ge=0, le=1)
    """Samples whose reward failed (raised, timed out, NaN) are masked and counted in reward/errors; the run
    stops with a clear message only when a step's failed fraction exceeds this."""

    worker_memory_mb: int = Field(DEFAULT_WORKER_MEMORY_MB, ge=0)
    """Address-space limit (RLIMIT_AS) in MiB of each reward worker process (python and math environments),
    inherited by whatever a reward function starts; a call that needs more fails with MemoryError and its sample
    is masked and counted. 0: no limit (needed by reward functions that use CUDA, which reserves far more address
    space than it uses)."""

    @property
    def reward_only(self) -> bool:
        """Whether the environment gives rewards only, never saying whether a reply is correct."""
        return self.kind in REWARD_ONLY


class ArithmeticEnvironment(_EnvironmentSettings):
    """What scores the completions: the arithmetic verifier."""

    kind: Literal["arithmetic"] = "arithmetic"
    """arithmetic (exact match of the sum), math (math-verify on the final or boxed answer against the row's
    `answer`), code (the program run against the row's `tests` in a sandbox), python (your reward functions),
    reward_model (a trained reward model's score; options {path: runs/rm/final}), judge (an LLM's score; options
    {path: a local model} or {base_url: http://host:8000, model: NAME}), mixture (several of these, each a named,
    weighted reward component; options {components: [{name, kind, weight, options}, ...]}), tools (tool calls run
    between turns, the final answer scored by a task environment; options {tools: [calculator], task: {kind:
    arithmetic}}, see docs/agents.md), swe (repository tasks: bash, view and str_replace tools in a sandboxed
    checkout, reward 1 when the task's tests pass; options {tasks: TASKS.jsonl}, see docs/agents.md), cua (computer-use
    tasks on an Xvfb desktop, one OSWorld action per reply, scored by the task's evaluator; options {tasks:
    TASKS.jsonl, max_steps: 10}), hle (HLE-format
    questions, the final answer judged against the reference; options {tasks: hle.jsonl, judge: {base_url, model}}),
    gdpval (GDPval-format tasks, rubric items judged and summed; options {tasks: gdpval.jsonl, judge: {...}}); see
    docs/rl.md."""

    options: ArithmeticOptions = Field(default_factory=ArithmeticOptions)
    """None."""


class MathEnvironment(_EnvironmentSettings):
    """What scores the completions: math-verify."""

    kind: Literal["math"]
    """math."""

    options: MathOptions = Field(default_factory=MathOptions)
    """The math verifier's options."""


class PythonEnvironment(_EnvironmentSettings):
    """What scores the completions: your reward functions."""

    kind: Literal["python"]
    """python."""

    options: PythonOptions
    """The reward functions and how they are called."""


class CodeEnvironment(_EnvironmentSettings):
    """What scores the completions: programs run against tests in a sandbox."""

    kind: Literal["code"]
    """code."""

    options: CodeOptions = Field(default_factory=CodeOptions)
    """The sandbox's limits."""


class RewardModelEnvironment(_EnvironmentSettings):
    """What scores the completions: a trained reward model."""

    kind: Literal["reward_model"]
    """reward_model."""

    options: RewardModelOptions
    """The reward model and how it reads."""


class JudgeEnvironment(_EnvironmentSettings):
    """What scores the completions: an LLM judge."""

    kind: Literal["judge"]
    """judge."""

    options: JudgeOptions
    """The judge (path, or base_url with model) and how its verdict is read."""


class ArithmeticComponent(_ComponentSettings):
    kind: Literal["arithmetic"]
    """arithmetic."""
    options: ArithmeticOptions = Field(default_factory=ArithmeticOptions)
    """None."""


class MathComponent(_ComponentSettings):
    kind: Literal["math"]
    """math."""
    options: MathOptions = Field(default_factory=MathOptions)
    """The math verifier's options."""


class PythonComponent(_ComponentSettings):
    kind: Literal["python"]
    """python."""
    options: PythonOptions
    """The reward functions."""


class CodeComponent(_ComponentSettings):
    kind: Literal["code"]
    """code."""
    options: CodeOptions = Field(default_factory=CodeOptions)
    """The sandbox's limits."""


class RewardModelComponent(_ComponentSettings):
    kind: Literal["reward_model"]
    """reward_model."""
    options: RewardModelOptions
    """The reward model."""


class JudgeComponent(_ComponentSettings):
    kind: Literal["judge"]
    """judge."""
    options: JudgeOptions
    """The judge."""


def _kind_of(value: Any, default: str | None = None) -> str | None:
    """The discriminator: `kind` of a mapping (`default` when it has none), of a built section, else None (an
    error naming the kinds)."""
    if isinstance(value, Mapping):
        return value.get("kind", default)
    if isinstance(value, (_EnvironmentSettings, _ComponentSettings)):
        return value.kind
    return None


def _component_kind(value: Any) -> str | None:
    return _kind_of(value)


def _section_kind(value: Any) -> str | None:
    return _kind_of(value, "arithmetic")


MixtureComponent = Annotated[
    Union[
        Annotated[ArithmeticComponent, Tag("arithmetic")],
        Annotated[MathComponent, Tag("math")],
        Annotated[PythonComponent, Tag("python")],
        Annotated[CodeComponent, Tag("code")],
        Annotated[RewardModelComponent, Tag("reward_model")],
        Annotated[JudgeComponent, Tag("judge")],
    ],
    Discriminator(_component_kind, custom_error_type="environment_kind", custom_error_message=(
        "expected one of arithmetic, code, judge, math, python, reward_model (mixtures do not nest)")),
]
"""One component of a mixture: {name, kind, weight, options}, its options those of its kind."""


class MixtureOptions(EnvironmentOptions):
    """mixture: several environments, each a named, weighted reward component."""

    model_config = ConfigDict(strict=False)  # the components are mappings in YAML; their options are strict

    kind: ClassVar[str] = "mixture"

    components: list[MixtureComponent]
    """The components, each {name, kind, weight (default 1), options (default {})}: every one scores each reply."""

    @field_validator("components")
    @classmethod
    def _named_once(cls, components: list[Any]) -> list[Any]:
        if not components:
            raise ValueError("a mixture needs a non-empty list of components, each {name, kind, weight, options}")
        names = [component.name for component in components]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            index = len(names) - 1 - names[::-1].index(repeated[0])
            raise ValueError(f"components[{index}] ({repeated[0]}).name: {repeated[0]!r} is used by two components")
        return components

    @property
    def loads_model(self) -> bool:
        return any(component.options.loads_model for component in self.components)

    @property
    def reward_only(self) -> bool:
        """True when no component is a verifier (which would say which replies are correct)."""
        return all(component.kind in REWARD_ONLY for component in self.components)


class MixtureEnvironment(_EnvironmentSettings):
    """What scores the completions: a weighted mixture of environments."""

    kind: Literal["mixture"]
    """mixture."""

    options: MixtureOptions
    """The components."""

    @property
    def reward_only(self) -> bool:
        return self.options.reward_only


class SweEnvironment(_EnvironmentSettings):
    """What scores the completions: repository tasks, resolved or not by their tests."""

    kind: Literal["swe"]
    """swe."""

    options: SweOptions = Field(default_factory=SweOptions)
    """The tasks, their repositories, limits."""


class CuaEnvironment(_EnvironmentSettings):
    """What scores the completions: computer-use tasks, scored by their evaluator functions."""

    kind: Literal["cua"]
    """cua."""

    options: CuaOptions = Field(default_factory=CuaOptions)
    """The tasks, the desktop, limits."""


class HleEnvironment(_EnvironmentSettings):
    """What scores the completions: HLE-format questions, the final answer judged against the reference."""

    kind: Literal["hle"]
    """hle."""

    options: HleOptions
    """The questions and the judge."""


class GdpvalEnvironment(_EnvironmentSettings):
    """What scores the completions: GDPval-format tasks, each rubric item judged and the points summed."""

    kind: Literal["gdpval"]
    """gdpval."""

    options: GdpvalOptions
    """The tasks and the judge."""


class ToolsEnvironment(_EnvironmentSettings):
    """What scores the completions: a task environment, with tool calls executed between turns."""

    kind: Literal["tools"]
    """tools."""

    options: ToolsOptions
    """The tools, the task that scores the final answer, limits."""

    @property
    def reward_only(self) -> bool:
        return self.options.task.kind in REWARD_ONLY


EnvironmentSection = Annotated[
    Union[
        Annotated[ArithmeticEnvironment, Tag("arithmetic")],
        Annotated[MathEnvironment, Tag("math")],
        Annotated[PythonEnvironment, Tag("python")],
        Annotated[CodeEnvironment, Tag("code")],
        Annotated[RewardModelEnvironment, Tag("reward_model")],
        Annotated[JudgeEnvironment, Tag("judge")],
        Annotated[MixtureEnvironment, Tag("mixture")],
        Annotated[ToolsEnvironment, Tag("tools")],
        Annotated[SweEnvironment, Tag("swe")],
        Annotated[CuaEnvironment, Tag("cua")],
        Annotated[HleEnvironment, Tag("hle")],
        Annotated[GdpvalEnvironment, Tag("gdpval")],
    ],
    Discriminator(_section_kind, custom_error_type="environment_kind", custom_error_message=(
        "environment kind must be one of arithmetic, code, cua, gdpval, hle, judge, math, mixture, python, "
        "reward_model, swe, tools")),
]
"""The environment section: a union discriminated on `kind` (arithmetic when left out)."""

AnyEnvironmentOptions = Union[ArithmeticOptions, MathOptions, PythonOptions, CodeOptions, RewardModelOptions,
                              JudgeOptions, MixtureOptions, ToolsOptions, SweOptions, CuaOptions, HleOptions,
                              GdpvalOptions]

_SECTION_ADAPTER: TypeAdapter = TypeAdapter(EnvironmentSection)


def environment_section(tree: Mapping[str, Any]) -> Any:
    """The environment section of the YAML mapping `tree` ({kind, options, ...}), validated as the config loader
    validates `environment:`; for building an environment from Python (`algorithms.environments`)."""
    return _SECTION_ADAPTER.validate_python(dict(tree))
