"""Scoring rewards without letting one bad sample stop or corrupt training.

A reward is computed per sample (or per small batch of samples) by a scoring callable. Whatever
goes wrong — an exception, a call past its deadline, a dead worker, NaN or inf, None, a value of
the wrong type, a list of the wrong length — masks the samples concerned: their reward is None and
their error string says why. An error is never turned into a zero reward, because a zero is a
real score that the advantage estimator would learn from (verl PR #5635).

Two ways to call a scorer:

- `score_in_process`: calls it in the current thread, one sample at a time, with no time limit.
  Only for built-in scorers that cannot hang or crash (arithmetic exact match): it costs a few
  microseconds per sample.
- `RewardWorkerPool`: a persistent pool of `num_workers` worker processes. Each call goes to an
  idle worker with a deadline; a worker past its deadline is killed, together with every process
  it started, and replaced, and the call is masked as timed out. Calls run in parallel across
  workers, and each runs in its worker's main thread, so libraries that time themselves with
  `signal.alarm` (math-verify) work there.

Why fresh interpreters rather than `multiprocessing`: the training process has torch (and
possibly CUDA and their thread pools) loaded, and forking it is unsafe; the 'spawn' and
'forkserver' contexts re-import the launching script's `__main__`, which breaks scripts without
an `if __name__ == "__main__"` guard and re-runs their top-level code. A worker here is
`python -c` started with `subprocess` (fork+exec, safe with threads), importing only this module,
`reward_worker` and the scorer's module, and talking to the pool over two pipes with `multiprocessing.connection`
framing. Scorers are therefore named by import path ("package.module:function" or
"path/to/file.py:function"), not passed as objects. A worker starts in about 50 ms plus the
import time of its scorer; the time limit only counts once a worker has reported itself ready,
so a replacement's start-up never eats into the next call's budget.

What a worker may not do (`reward_worker` has the mechanics, all Linux):

- outlive the training process: a small supervisor process between the pool and each worker
  kills the worker and everything it started as soon as the training process ends — closed
  pool, exception, Ctrl-C, SIGTERM or SIGKILL alike — and the worker dies with its supervisor;
- leave processes behind when it is killed: the supervisor is a child subreaper, so processes a
  scorer starts stay its descendants even after `setsid()`, and every descendant is killed;
- use more than `memory_limit_mb` of address space (RLIMIT_AS, default
  `DEFAULT_WORKER_MEMORY_MB`): an allocation past it raises MemoryError, which masks the call;
- write to the console: stdout and stderr of the worker and its children go to the supervisor,
  which keeps the last `OUTPUT_TAIL_BYTES` of each call and shows them in that call's error.

Counting is the training loop's job: `EnvStep.errors` carries one error (or None) per sample,
and `RewardErrorBudget.record` counts them and raises `RewardError` when too many samples of one
step failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from posttrain.config.environments import DEFAULT_WORKER_MEMORY_MB  # environment.worker_memory_mb's default
from posttrain.envs.base import Reward

MAX_ERROR_MESSAGE_CHARS = 500
"""Longer error strings (long tracebacks or reprs) are cut to this length."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32. Rewards become float32 tensors in training, so a larger |reward| is an error."""
OUTPUT_TAIL_BYTES = 1024
"""How much of a failed call's stdout and stderr (its last bytes) its error shows."""
SUPERVISOR_GRACE_S = 15.0
"""How long past a call's deadline the pool waits for the supervisor's word before killing it itself: longer
than the supervisor's own tree kill may take (reward_worker.KILL_TREE_TIMEOUT_S, 5 s), so the pool never cuts
that cleanup short."""
SUPERVISOR_EXIT_WAIT_S = 5.0
"""How long a supervisor may take to kill its worker's tree and exit once the pool lets it go."""
WORKER_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")
"""Set to 1 in workers unless already set (see `_worker_environment`)."""


class RewardError(RuntimeError):
    """Too many samples of a step failed to be scored: the reward setup itself is broken."""


class RewardFunctionImportError(ImportError):
    """A reward function's import path does not name an importable callable."""


