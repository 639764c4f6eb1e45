"""`posttrain swe-eval`: score predictions (SWE-bench's format) on tasks, and write a report per instance.

OUTPUT/instances/INSTANCE_ID.json holds each instance's result (status, every FAIL_TO_PASS and PASS_TO_PASS test's
outcome, the error, the files whose changes were dropped, seconds, the end of pytest's output); OUTPUT/report.json
the counts and the ids per status, as the swebench harness's report does. Tasks without a prediction are not run
(they count as not submitted).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.envs.swe.scoring import DEFAULT_TEST_TIMEOUT_S, STATUSES, SweResult, score_patch
from posttrain.envs.swe.tasks import Prediction, SweTask, SweTaskError


def gold_predictions(tasks: list[SweTask]) -> list[Prediction]:
    """The tasks' own gold patches as predictions (to validate a task file before training on it)."""
    return [Prediction(task.instance_id, task.patch, "gold", index + 1) for index, task in enumerate(tasks)]


def check_predictions(tasks: list[SweTask], predictions: list[Prediction], source: str) -> None:
    """Raise SweTaskError naming the line of the first prediction whose instance is not among the tasks."""
    known = {task.instance_id for task in tasks}
    for prediction in predictions:
        if prediction.instance_id not in known:
            close = difflib.get_close_matches(prediction.instance_id, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SweTaskError(f"{source}:{prediction.line}: instance_id {prediction.instance_id!r} is not one of the "
                               f"{len(known)} tasks{hint}")


def evaluate(tasks: list[SweTask], predictions: list[Prediction], output: Path, *,
             test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S,
             on_result: Callable[[SweResult], None] | None = None) -> dict[str, Any]:
    """Score every prediction, write the per-instance files and report.json under `output`; return the report."""
    by_id = {task.instance_id: task for task in tasks}
    (output / "instances").mkdir(parents=True, exist_ok=True)
    ids: dict[str, list[str]] = {status: [] for status in STATUSES}
    seconds = []
    for prediction in predictions:
        result = score_patch(by_id[prediction.instance_id], prediction.model_patch, test_timeout_s=test_timeout_s)
        ids[result.status].append(result.instance_id)
        seconds.append(result.seconds)
        record = {**result.as_dict(), "model_name_or_path": prediction.model_name_or_path}
        (output / "instances" / f"{_file_name(result.instance_id)}.json").write_text(
            json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if on_result is not None:
            on_result(result)
    report = {"total_instances": len(tasks), "submitted_instances": len(predictions),
              "completed_instances": len(predictions) - len(ids["error"]) - len(ids["empty_patch"]),
              **{f"{status}_instances": len(ids[status]) for status in STATUSES},
              **{f"{status}_ids": sorted(ids[status]) for status in STATUSES},
              "seconds_per_instance": sum(seconds) / len(seconds) if seconds else 0.0}
    (output / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def summary_line(report: dict[str, Any]) -> str:
    """One line of counts, as the swebench harness prints them."""
    return (f"{report['submitted_instances']} of {report['total_instances']} instances submitted: "
            f"{report['resolved_instances']} resolved, {report['unresolved_instances']} unresolved, "
            f"{report['error_instances']} error, {report['empty_patch_instances']} empty patch "
            f"({report['seconds_per_instance']:.2f} s per instance)")


def _file_name(instance_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in instance_id)
