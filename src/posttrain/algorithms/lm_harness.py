"""`posttrain eval --lm-eval-tasks TASKS`: lm-evaluation-harness's tasks run on a model posttrain loads.

The model and tokenizer are loaded as every posttrain command loads them (a run's final/, a checkpoint, an
embedded model, a hub id; the tokenizer checks of models.loading included) and handed to lm-eval's HF model class
(`HFLM(pretrained=<the model>, tokenizer=<the tokenizer>)`), so lm-eval scores exactly the model posttrain would.
Tasks are found among lm-eval's own and in `lm_eval_include_path` (a folder of task YAML files: a local
`dataset_path: json` with `dataset_kwargs.data_files` runs without a network). The report is lm-eval's results
per task; with `output` every scored document is written as one JSON line (lm-eval's per-sample log, with the
task's name).

lm-eval is an optional extra (`pip install 'posttrain[lm-eval]'`), imported only here and only when asked for.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.algorithms.common import check_writable_file
from posttrain.config.schema import EvalConfig
from posttrain.errors import RunError
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer

INSTALL_HINT = "pip install 'posttrain[lm-eval]'"


@dataclass(frozen=True)
class HarnessReport:
    results: dict[str, dict[str, float]]
    """Per task: lm-eval's metrics by name ("acc", "acc_norm", "acc_stderr", ...; "exact_match,strict-match" where
    a task names its filter), and "count", the documents scored."""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"lm_eval": self.results}


def import_harness():
    """The lm_eval module; RunError with the install command when the extra is missing."""
    try:
        import lm_eval  # optional extra: imported only for --lm-eval-tasks
    except ImportError as error:
        raise RunError(f"--lm-eval-tasks needs lm-evaluation-harness, an optional extra: {INSTALL_HINT} "
                       f"({error})") from None
    return lm_eval


def run_harness(cfg: EvalConfig) -> HarnessReport:
    """cfg.lm_eval_tasks run by lm-eval on cfg.model (module docstring)."""
    lm_eval = import_harness()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    if cfg.output is not None:
        check_writable_file(Path(cfg.output), "output")
    include = cfg.lm_eval_include_path
    if include is not None and not Path(include).is_dir():
        raise RunError(f"lm_eval_include_path={include!r} is not a folder (it should hold lm-eval task YAML files)")
    manager = task_manager(TaskManager, include, cfg.lm_eval_tasks)
    unknown = [task for task in cfg.lm_eval_tasks if task not in manager.all_tasks]
    if unknown:
        where = f"lm-eval's tasks or {include}" if include else "lm-eval's tasks (give --lm-eval-include-path DIR for your own)"
        raise RunError(f"lm-eval task(s) {', '.join(map(repr, unknown))} not found among {where}")

    started = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    model = load_causal_lm(cfg.model, device=default_device()).eval()
    harness_model = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size)
    # lm-eval's own seeds unless seed is set: the same few-shot examples as a plain `lm_eval` run picks.
    seeds = {f"{kind}_seed": cfg.seed for kind in ("random", "numpy_random", "torch_random", "fewshot_random")
             } if "seed" in cfg.model_fields_set else {}
    output = lm_eval.simple_evaluate(
        model=harness_model, tasks=list(cfg.lm_eval_tasks), num_fewshot=cfg.lm_eval_num_fewshot,
        limit=cfg.num_examples, task_manager=manager, log_samples=cfg.output is not None,
        apply_chat_template=cfg.prompt.use_chat_template, system_instruction=cfg.prompt.system_prompt, **seeds)
    results = {task: harness_metrics(values, output["n-samples"].get(task)) for task, values in
               output["results"].items()}
    if cfg.output is not None:
        lines = [json.dumps({"task": task, **sample}, default=handle_non_serializable)
                 for task, samples in output["samples"].items() for sample in samples]
        Path(cfg.output).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return HarnessReport(results, time.perf_counter() - started)


def task_manager(manager_class, include: str | None, tasks: list[str]):
    """lm-eval's TaskManager: of the include folder alone when it holds every task (indexing lm-eval's thousands
    of built-in task files takes seconds), else of both."""
    if include is not None:
        local = manager_class(include_path=include, include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    return manager_class(include_path=include)


def harness_metrics(values: dict[str, Any], counts: dict[str, int] | None) -> dict[str, float]:
    """One task's lm-eval results as {metric: value}: "acc,none" becomes "acc" (a task's own filter name stays,
    "exact_match,strict-match"); the alias, sample_len and non-numbers (an "N/A" stderr) are left out; "count" is
    the number of documents scored."""
    metrics: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key == "sample_len":
            continue  # sample_len: the same as count
        name, _, filter_name = key.partition(",")
        metrics[name if filter_name in ("none", "") else key] = float(value)
    if counts is not None:
        metrics["count"] = counts["effective"]
    return metrics


def describe_harness(report: HarnessReport, what: str) -> str:
    """The report as lines for the console: per task, its metrics."""
    lines = [f"{what}: lm-eval, {report.seconds:.1f}s"]
    for task, metrics in report.results.items():
        lines.append(f"  {task}")
        lines += [f"    {name:<28} {value:.4f}" for name, value in metrics.items()]
    return "\n".join(lines)