# ---------------------------------------------------------------------------------------------
# Values and outcomes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallOutcome:
    """What one call of a scorer gave: its return value, or why it failed."""

    value: Any
    """The returned value (None when the call failed; a scorer may also return None)."""
    error: str | None
    """Exception, timeout or dead worker, as one line of text; None when the call returned."""


@dataclass(frozen=True)
class ScoredBatch:
    """Validated rewards of N samples."""

    rewards: list[Reward]
    """[N] a finite float or a dict of finite floats; None where scoring failed."""
    errors: list[str | None]
    """[N] why scoring failed, or None."""


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_ERROR_MESSAGE_CHARS else text[: MAX_ERROR_MESSAGE_CHARS - 3] + "..."


def describe_exception(error: BaseException) -> str:
    """`ExceptionType: message`, shortened: the error string of a masked sample."""
    message = str(error)
    return _shorten(f"{type(error).__name__}: {message}" if message else type(error).__name__)


def _validate_number(value: Any) -> tuple[float | None, str | None]:
    # numbers.Real covers int, float, bool and numpy scalars; tensors and arrays must be converted by the scorer.
    if not isinstance(value, numbers.Real):
        return None, f"returned {type(value).__name__} {_shorten(repr(value))}, expected a float"
    number = float(value)
    if not math.isfinite(number):
        return None, f"returned {number}, expected a finite float"
    if abs(number) > FLOAT32_MAX:
        return None, f"returned {number:g}, outside float32's range (|reward| <= {FLOAT32_MAX:.4g}) used in training"
    return number, None


def validate_reward(value: Any) -> tuple[Reward, str | None]:
    """Check one sample's reward: a finite real number, or a non-empty dict of them keyed by name.

    Returns `(reward, None)` when valid, `(None, error)` otherwise; None, NaN, inf and numbers
    float32 cannot hold (|x| > 3.4e38, which training would turn into inf) are errors.
    """
    if value is None:
        return None, "returned None"
    if isinstance(value, Mapping):
        if not value:
            return None, "returned an empty dict of reward components"
        components: dict[str, float] = {}
        for name, component in value.items():
            if not isinstance(name, str):
                return None, f"returned a reward component named {name!r}; component names must be strings"
            number, error = _validate_number(component)
            if error is not None:
                return None, f"component {name!r} {error}"
            components[name] = number
        return components, None
    return _validate_number(value)


def validate_outcomes(outcomes: Sequence[CallOutcome], scorer_name: str) -> ScoredBatch:
    """One outcome per sample → validated rewards; every error is prefixed with `scorer_name`."""
    rewards: list[Reward] = []
    errors: list[str | None] = []
    for outcome in outcomes:
        reward, error = (None, outcome.error) if outcome.error is not None else validate_reward(outcome.value)
        rewards.append(reward)
        errors.append(None if error is None else f"{scorer_name}: {error}")
    return ScoredBatch(rewards, errors)


def split_batched_outcome(outcome: CallOutcome, num_samples: int) -> list[CallOutcome]:
    """Spread one call of a batched scorer over its `num_samples` samples.

    The call must have returned a list (or tuple) of exactly `num_samples` values. Anything else —
    including a single value or a list of the wrong length — fails every sample of the call: a
    silent broadcast would give every sample the same reward (TRL #6533).
    """
    if outcome.error is not None:
        return [outcome] * num_samples
    values = outcome.value
    if not isinstance(values, (list, tuple)):
        error = f"returned {type(values).__name__}, expected a list of {num_samples} values (one per completion)"
        return [CallOutcome(None, error)] * num_samples
    if len(values) != num_samples:
        error = (
            f"returned {len(values)} values for {num_samples} completions; a batched reward function must "
            "return exactly one value per completion"
        )
        return [CallOutcome(None, error)] * num_samples
    return [CallOutcome(value, None) for value in values]


def combine_components(reward: dict[str, float], weights: Mapping[str, float]) -> float:
    """Weighted sum of named reward components; every component needs a weight."""
    missing = sorted(set(reward) - set(weights))
    if missing:
        raise KeyError(f"no weight for reward components {missing}; weights are given for {sorted(weights)}")
    return sum(weights[name] * value for name, value in reward.items())


# ---------------------------------------------------------------------------------------------
# Loading scorers by import path
# ---------------------------------------------------------------------------------------------


