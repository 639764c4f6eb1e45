"""OUTPUT/report.html: one self-contained page per run (or comparing runs) to explore, written during every run (at
each evaluation and checkpoint), on every way out of it, and by `posttrain report`."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from posttrain.config.schema import LoggingConfig
from posttrain.logging import RunLogger
from posttrain.logging.metrics import MetricsFile
from posttrain.logging.report import (
    MAX_POINTS_PER_SERIES,
    ReportError,
    downsample,
    read_run_info,
    update_run_status,
    write_report,
    write_run_info,
)

HOSTILE = '</script><script>alert("pwned")</script><img src=x onerror=alert(1)> & <b>bold</b>'
# Anything that could make a viewer fetch something: a scheme, a protocol-relative address, a src/href attribute,
# a stylesheet link or import, a CSS url().
EXTERNAL = re.compile(r"https?:|//cdn|\bsrc\s*=|\bhref\s*=\s*(?![\"']?#)|<link\b|@import|url\(", re.IGNORECASE)


class _Tags(HTMLParser):
    """The page's elements and text, as a browser's tokenizer sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append("")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data


def _parse(page: str) -> _Tags:
    parser = _Tags()
    parser.feed(page)
    return parser


def _write_run(run_dir: Path, records: list[dict], samples: list[dict] | None = None,
               config: str = "output_dir: runs/x\ntrainer:\n  max_steps: 3\n") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    with MetricsFile(run_dir / "metrics.jsonl") as metrics_file:
        for record in records:
            metrics_file.write(record["step"], {k: v for k, v in record.items() if k != "step"})
    (run_dir / "config.yaml").write_text(config)
    if samples is not None:
        (run_dir / "samples.jsonl").write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    return run_dir


def _sample(step: int, completion: str, split: str = "train", reward: float | None = 1.0) -> dict:
    return {"step": step, "split": split, "prompt": f"{step}+1=", "reference": str(step + 1), "completion": completion,
            "reward": reward,
            "components": {"correct": reward} if reward is not None else None,
            "correct": None if reward is None else reward > 0.5, "error": None if reward is not None else "timeout"}


def _script(page: str, element_id: str) -> dict:
    """The JSON in the page's <script type="application/json" id=element_id>."""
    found = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', page, re.DOTALL)
    return json.loads(found.group(1))


def _curves(page: str) -> dict:
    return _script(page, "curves-data")


def _series_points(page: str) -> dict[str, list[int]]:
    """label -> drawn point counts of every series in the page's charts."""
    found: dict[str, list[int]] = {}
    if 'id="curves-data"' not in page:
        return found
    for chart in _curves(page)["charts"]:
        for series in chart["series"]:
            found.setdefault(series["label"], []).append(len(series["steps"]))
    return found


def _figures(page: str) -> list[str]:
    return re.findall(r'<figure class="figure".*?</figure>', page, flags=re.DOTALL)


def _captions(page: str) -> list[str]:
    return [re.search(r'<span class="title">(.*?)</span>', figure).group(1) for figure in _figures(page)]


SHORT = [{"step": s, "loss": 3.0 / s, "learning_rate": 1e-4 * s, "grad_norm": 0.5 + s, "tokens_per_second": 900.0,
          "time/generate": 0.2, "time/train": 0.6, "time/step": 1.0} | ({"eval_loss": 2.0} if s == 3 else {})
         for s in (1, 2, 3)]


# ---- the page --------------------------------------------------------------------------------------------


def test_report_is_self_contained_and_holds_curves_config_and_samples(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "my_run", SHORT, [_sample(1, "4"), _sample(3, "the answer is 42", "eval/math")],
                     config="output_dir: runs/my_run\ntrainer:\n  learning_rate: 0.000123\n")
    write_run_info(run, "grpo", "12 rows read: 12 examples, 3 skipped as malformed", "training 1.08M parameters", None)
    page = write_report([run], run / "report.html").read_text()

    assert EXTERNAL.search(page) is None, EXTERNAL.search(page)
    parsed = _parse(page)
    assert [tag for tag, _ in parsed.tags if tag in ("img", "link", "iframe", "object", "embed")] == []
    assert all("src" not in attrs for _, attrs in parsed.tags)
    assert re.search(r"<title>my_run — posttrain grpo report</title>", page)
    assert "<h1>my_run: grpo run</h1>" in page

    captions = _captions(page)
    assert captions == ["loss / eval_loss", "learning_rate", "grad_norm"]  # names in full (none cut)
    # Constant over the run: a row each, not a chart.
    constants = page.split('<div id="constants">')[1].split("</table>")[0]
    assert re.findall(r"<tr><td>([\w/]+)</td>", constants) == ["tokens_per_second", "time/generate", "time/step",
                                                                 "time/train"]
    charts = _curves(page)["charts"]
    assert [chart["title"] for chart in charts] == captions  # one chart of data per figure, in order
    for figure, chart in zip(_figures(page), charts):  # every chart has its box, its log switch and data
        assert figure.count('<div class="plot"></div>') == 1 and 'class="c-log"' in figure
        assert chart["series"] and all(len(s["steps"]) == len(s["values"]) >= 1 for s in chart["series"])
    assert _series_points(page)["loss"] == [3] and _series_points(page)["eval_loss"] == [1]
    loss = _curves(page)["charts"][0]["series"][0]
    assert (loss["steps"], loss["values"]) == ([1, 2, 3], [3.0, 1.5, 1.0])

    assert "learning_rate: 0.000123" in page  # the config, verbatim
    assert "3 skipped as malformed" in page  # the data summary from run_info.json
    assert "the answer is 42" in page and "eval/math" in page  # a sample, also on the page without the script
    assert re.search(r"<td>time/generate</td><td class=\"num\">0\.2 s <span class=\"at\">20%</span>", page)
    payload = _script(page, "samples-data")
    assert [row[5] for row in payload["rows"]] == ["4", "the answer is 42"]
    assert [row[4] for row in payload["rows"]] == ["2", "4"]  # the reference answers, beside the completions


def test_text_from_the_files_is_escaped(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", SHORT, [_sample(1, HOSTILE)] + [_sample(2, "x") for _ in range(30)],
                     config=f"prompt:\n  system_prompt: '{HOSTILE}'\n")
    write_run_info(run, "sft", f"data with {HOSTILE}", "training", None)
    page = write_report([run], tmp_path / "report.html").read_text()

    parsed = _parse(page)
    # Only the page's own five scripts (the curves' JSON, uPlot, the charts' code, the samples' JSON and the table's
    # code); no element the files brought.
    assert [tag for tag, _ in parsed.tags].count("script") == 5
    assert [tag for tag, _ in parsed.tags if tag in ("img", "b")] == []
    assert "alert(" not in "".join(parsed.scripts[1:3] + parsed.scripts[4:])
    assert "<script>alert" not in page and "<img" not in page and "<b>bold" not in page
    assert "&lt;/script&gt;&lt;script&gt;alert(&quot;pwned&quot;)" in page  # config, data summary, first page
    # The JSON the scripts read holds no "<", so it cannot close its element, and decodes to the text as written.
    assert "<" not in parsed.scripts[0] and "<" not in parsed.scripts[3]
    assert json.loads(parsed.scripts[3])["rows"][0][5] == HOSTILE


def test_ten_thousand_steps_render_in_seconds_to_a_bounded_file(tmp_path: Path) -> None:
    names = ["loss", "learning_rate", "grad_norm", "tokens_per_second", "reward/mean", "accuracy", "kl", "entropy",
             "response_length/mean", "time/generate", "time/score", "time/train", "time/step"]
    names += [f"extra/metric_{i}" for i in range(30 - len(names) - 4)]
    records = []
    for step in range(1, 10_001):
        record = {"step": step} | {name: math.sin(step / 300 + i) + 2 + (i % 3) * 1e-3 * step
                                   for i, name in enumerate(names)}
        if step == 6_543:
            record["loss"] = 50.0  # one spike among 10,000 points
        if step % 250 == 0:
            record |= {"eval_loss": 1.0 + 100 / step, "val/accuracy": step / 10_000,
                       "eval/math/accuracy": step / 20_000, "eval/math/reward_mean": step / 30_000}
        records.append(record)
    run = _write_run(tmp_path / "long_run", records,
                     [_sample(step, f"completion {step}") for step in range(1, 10_001) for _ in range(4)])

    started = time.perf_counter()
    path = write_report([run], run / "report.html")
    seconds = time.perf_counter() - started
    size = path.stat().st_size
    print(f"10,000 steps x 30 metrics, 40,000 samples: {size / 1e6:.2f} MB in {seconds:.2f} s")
    # Its time is printed, not asserted (about 0.6 s on 2 cores): speed belongs to benchmarks, not unit tests.
    assert size < 1_500_000  # about 0.9 MB: 30 series of at most 1,000 points, 1,000 samples

    page = path.read_text()
    points = _series_points(page)
    assert len(points) == 30 and all(n <= MAX_POINTS_PER_SERIES for (n,) in points.values())
    assert points["loss"] == [MAX_POINTS_PER_SERIES] and points["eval_loss"] == [40]
    assert "loss: 10,000 points, 1,000 drawn" in page
    assert "<h3>eval/math</h3>" in page  # evaluation sets get their own group of charts
    # The spike survives the cut.
    loss = next(s for chart in _curves(page)["charts"] for s in chart["series"] if s["label"] == "loss")
    assert max(loss["values"]) == 50 and loss["steps"][loss["values"].index(50)] == 6_543
    assert "1,000 of 40,000 samples shown" in page


def test_downsampling_keeps_first_last_and_every_extreme() -> None:
    steps = list(range(100_000))
    values = [0.0] * 100_000
    values[31_337], values[77_777] = 9.0, -4.0
    kept_steps, kept_values = downsample(steps, values, 1000)
    assert len(kept_steps) <= 1000 and kept_steps == sorted(kept_steps)
    assert kept_steps[0] == 0 and kept_steps[-1] == 99_999
    assert (31_337, 9.0) in zip(kept_steps, kept_values) and (77_777, -4.0) in zip(kept_steps, kept_values)
    assert downsample([1, 2, 3], [1.0, 2.0, 3.0], 1000) == ([1, 2, 3], [1.0, 2.0, 3.0])