def _load_module_from_file(file_path: Path, import_path: str):
    if not file_path.is_file():
        raise RewardFunctionImportError(f"reward function {import_path!r}: file {str(file_path)!r} does not exist")
    resolved = file_path.resolve()
    # A stable module name per file lets the same file load once, and lets dataclasses and pickle find it.
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_posttrain_reward_file_{digest}_{resolved.stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[module_name]
        raise RewardFunctionImportError(
            f"reward function {import_path!r}: executing {str(file_path)!r} raised {describe_exception(error)}"
        ) from error
    return module


def _import_module(module_name: str, import_path: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise RewardFunctionImportError(
                f"reward function {import_path!r}: no module named {missing!r} "
                f"(searched sys.path; a file path must end in .py)"
            ) from error
        raise RewardFunctionImportError(
            f"reward function {import_path!r}: module {module_name!r} was found but importing it failed: "
            f"{describe_exception(error)}"
        ) from error
    except BaseException as error:
        raise RewardFunctionImportError(
            f"reward function {import_path!r}: importing module {module_name!r} raised {describe_exception(error)}"
        ) from error


def load_function(import_path: str) -> Callable[..., Any]:
    """The callable named by "package.module:function" or "path/to/file.py:function".

    Raises `RewardFunctionImportError` saying what was wrong: a malformed path, a missing module or
    file, a module whose own import failed, a missing attribute, or an attribute that is not callable.
    """
    module_part, separator, attribute = import_path.rpartition(":")
    if not separator or not module_part or not attribute:
        raise RewardFunctionImportError(
            f"reward function {import_path!r} must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        module = _load_module_from_file(Path(module_part), import_path)
        where = f"file {module_part!r}"
    else:
        module = _import_module(module_part, import_path)
        where = f"module {module_part!r}"
    function = module
    for name in attribute.split("."):
        if not hasattr(function, name):
            public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise RewardFunctionImportError(
                f"reward function {import_path!r}: {where} has no attribute {attribute!r}"
                f" (its public callables: {', '.join(public) or 'none'})"
            )
        function = getattr(function, name)
    if not callable(function):
        raise RewardFunctionImportError(
            f"reward function {import_path!r}: {attribute!r} in {where} is a {type(function).__name__}, not a callable"
        )
    return function


def accepted_keywords(function: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword arguments `function` accepts, or None when it takes **kwargs (accepts any)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in kinds)


# ---------------------------------------------------------------------------------------------
# In-process scoring
# ---------------------------------------------------------------------------------------------


def score_in_process(function: Callable[..., Any], calls: Sequence[Mapping[str, Any]]) -> list[CallOutcome]:
    """Call `function(**call)` for each call in this thread, turning exceptions into errors.

    No time limit: use it only for scorers that cannot hang (pure string comparisons), or when the
    user explicitly asked for in-process scoring. KeyboardInterrupt and SystemExit propagate.
    """
    outcomes = []
    for call in calls:
        try:
            outcomes.append(CallOutcome(function(**call), None))
        except Exception as error:  # the point of this helper: a failing sample is masked, not fatal
            outcomes.append(CallOutcome(None, describe_exception(error)))
    return outcomes


# ---------------------------------------------------------------------------------------------
# The worker pool
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One call of a scorer in a worker: `function(**kwargs)` with a time limit."""

    function_path: str
    """Import path of the scorer ("package.module:function" or "path/to/file.py:function")."""
    kwargs: dict[str, Any]
    """Keyword arguments (picklable)."""
    timeout_s: float
    """Seconds the call may run once it reached a worker; past them the worker is killed."""


_SUPERVISOR_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from posttrain.envs.reward_worker import supervise; supervise(int(sys.argv[2]), int(sys.argv[3]))"
)


def _worker_environment() -> dict[str, str]:
    """The training process's environment, with one thread per native thread pool unless set.

    The pool already runs `num_workers` calls in parallel, and every pool thread reserves address
    space (a malloc arena, a stack, OpenBLAS buffers) that counts against the memory limit: with
    one thread per core, importing numpy alone can pass a few GiB on a large machine.
    """
    environment = dict(os.environ)
    for name in WORKER_THREAD_VARIABLES:
        environment.setdefault(name, "1")
    return environment


def _output_note(output: tuple[int, bytes]) -> str:
    """What a failed call printed, for its error: the last OUTPUT_TAIL_BYTES, on one line."""
    total, tail = output
    if not total:
        return ""
    text = tail.decode("utf-8", "replace")
    if total == len(tail):
        return f"; its output: {text!r}"
    return f"; its output ({total} bytes, the last {len(tail)}): {text!r}"


class _Worker:
    """The pool's handle on one worker: its supervisor process and the two pipes to it."""

    def __init__(self, preload: Sequence[str], memory_limit_mb: int):
        parent_inbox, child_outbox = os.pipe()
        child_inbox, parent_outbox = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SUPERVISOR_BOOTSTRAP, json.dumps(sys.path), str(child_inbox), str(child_outbox)],
            pass_fds=(child_inbox, child_outbox),
            stdin=subprocess.DEVNULL,
            env=_worker_environment(),
            # Its own session: Ctrl-C in the terminal reaches only the training process, which then
            # closes the pool, and a last-resort killpg reaches the supervisor and the worker.
            start_new_session=True,
        )
        os.close(child_inbox)
        os.close(child_outbox)
        self.inbox = Connection(parent_inbox, writable=False)
        self.outbox = Connection(parent_outbox, readable=False)
        self.started_at = time.monotonic()
        self.ready = False
        config = {
            "parent_pid": os.getpid(),
            "preload": list(preload),
            "memory_limit_mb": memory_limit_mb,
            "output_tail_bytes": OUTPUT_TAIL_BYTES,
        }
        self.outbox.send(config)

    def send(self, task: Task) -> None:
        """Start `task` on this (ready, idle) worker; the supervisor times it from now."""
        self.outbox.send(("call", task.timeout_s, pickle.dumps((task.function_path, task.kwargs))))

    def release(self) -> None:
        """Close the pipes: the supervisor sees end-of-file, kills the worker's tree and exits."""
        self.outbox.close()
        self.inbox.close()

    def kill(self, wait_s: float = SUPERVISOR_EXIT_WAIT_S) -> None:
        """Stop the worker and everything it started; SIGKILL the supervisor's session if it does not exit."""
        if not self.outbox.closed:
            self.release()
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:  # the supervisor is stopped or stuck: the last resort
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def exit_description(self) -> str:
        code = self.process.wait()
        if code < 0:
            return f"the reward worker's supervisor died from signal {signal.Signals(-code).name}"
        return f"the reward worker's supervisor exited with code {code}"


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:  # all supervisors clean up in parallel ...
        if not worker.outbox.closed:
            worker.release()
    for worker in workers:  # ... and are waited for one by one
        worker.kill()
    workers.clear()


class RewardWorkerPool:
    """A persistent pool of scorer processes with per-call deadlines.

    `run(tasks)` sends each task to an idle ready worker and waits; a task past its `timeout_s`
    gets its worker (and every process the worker started) killed and replaced and comes back as
    an error, as does a task whose worker died. Calls of one `run` execute in parallel over
    `num_workers` processes, in any order; the outcomes come back in task order. Workers start on
    first use and live until `close()` (or until the pool is garbage collected, the interpreter
    exits or the training process dies in any way). Not thread-safe: one `run` at a time.
    """

    def __init__(
        self,
        num_workers: int,
        preload: Sequence[str] = (),
        startup_timeout_s: float = 120.0,
        memory_limit_mb: int = DEFAULT_WORKER_MEMORY_MB,
    ):
        """`preload`: import paths every worker loads before it reports ready (so import time
        never counts against a call's time limit). `startup_timeout_s`: how long a worker may take
        to start before the pool gives up with an error. `memory_limit_mb`: address-space limit
        of each worker and of what it starts (RLIMIT_AS); 0 for none."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if not sys.platform.startswith("linux"):
            # The supervisor's guarantees rest on Linux alone (prctl's subreaper and parent-death signal, /proc).
            raise RewardError(f"reward worker processes need Linux, and this is {sys.platform}; set "
                              "environment.options.num_workers=0 to score in the training process (without the "
                              "workers' memory limit, output capture and time limits)")
        if memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb must be 0 (no limit) or more, got {memory_limit_mb}")
        self.num_workers = num_workers
        self.preload = tuple(preload)
        self.startup_timeout_s = startup_timeout_s
        self.memory_limit_mb = memory_limit_mb
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self.workers_replaced = 0
        """How many workers were killed (deadline) or died and were replaced, over the pool's life."""

    def close(self) -> None:
        """Stop every worker, and everything the workers started, now."""
        _kill_all(self._workers)

    def __enter__(self) -> RewardWorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _new_worker(self) -> _Worker:
        return _Worker(self.preload, self.memory_limit_mb)

    def _replace(self, worker: _Worker, wait_s: float = SUPERVISOR_EXIT_WAIT_S) -> None:
        worker.kill(wait_s)
        self._workers[self._workers.index(worker)] = self._new_worker()
        self.workers_replaced += 1

    def _on_startup_message(self, worker: _Worker) -> None:
        try:
            kind, message, output = worker.inbox.recv()
        except (EOFError, OSError):
            raise RewardError(
                f"a reward worker failed to start ({worker.exit_description()}); its stderr above says why"
            ) from None
        if kind != "ready":  # "startup_error" (the scorer did not import) or "died"
            raise RewardError(f"a reward worker failed to start: {message}{_output_note(output)} (an import that "
                              "needs more address space than environment.worker_memory_mb fails here too)")
        worker.ready = True

    def run(self, tasks: Sequence[Task]) -> list[CallOutcome]:
        """Run every task in the pool and return one outcome per task, in task order."""
        while len(self._workers) < self.num_workers:
            self._workers.append(self._new_worker())
        outcomes: list[CallOutcome | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        running: dict[_Worker, tuple[int, float]] = {}  # worker → (task index, deadline)
        try:
            self._run_until_done(tasks, outcomes, pending, running)
        except BaseException:
            # Interrupted (Ctrl-C, a start-up failure): a busy worker's late answer would be read as
            # the answer to the next run's task, so busy workers go; the next run starts new ones.
            for worker in running:
                worker.kill()
                self._workers.remove(worker)
            raise
        return outcomes

    def _start_pending(self, tasks: Sequence[Task], pending: deque[int], running: dict[_Worker, tuple[int, float]]):
        for worker in list(self._workers):
            if not pending:
                return
            if not worker.ready or worker in running:
                continue
            if worker.inbox.poll():  # an idle worker has nothing to say unless it died: the task never started
                self._replace(worker)
                continue
            index = pending.popleft()
            try:
                worker.send(tasks[index])
            except (BrokenPipeError, ConnectionResetError):  # its supervisor is gone: the task never started
                pending.appendleft(index)
                self._replace(worker)
                continue
            running[worker] = (index, time.monotonic() + tasks[index].timeout_s + SUPERVISOR_GRACE_S)

    def _on_answer(self, worker: _Worker, task: Task) -> CallOutcome:
        """The outcome of `task` from its worker's message; replaces the worker when it is gone."""
        try:
            kind, payload, output = worker.inbox.recv()
        except (EOFError, OSError):  # the supervisor itself died without a word
            self._replace(worker)
            return CallOutcome(None, worker.exit_description())
        if kind == "ok":
            try:
                return CallOutcome(pickle.loads(payload), None)
            except Exception as error:  # e.g. an instance of a class this process cannot import
                return CallOutcome(None, f"returned a value this process cannot unpickle: {describe_exception(error)}")
        if kind == "error":
            return CallOutcome(None, payload + _output_note(output))
        self._replace(worker)  # "timeout" or "died": the supervisor has killed the tree and exits
        if kind == "timeout":
            return CallOutcome(None, f"timed out after {task.timeout_s:g} s (worker killed){_output_note(output)}")
        return CallOutcome(None, payload + _output_note(output))

    def _run_until_done(
        self,
        tasks: Sequence[Task],
        outcomes: list[CallOutcome | None],
        pending: deque[int],
        running: dict[_Worker, tuple[int, float]],
    ) -> None:
        while pending or running:
            self._start_pending(tasks, pending, running)
            now = time.monotonic()
            starting = [w for w in self._workers if not w.ready]
            for worker in starting:
                if now - worker.started_at > self.startup_timeout_s:
                    raise RuntimeError(
                        f"a reward worker did not start within startup_timeout_s={self.startup_timeout_s}"
                    )
            wake_up = [deadline for _, deadline in running.values()]
            wake_up += [w.started_at + self.startup_timeout_s for w in starting]
            readable = wait([w.inbox for w in [*running, *starting]], timeout=max(0.0, min(wake_up) - now))
            for worker in [w for w in list(self._workers) if w.inbox in readable]:
                if not worker.ready:
                    self._on_startup_message(worker)
                    continue
                index, _ = running.pop(worker)
                outcomes[index] = self._on_answer(worker, tasks[index])
            now = time.monotonic()
            for worker, (index, deadline) in list(running.items()):
                if now >= deadline:  # the supervisor missed its own deadline by SUPERVISOR_GRACE_S
                    del running[worker]
                    outcomes[index] = CallOutcome(None, f"timed out after {tasks[index].timeout_s:g} s (worker killed)")
                    self._replace(worker, wait_s=0.0)


# ---------------------------------------------------------------------------------------------
# Error budget
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardErrorCounts:
    """Scoring failures of one step and of the run so far (run counts include this step)."""

    step_errors: int
    step_samples: int
    run_errors: int
    run_samples: int

    @property
    def step_error_fraction(self) -> float:
        return self.step_errors / self.step_samples if self.step_samples else 0.0

    @property
    def run_error_fraction(self) -> float:
        return self.run_errors / self.run_samples if self.run_samples else 0.0


def check_error_fraction(
    errors: Sequence[str | None], max_error_fraction: float, counts: RewardErrorCounts | None = None, max_shown: int = 3
) -> None:
    """Raise `RewardError` when the fraction of failed samples in `errors` exceeds `max_error_fraction`.

    The message names the fraction, the limit, the run totals (when `counts` is given) and the first
    `max_shown` distinct error messages with how often each occurred.
    """
    failed = [(i, e) for i, e in enumerate(errors) if e is not None]
    if not errors or len(failed) / len(errors) <= max_error_fraction:
        return
    frequency = Counter(e for _, e in failed)
    first_index = {}
    for i, e in failed:
        first_index.setdefault(e, i)
    shown = [f"[sample {first_index[e]}, {frequency[e]}×] {e}" for e in list(first_index)[:max_shown]]
    more = len(frequency) - len(shown)
    run = "" if counts is None else f"; {counts.run_errors} of {counts.run_samples} samples failed over the run so far"
    raise RewardError(
        f"reward scoring failed for {len(failed)} of {len(errors)} samples in this step "
        f"(error fraction {len(failed) / len(errors):.3f} > max_error_fraction {max_error_fraction:g}){run}. "
        "First errors:\n  " + "\n  ".join(shown) + (f"\n  ... and {more} other distinct errors" if more else "")
        + "\nFix the reward function or its data, or raise max_error_fraction if these failures are expected."
    )


class RewardErrorBudget:
    """Counts failed samples over a run and stops it when one step has too many.

    The loop calls `record(env_step.errors)` once per step: it adds the step's counts to the run's,
    returns both (for metrics), and raises `RewardError` when the step's error fraction exceeds
    `max_error_fraction`. A few masked samples are normal (a rare timeout); most of a step failing
    means the reward setup is broken, and training on the rest would be training on noise.
    """

    def __init__(self, max_error_fraction: float = 0.5):
        if not 0.0 <= max_error_fraction <= 1.0:
            raise ValueError(f"max_error_fraction must be in [0, 1], got {max_error_fraction}")
        self.max_error_fraction = max_error_fraction
        self.run_errors = 0
        self.run_samples = 0

    def record(self, errors: Sequence[str | None]) -> RewardErrorCounts:
        step_errors = sum(e is not None for e in errors)
        self.run_errors += step_errors
        self.run_samples += len(errors)
        counts = RewardErrorCounts(step_errors, len(errors), self.run_errors, self.run_samples)
        check_error_fraction(errors, self.max_error_fraction, counts)
        return counts

    def state_dict(self) -> dict[str, int]:
        return {"run_errors": self.run_errors, "run_samples": self.run_samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.run_errors = int(state["run_errors"])
        self.run_samples = int(state["run_samples"])