def test_non_finite_values_are_skipped_and_named(tmp_path: Path) -> None:
    records = [{"step": 1, "loss": 2.0, "grad_norm": float("nan")},
               {"step": 2, "loss": float("inf"), "grad_norm": float("nan")},
               {"step": 3, "loss": 1.0, "grad_norm": float("nan")},
               {"step": 4, "loss": float("nan"), "grad_norm": float("-inf")}]
    run = _write_run(tmp_path / "diverged", records)
    page = write_report([run], run / "report.html").read_text()

    assert "loss: 2 non-finite value(s) not drawn, the first at step 2" in page
    assert "no finite values to draw" in page  # grad_norm
    assert _series_points(page) == {"loss": [2]}
    assert not re.search(r"nan|inf", json.dumps(_curves(page)["charts"]), re.IGNORECASE)
    assert '<td>loss</td><td class="num">NaN</td><td class="num">4</td>' in page  # the final value, as it was


def test_missing_samples_run_info_and_config_are_said_not_fatal(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "sft_run", SHORT)
    (run / "config.yaml").unlink()
    page = write_report([run], run / "report.html").read_text()
    assert "no samples.jsonl in this run directory" in page
    assert "No run_info.json in this run directory" in page
    assert "(no config.yaml in this run directory)" in page
    assert "<title>sft_run — posttrain report</title>" in page
    assert 'id="samples-data"' not in page

    empty = tmp_path / "not_started"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert "No metrics logged yet." in write_report([empty], empty / "report.html").read_text()


def test_an_unreadable_samples_line_is_counted(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", SHORT, [_sample(1, "fine")])
    with (run / "samples.jsonl").open("a") as samples:
        samples.write('{"step": 2, "split": "tra')  # cut by a kill
    page = write_report([run], run / "report.html").read_text()
    assert "1 line(s) of samples.jsonl were not readable" in page and "fine" in page


def test_several_runs_are_overlaid_one_colour_each_with_their_config_differences(tmp_path: Path) -> None:
    first = _write_run(tmp_path / "lr_low", SHORT, [_sample(1, "from the first")],
                       config="trainer:\n  learning_rate: 0.0001\n  max_steps: 3\n")
    second = _write_run(tmp_path / "lr_high", [r | {"loss": r["loss"] * 2} for r in SHORT],
                        config="trainer:\n  learning_rate: 0.001\n  max_steps: 3\n")
    page = write_report([first, second], tmp_path / "compare.html").read_text()

    assert "<h1>2 runs compared: lr_low, lr_high</h1>" in page
    points = _series_points(page)
    assert points["lr_low · loss"] == [3] and points["lr_high · loss"] == [3]  # shared axes, one series each
    assert points["lr_low"] == points["lr_high"] == [3] * 2  # learning_rate and grad_norm charts name the run
    loss_chart = _curves(page)["charts"][0]
    assert len({s["color"] for s in loss_chart["series"]}) == 2  # one colour per run
    assert {s["key"]: s["dash"] for s in loss_chart["series"]} == {"loss": None, "eval_loss": [6, 3]}  # by dash
    assert re.search(r"<td>trainer\.learning_rate</td><td>0\.0001</td><td>0\.001</td>", page)
    assert "trainer.max_steps" not in page.split("Keys that differ")[1].split("</table>")[0]
    assert "from the first" in page and "lr_high: no samples.jsonl" in page

    same_name = [_write_run(tmp_path / name / "run", SHORT) for name in ("a", "b")]
    page = write_report(same_name, tmp_path / "same.html").read_text()
    assert str(same_name[0]) in page and str(same_name[1]) in page  # labels fall back to the paths


def test_a_directory_without_metrics_is_named(tmp_path: Path) -> None:
    good = _write_run(tmp_path / "good", SHORT)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=re.escape(f"{tmp_path / 'empty'}: no metrics.jsonl there")):
        write_report([good, tmp_path / "empty"], tmp_path / "out.html")
    with pytest.raises(ReportError, match="no such directory"):
        write_report([tmp_path / "missing"], tmp_path / "out.html")
    assert not (tmp_path / "out.html").exists()


def test_run_info_records_each_start_and_a_fresh_start_replaces_them(tmp_path: Path) -> None:
    write_run_info(tmp_path, "grpo", "16 prompts", "training 1M parameters", None)
    write_run_info(tmp_path, "grpo", "16 prompts", "training 1M parameters", 250)
    info = read_run_info(tmp_path)
    assert info["recipe"] == "grpo" and [start["resumed_from_step"] for start in info["starts"]] == [None, 250]
    assert set(info["starts"][0]["versions"]) == {"posttrain", "torch", "transformers"}
    write_run_info(tmp_path, "sft", "8 rows", "training", None)
    assert [start["data"] for start in read_run_info(tmp_path)["starts"]] == ["8 rows"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_info.json"]


def test_constant_metrics_get_a_row_not_a_chart(tmp_path: Path) -> None:
    # A flat learning rate was drawn on a 9.4e-5…1.06e-4 axis and eval turns/mean took a whole panel.
    records = [{"step": s, "loss": 2.0 / s, "learning_rate": 1e-4} | ({"eval/add/turns/mean": 1.0,
                                                                       "eval/add/accuracy": s / 100} if s % 10 == 0
                                                                      else {}) for s in range(1, 51)]
    run = _write_run(tmp_path / "run", records)
    page = write_report([run], run / "report.html").read_text()
    assert _captions(page) == ["loss", "eval/add/accuracy"]
    constants = page.split('<div id="constants">')[1].split("</table>")[0]
    assert '<td>learning_rate</td><td class="num">0.0001 <span class="at">50 logged steps, 1–50</span>' in constants
    assert '<td>eval/add/turns/mean</td><td class="num">1 <span class="at">5 logged steps, 10–50</span>' in constants

    # Compared runs: a metric constant in each run is a row with each run's value, even where the values differ.
    other = _write_run(tmp_path / "other", [r | {"learning_rate": 3e-4} for r in records])
    page = write_report([run, other], tmp_path / "compare.html").read_text()
    assert "learning_rate" not in _captions(page) and "0.0003 <span" in page and "0.0001 <span" in page
    # ...and one that changes in either run keeps its chart.
    changing = _write_run(tmp_path / "changing", [r | {"learning_rate": 1e-4 * r["step"]} for r in records])
    assert "learning_rate" in _captions(write_report([run, changing], tmp_path / "c2.html").read_text())


def _checks(page: str) -> list[str]:
    section = page.split('<section id="checks"')[1].split("</section>")[0]
    return [html.unescape(item) for item in re.findall(r"<li>(.*?)</li>", section)]


def test_checks_flag_what_looks_wrong(tmp_path: Path) -> None:
    records = []
    for step in range(1, 11):
        record = {"step": step, "loss": 1.0 / step, "truncation_rate": 0.2, "reward/errors": float(step == 4),
                  "nonfinite_skipped_steps": float(step >= 7)}
        if step in (5, 10):
            record |= {"eval/add/truncation_rate": 1.0, "eval/add/accuracy": 0.6 if step == 5 else 0.4,
                       "eval/add/reward/mean": 0.5, "eval_loss": 1.0 if step == 5 else 1.5}
        records.append(record)
    records[7]["grad_norm"] = float("nan")
    run = _write_run(tmp_path / "bad", records)
    checks = _checks(write_report([run], run / "report.html").read_text())
    assert checks == [
        "eval/add/truncation_rate is 1 at step 10: most completions hit the token limit before ending (raise "
        "max_new_tokens, or check the stop strings and the end-of-sequence token)",
        "reward/errors: rewards failed at 1 of 10 logged steps, the first at step 4 (masked and counted; the errors "
        "are in the samples table)",
        "1 step(s) skipped because the loss or gradient norm was not finite (trainer.on_nonfinite=skip)",
        "grad_norm: 1 non-finite value(s), the first at step 8 (NaN)",
        "eval/add/accuracy is worse at the end than at the first evaluation: 0.4 at step 10 against 0.6 at step 5 "
        "(higher is better)",
        "eval_loss is worse at the end than at the first evaluation: 1.5 at step 10 against 1 at step 5 (lower is "
        "better)",
    ]

    # Controls: a truncation rate of 0.2, no failed reward, an evaluation that improved: nothing to say.
    good = [{k: v for k, v in r.items() if k not in ("reward/errors", "nonfinite_skipped_steps", "grad_norm")}
            | ({"eval/add/truncation_rate": 0.5, "eval/add/accuracy": r["step"] / 10, "eval_loss": 1 / r["step"]}
               if "eval_loss" in r else {}) | {"reward/errors": 0.0} for r in records]
    run = _write_run(tmp_path / "good", good)
    page = write_report([run], run / "report.html").read_text()
    assert _checks(page) == [] and "Nothing looks wrong." in page

    # A run that ended on an error says so first.
    write_run_info(run, "grpo", "data", "training", None)
    update_run_status(run, "ended by RunError: step 9: the loss is nan", 9, {"rss_bytes": 1})
    assert _checks(write_report([run], run / "report.html").read_text()) == [
        "the run did not finish: ended by RunError: step 9: the loss is nan"]


def test_the_run_context_status_and_peak_memory_are_shown(tmp_path: Path, monkeypatch) -> None:
    import socket
    import sys

    repo = tmp_path / "project"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.yaml").write_text("a: 1\n")
    subprocess.run([*git, "add", "train.yaml"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.chdir(repo)
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/posttrain", "grpo", "--config", "train.yaml", "a=b c"])

    run = _write_run(tmp_path / "run", SHORT)
    write_run_info(run, "grpo", "16 prompts", "training", None)
    context = read_run_info(run)["starts"][0]["context"]
    assert context["host"] == socket.gethostname() and context["cwd"] == str(repo)
    assert context["command"] == "posttrain grpo --config train.yaml 'a=b c'"
    assert context["git"][0] == {"of": "working directory", "repository": str(repo), "commit": commit,
                                 "dirty": False}
    assert read_run_info(run)["starts"][0]["status"] == "running"

    update_run_status(run, "finished", 3, {"rss_bytes": 1_234_567_890, "cuda_allocated_bytes": 5_000_000_000})
    page = write_report([run], run / "report.html").read_text()
    runs = page.split('<section id="runs">')[1].split("</section>")[0]
    cells = dict(re.findall(r"<dt>([^<]*)</dt><dd>(.*?)</dd>", runs))
    assert cells["status"].startswith("finished (as of ") and cells["status"].endswith(", step 3)")
    assert cells["command"] == "<code>posttrain grpo --config train.yaml &#x27;a=b c&#x27;</code>"
    # (then posttrain's own checkout, when it is one, as in a development install)
    assert cells["git commit"].startswith(f"{commit[:12]} (working directory: {repo})")
    assert cells["host"] == html.escape(socket.gethostname())
    assert cells["peak memory"] == "1.23 GB resident (rank 0&#x27;s process); GPU 5.00 GB allocated by torch"
    assert "finished" in page.split("</header>")[0]

    (repo / "train.yaml").write_text("a: 2\n")
    write_run_info(run, "grpo", "16 prompts", "training", None)
    assert read_run_info(run)["starts"][0]["context"]["git"][0]["dirty"] is True


def test_x_by_time_and_tokens_is_summed_from_the_step_times(tmp_path: Path) -> None:
    # SFT-style step_seconds, logged at steps 1, 2 and 4 (log_every 2 after the first): step 3 counts as step 4.
    records = [{"step": s, "loss": 1.0 / s, "step_seconds": 2.0 * (1 + (s == 4)), "tokens_per_second": 100.0}
               for s in (1, 2, 4)]
    clock = _curves(write_report([_write_run(tmp_path / "sft", records)], tmp_path / "a.html").read_text())
    assert clock["runs"][0]["clock"] == {"step": [1, 2, 4], "time": [2.0, 4.0, 12.0], "tokens": [200, 400, 1200]}

    # GRPO-style time/step; no tokens_per_second: the tokens axis is not offered.
    records = [{"step": s, "loss": 1.0 / s, "time/step": 1.5} for s in (1, 2, 3)]
    page = write_report([_write_run(tmp_path / "grpo", records)], tmp_path / "b.html").read_text()
    assert _curves(page)["runs"][0]["clock"] == {"step": [1, 2, 3], "time": [1.5, 3.0, 4.5], "tokens": None}
    assert '<option value="time">' in page and '<option value="tokens" disabled' in page


def test_a_failed_write_leaves_the_previous_page_whole(tmp_path: Path, monkeypatch) -> None:
    import posttrain.logging.report as report

    run = _write_run(tmp_path / "run", SHORT)
    before = write_report([run], run / "report.html").read_text()
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 4, "loss": 0.5}) + "\n")

    def killed(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report.os, "replace", killed)
    with pytest.raises(OSError, match="No space left"):
        write_report([run], run / "report.html")
    assert (run / "report.html").read_text() == before  # never half a page
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl", "report.html"]
    # A page half-written when a run was killed (SIGKILL) is removed when the next run starts in the folder.
    from posttrain.rundir import remove_dead_staging

    stale = run / ".tmp-report.html-4999999"  # above any PID Linux hands out
    stale.write_text("<!DOCTYPE html><html><head>")
    assert remove_dead_staging(run) == [stale] and not stale.exists()


def test_the_reference_answer_comes_from_the_prompts_row() -> None:
    from posttrain.algorithms.evaluate import reference_text

    assert reference_text({"answer": "42", "solution": "x"}) == "42"
    assert reference_text({"answer": 7}) == "7"
    assert reference_text({"tests": ["assert f(1) == 2"]}) == '["assert f(1) == 2"]'
    assert reference_text({"answer": None, "reference": "Paris"}) == "Paris"
    assert reference_text({"question": "?"}) is None


# ---- written by every run, and by `posttrain report` -----------------------------------------------------


def test_run_logger_writes_the_report_at_the_end_also_when_the_run_fails(tmp_path: Path) -> None:
    with RunLogger(tmp_path / "ok", LoggingConfig(progress="none"), recipe="sft", total_steps=2) as run_logger:
        run_logger.log(1, {"loss": 1.0})
    assert run_logger.report_path == tmp_path / "ok" / "report.html"
    assert "<td>loss</td>" in run_logger.report_path.read_text()

    with pytest.raises(RuntimeError, match="boom"), \
            RunLogger(tmp_path / "crashed", LoggingConfig(progress="none"), recipe="sft", total_steps=9):
        write_run_info(tmp_path / "crashed", "sft", "data", "training", None)
        raise RuntimeError("boom")
    assert "ended by RuntimeError: boom" in (tmp_path / "crashed" / "report.html").read_text()
    assert read_run_info(tmp_path / "crashed")["starts"][0]["status"] == "ended by RuntimeError: boom"

    off = LoggingConfig(progress="none", report=False)
    with RunLogger(tmp_path / "off", off, recipe="sft", total_steps=1) as run_logger:
        run_logger.log(1, {"loss": 1.0})
    assert not (tmp_path / "off" / "report.html").exists() and run_logger.report_path is None


def test_a_report_that_cannot_be_written_never_hides_the_runs_error(tmp_path: Path, monkeypatch, capsys) -> None:
    import posttrain.logging

    def full_disk(run_dirs, output):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(posttrain.logging, "write_report", full_disk)
    quiet = LoggingConfig(progress="none", plot=False)
    with pytest.raises(RuntimeError, match="the run's own error"), \
            RunLogger(tmp_path / "run", quiet, recipe="sft", total_steps=9):
        raise RuntimeError("the run's own error")
    assert "posttrain: could not write the run report: [Errno 28] No space left on device" in capsys.readouterr().err
    with pytest.raises(OSError, match="No space left"), \
            RunLogger(tmp_path / "run2", quiet, recipe="sft", total_steps=1):
        pass  # a run that succeeded reports the error, as it does the plot's

    def broken(run_dirs, output):
        raise ValueError("a chart that cannot be drawn")

    monkeypatch.setattr(posttrain.logging, "write_report", broken)
    with RunLogger(tmp_path / "run3", quiet, recipe="sft", total_steps=1):
        pass  # ...but a report that cannot be drawn does not fail a finished run
    assert "could not write the run report: a chart that cannot be drawn" in capsys.readouterr().err


def test_a_metric_flat_to_a_few_ulps_is_a_constant(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 0.1}\n{"step": 2, "loss": 0.10000000000000002}\n')
    page = write_report([run], run / "report.html").read_text()
    assert _figures(page) == [] and "<td>loss</td><td class=\"num\">0.1 <span" in page


def test_cli_report_writes_next_to_the_run_or_compares_into_the_current_directory(tmp_path, monkeypatch,
                                                                                     capsys) -> None:
    from posttrain.cli import build_parser, main

    assert "report" in build_parser().format_help()
    first, second = _write_run(tmp_path / "a", SHORT), _write_run(tmp_path / "b", SHORT)
    assert main(["report", str(first)]) == 0
    assert (first / "report.html").is_file() and f"report: {first / 'report.html'}" in capsys.readouterr().out

    monkeypatch.chdir(tmp_path)
    assert main(["report", str(first), str(second)]) == 0
    assert "2 runs compared: a, b" in (tmp_path / "report.html").read_text()
    assert main(["report", str(first), str(second), "--output", str(tmp_path / "cmp" / "x.html")]) == 0
    assert (tmp_path / "cmp" / "x.html").is_file()

    (tmp_path / "not_a_run").mkdir()
    assert main(["report", str(first), str(tmp_path / "not_a_run")]) == 1
    assert f"posttrain report: {tmp_path / 'not_a_run'}: no metrics.jsonl there" in capsys.readouterr().err


def test_the_run_logger_rewrites_the_report_during_the_run(tmp_path: Path, monkeypatch) -> None:
    import posttrain.logging

    written = []
    real = posttrain.logging.write_report
    monkeypatch.setattr(posttrain.logging, "write_report", lambda *args: written.append(args) or real(*args))
    run = tmp_path / "run"
    with RunLogger(run, LoggingConfig(progress="none", plot=False), recipe="sft", total_steps=9) as run_logger:
        write_run_info(run, "sft", "data", "training", None)
        assert run_logger.write_report() is None and written == []  # nothing logged yet: nothing to write
        run_logger.log(1, {"loss": 2.0})
        run_logger.log(2, {"loss": 1.0})
        run_logger.write_report()
        page = (run / "report.html").read_text()
        assert "running" in page.split("</header>")[0] and _series_points(page) == {"loss": [2]}
        start = read_run_info(run)["starts"][0]
        assert (start["status"], start["last_step"]) == ("running", 2) and start["peak_memory"]["rss_bytes"] > 1e6
        run_logger.write_report()
        assert len(written) == 1  # nothing new since: not written again
        run_logger.log_samples(2, "train", [{"prompt": "p", "reference": "r", "completion": "c", "reward": 1.0,
                                             "components": None, "correct": True, "error": None}])
        run_logger.write_report()
        assert len(written) == 2 and ">r</td>" in (run / "report.html").read_text()
        # A page that took long to write is not rewritten until ten times as long has passed...
        run_logger.log(3, {"loss": 0.5})
        clock = iter([100.0, 100.0, 100.3])  # a rewrite from 100 s to 100.3 s: the next is due at 103 s
        monkeypatch.setattr(posttrain.logging, "_clock", lambda: next(clock))
        run_logger.write_report()
        assert len(written) == 3
        run_logger.log(4, {"loss": 0.4})
        monkeypatch.setattr(posttrain.logging, "_clock", lambda: 102.9)
        run_logger.write_report()
        assert len(written) == 3
        monkeypatch.setattr(posttrain.logging, "_clock", lambda: 103.1)
        run_logger.write_report()
        assert len(written) == 4 and _series_points((run / "report.html").read_text()) == {"loss": [4]}
        run_logger.log(5, {"loss": 0.3})
        monkeypatch.setattr(posttrain.logging, "_clock", lambda: 103.2)
    # ...but the last page is always written.
    assert len(written) == 5 and read_run_info(run)["starts"][0]["status"] == "finished"


def test_evaluations_and_checkpoints_rewrite_the_report(tmp_path: Path) -> None:
    from posttrain.algorithms.common import log_step
    from posttrain.config.schema import TrainerConfig

    class Recorder:
        def __init__(self):
            self.calls = []

        def log(self, step, metrics):
            self.calls.append(("log", step))

        def advance(self, step, metrics):
            pass

        def write_report(self):
            self.calls.append(("report", self.calls[-1][1]))

    recorder, trainer = Recorder(), TrainerConfig(max_steps=10, log_every=5)
    for step in range(1, 11):
        log_step(recorder, step, {"loss": 1.0} | ({"eval/add/accuracy": 0.5} if step in (3, 10) else {}), trainer)
    # After the evaluation at step 3; the last step's report is written as the run ends.
    assert recorder.calls == [("log", 3), ("report", 3), ("log", 5), ("log", 10)]


def test_a_short_sft_run_leaves_its_report(tmp_path: Path, tiny_model_dir, monkeypatch) -> None:
    from posttrain.algorithms.sft import train_sft
    from posttrain.config import SFTConfig, load_config

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(40)))
    out = tmp_path / "sft_run"
    cfg = load_config(SFTConfig, None, [f"model.name_or_path={tiny_model_dir}", f"data.train_files=[{data}]",
                                        f"output_dir={out}", "trainer.max_steps=3", "trainer.micro_batch_size=8",
                                        "trainer.save_every=1", "logging.progress=none", "logging.plot=false",
                                        "data.max_length=32"])
    import posttrain.logging

    real, seen = posttrain.logging.write_report, []

    def write_and_look(run_dirs, output):  # what the page says each time the run writes it
        path = real(run_dirs, output)
        start = read_run_info(out)["starts"][-1]
        seen.append((start["status"], start["last_step"], sorted(p.name for p in (out / "checkpoints").iterdir())))
        return path

    monkeypatch.setattr(posttrain.logging, "write_report", write_and_look)
    train_sft(cfg)
    # Written after the checkpoints of steps 1 and 2 (each already on disk), and as the run ended.
    assert seen == [("running", 1, ["step_1"]), ("running", 2, ["step_1", "step_2"]),
                    ("finished", 3, ["step_2", "step_3"])]  # (trainer.keep_last=2)

    page = (out / "report.html").read_text()
    assert EXTERNAL.search(page) is None
    assert "<title>sft_run — posttrain sft report</title>" in page
    assert "40 rows read: 40 examples" in page and "0 skipped as malformed" in page  # the data summary
    assert "training 1.08M parameters on cpu, 8 examples per step" in page
    assert _series_points(page)["loss"] == [3]
    assert f"output_dir: {out}" in page
    info = read_run_info(out)
    assert info["recipe"] == "sft" and info["starts"][0]["resumed_from_step"] is None


# ---- rendered by a browser -------------------------------------------------------------------------------


def _chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                 if (path := shutil.which(name))), None)


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="needs headless Chromium: `apt-get install -y chromium` (Debian; "
                    "`bash scripts/test.sh --slow` installs it when run as root)")
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    samples = [_sample(step, f"completion number {step}", reward=float(step % 2)) for step in range(1, 61)]
    samples[0]["completion"] = HOSTILE
    run = _write_run(tmp_path / "rendered_run", SHORT, samples)
    write_run_info(run, "grpo", "60 prompts", "training", None)
    path = write_report([run], run / "report.html")
    browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--virtual-time-budget=5000", "--user-data-dir=" + str(tmp_path / "profile")]

    dom = subprocess.run([*browser, "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "<title>rendered_run — posttrain grpo report</title>" in dom
    # The charts' script ran: uPlot drew a canvas with its legend in every chart's box.
    assert len(re.findall(r'<div class="plot"><div class="uplot', dom)) == len(_figures(path.read_text())) == 3
    assert dom.count("<canvas") == 3 and "loss (raw)" not in dom  # 3 points: too few to smooth
    # The script ran: it rewrote the table (the page as written says "60 samples") and filled the filters.
    assert "60 of 60 samples · page 1 of 3" in dom
    assert re.search(r'<select id="f-step">.*<option value="60">60</option>', dom, re.DOTALL)
    body = dom.split('<tbody id="samples-body">')[1].split("</tbody>")[0]
    assert body.count("<tr>") == 20 and "completion number 20" in body and "<td class=\"text\">21</td>" in body
    assert "&lt;/script&gt;&lt;script&gt;alert" in body and "<img" not in dom  # shown as text, not run

    screenshot = tmp_path / "report.png"
    subprocess.run([*browser, "--window-size=1200,1600", f"--screenshot={screenshot}", path.as_uri()],
                   capture_output=True, timeout=120, check=True)
    from PIL import Image

    with Image.open(screenshot) as image:
        assert image.size == (1200, 1600)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # text, axes and coloured curves, not a blank page


def _noisy_run(run_dir: Path) -> tuple[Path, list[float]]:
    """120 steps of a noisy loss (a band until smoothed), 2 s and 100 tokens a step, an evaluation every 40."""
    loss = [1.0 + 0.5 * math.sin(step * 2.3) + 1.0 / step for step in range(1, 121)]
    records = [{"step": step, "loss": loss[step - 1], "grad_norm": 1 + (step % 7) / 7, "time/step": 2.0,
                "learning_rate": 1.06e-4 - 1e-7 * step,
                "tokens_per_second": 50.0} | ({"eval/add/accuracy": step / 200} if step % 40 == 0 else {})
               for step in range(1, 121)]
    run = _write_run(run_dir, records)
    write_run_info(run, "grpo", "60 prompts", "training", None)
    return write_report([run], run / "report.html"), loss


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="needs headless Chromium: `apt-get install -y chromium` (Debian; "
                    "`bash scripts/test.sh --slow` installs it when run as root)")
def test_the_charts_respond_in_headless_chromium(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="drives the browser: pip install -e '.[browser]'")
    path, loss = _noisy_run(tmp_path / "run")

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 1400})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(path.as_uri())
        page.wait_for_function("window.posttrainReport && window.posttrainReport.plots.every((p) => p)")
        plots = "window.posttrainReport.plots"
        figure = page.locator('figure[data-chart="0"]')
        assert figure.locator(".title").inner_text() == "loss"

        # Hover: the legend shows the step under the pointer and each line's value there.
        box = figure.locator(".u-over").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        legend = dict(zip(figure.locator(".u-legend .u-series th").all_inner_texts(),
                          figure.locator(".u-legend .u-series .u-value").all_inner_texts()))
        step = int(legend["step"].replace(",", ""))
        assert 40 < step < 80
        assert float(legend["loss (raw)"]) == pytest.approx(loss[step - 1], rel=1e-5)
        assert float(legend["loss"]) != pytest.approx(loss[step - 1], rel=1e-3)  # smoothed (0.6 to start)

        # Smoothing: the control changes the curve drawn, to TensorBoard's debiased moving average.
        pixels = figure.locator("canvas").evaluate("(canvas) => canvas.toDataURL()")
        assert page.evaluate(f"{plots}[0].series.map((s) => s.label)") == ["step", "loss (raw)", "loss"]
        page.eval_on_selector("#c-smoothing", "(e) => { e.value = '0.9'; e.dispatchEvent(new Event('input')); }")
        smoothed = page.evaluate(f"{plots}[0].data[2]")
        expected, last = [], 0.0
        for n, value in enumerate(loss, start=1):
            last = 0.9 * last + 0.1 * value
            expected.append(last / (1 - 0.9 ** n))
        assert smoothed == pytest.approx(expected, rel=1e-5)
        assert figure.locator("canvas").evaluate("(canvas) => canvas.toDataURL()") != pixels
        page.eval_on_selector("#c-smoothing", "(e) => { e.value = '0'; e.dispatchEvent(new Event('input')); }")
        assert page.evaluate(f"{plots}[0].data.length") == 2  # unsmoothed: the raw line alone
        assert page.evaluate(f"{plots}[0].data[1]") == pytest.approx(loss, rel=1e-6)

        # No tick label is cut: each y axis is at least as wide as its longest label (1.0e-4-like ones included).
        widths = page.evaluate(f"""{plots}.map((u) => {{
            const axis = u.axes[1]; u.ctx.font = axis.font[0];
            const text = Math.max(...axis._values.map((v) => u.ctx.measureText(v).width)) / devicePixelRatio;
            return [text, axis._size]; }})""")
        assert all(0 < text < size for text, size in widths), widths

        # Log scale, per chart.
        figure.locator(".c-log").check()
        assert page.evaluate(f"[{plots}[0].scales.y.distr, {plots}[1].scales.y.distr]") == [3, 1]

        # The x axis by training time and by tokens (2 s and 100 tokens a step).
        page.select_option("#c-x", "time")
        assert page.evaluate(f"{plots}[0].data[0].slice(0, 3)") == [2, 4, 6]
        assert page.evaluate(f"{plots}[0].axes[0].label") == "training time"
        page.select_option("#c-x", "tokens")
        assert page.evaluate(f"{plots}[0].data[0].slice(0, 3)") == [100, 200, 300]
        page.select_option("#c-x", "step")

        # Zoom: dragging across one chart sets the same x range on every chart; a double-click shows it all.
        box = figure.locator(".u-over").bounding_box()
        y = box["y"] + box["height"] / 2
        page.mouse.move(box["x"] + box["width"] * 0.25, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.5, y, steps=5)
        page.mouse.up()
        ranges = page.evaluate(f"{plots}.map((p) => [p.scales.x.min, p.scales.x.max])")
        low, high = ranges[0]
        assert 20 < low < 40 < high < 70 and all(r == pytest.approx([low, high]) for r in ranges)
        assert "step" in page.locator("#c-range").inner_text()
        figure.locator(".u-over").dblclick()
        assert page.evaluate(f"[{plots}[0].scales.x.min, {plots}[0].scales.x.max]") == [1, 120]
        assert errors == []
        browser.close()
