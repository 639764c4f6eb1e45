"""Small inconsistencies that each cost a user an afternoon: R-DPO with α = 0 (plain DPO) refused at load; a LoRA
run's announcement gives trainable and total parameters and the fraction; `--help` documents the keys of
`evaluation:` sets; `generate` and `eval` send a prompt to the model the same way by default. (The embedded chat
model ending its turns at <|im_end|> is tests/test_tiny_model.py's.) And the headline numbers: README.md quotes
BENCHMARKS.md's table row for row, and every row points at a section of BENCHMARKS.md that holds its numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.common import announce_run
from posttrain.cli import main
from posttrain.config import ConfigError, DPOConfig, load_config
from posttrain.config.schema import GenerateConfig, LoraSection, ModelConfig, PromptSection
from posttrain.models.loading import load_trainable_model


def test_rdpo_with_alpha_zero_is_refused_naming_the_key():
    pairs = "data.train_files=['posttrain/arithmetic-preference[:8]']"
    with pytest.raises(ConfigError, match=r"loss.type='rdpo' with loss.rdpo_alpha=0 is plain DPO.*loss.rdpo_alpha"):
        load_config(DPOConfig, None, [pairs, "loss.type=rdpo"])
    assert load_config(DPOConfig, None, [pairs, "loss.type=rdpo", "loss.rdpo_alpha=0.01"]).loss.rdpo_alpha == 0.01


class Messages:
    """What announce_run needs of a RunLogger: its directory, its recipe, and the lines it prints."""

    def __init__(self, output_dir):
        self.output_dir, self.recipe, self.lines = output_dir, "sft", []

    def message(self, text: str) -> None:
        self.lines.append(text)


class CountingPolicy:
    """num_parameters and device of a policy worker over `model`, as LocalPolicyWorker counts them."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.device = model, torch.device("cpu")

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad or not trainable_only)


def test_a_lora_run_announces_trainable_and_total_parameters_and_the_fraction(tmp_path, tiny_model_dir):
    model = load_trainable_model(ModelConfig(name_or_path="posttrain/tiny"), LoraSection(enabled=True, r=4), None,
                                 torch.device("cpu"))
    policy = CountingPolicy(model)
    trainable, total = policy.num_parameters(trainable_only=True), policy.num_parameters()
    assert 0 < trainable < total
    log = Messages(tmp_path)
    announce_run(log, "8 rows", None, [], policy, "8 examples per step")
    line = next(text for text in log.lines if text.startswith("training "))
    assert (f"training {trainable / 1e6:.2f}M of {total / 1e6:.2f}M parameters ({trainable:,} of {total:,}: "
            f"{trainable / total:.2%}) on cpu") in line
    # A full fine-tune trains every parameter: one number, as before.
    model.requires_grad_(True)
    announce_run(log, "8 rows", None, [], policy, "8 examples per step")
    assert log.lines[-1].startswith(f"training {total / 1e6:.2f}M parameters on cpu")


@pytest.mark.parametrize("recipe", ["sft", "dpo", "grpo", "distill"])
def test_help_documents_the_keys_of_evaluation_sets(recipe, capsys):
    with pytest.raises(SystemExit):
        main([recipe, "--help"])
    out = capsys.readouterr().out
    for key in ("evaluation[].name  str = (required)", "evaluation[].data.files  list[str] = []",
                "evaluation[].every  int = 0", "evaluation[].num_samples  int = 1", "evaluation[].environment  "):
        assert f"  {key}" in out, key


def test_generate_and_eval_share_one_chat_template_default_and_say_which(capsys):
    assert GenerateConfig.model_fields["chat_template"].default is False
    assert PromptSection.model_fields["use_chat_template"].default is False  # eval's, as the RL recipes'
    for recipe in ("generate", "eval"):
        with pytest.raises(SystemExit):
            main([recipe, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--chat-template" in out and "default: the prompt text as it is" in out


ROOT = Path(__file__).resolve().parents[1]
HEADLINE_HEADER = "| what | posttrain | anchor | ratio | command | date, machine |"
HEADLINE_COLUMNS = [cell.strip() for cell in HEADLINE_HEADER.strip("|").split("|")]


def headline_table(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of each line of the headline table in `path`, header and separator included."""
    lines = path.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line == HEADLINE_HEADER]
    assert len(starts) == 1, f"{path.name}: {len(starts)} tables with the header {HEADLINE_HEADER!r}, expected 1"
    end = starts[0]
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return [(i + 1, lines[i]) for i in range(starts[0], end)]


def table_cells(line: str) -> list[str]:
    """The cells of one Markdown table row (no cell of the headline table holds a `|`)."""
    return [cell.strip() for cell in line.strip().removeprefix("|").removesuffix("|").split(" | ")]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, every character but letters, digits, `_`, `-` and spaces
    dropped, each space a hyphen (a repeated heading would get -1, -2: BENCHMARKS.md has none)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def benchmark_sections(path: Path) -> dict[str, str]:
    """Anchor -> the text of that heading's section: up to the next heading of the same or a higher level."""
    lines, headings, in_code = path.read_text(encoding="utf-8").splitlines(), [], False
    for i, line in enumerate(lines):
        in_code ^= line.startswith("```")
        match = None if in_code else re.match(r"(#+) (.+)", line)
        if match:
            headings.append((i, len(match[1]), github_anchor(match[2])))
    anchors = [anchor for _, _, anchor in headings]
    assert len(set(anchors)) == len(anchors), f"{path.name}: repeated headings {sorted(anchors)}"
    sections = {}
    for k, (start, level, anchor) in enumerate(headings):
        end = next((line for line, other, _ in headings[k + 1:] if other <= level), len(lines))
        sections[anchor] = "\n".join(lines[start:end])
    return sections


def test_readme_quotes_the_benchmarks_headline_table_row_for_row():
    benchmarks, readme = headline_table(ROOT / "BENCHMARKS.md"), headline_table(ROOT / "README.md")
    for (b_line, b_row), (r_line, r_row) in zip(benchmarks, readme):
        if r_row != b_row:
            cells = list(zip(HEADLINE_COLUMNS, table_cells(b_row), table_cells(r_row)))
            column, b_cell, r_cell = next((c for c in cells if c[1] != c[2]), ("(cell count)", b_row, r_row))
            pytest.fail(f"README.md:{r_line} differs from BENCHMARKS.md:{b_line} in column {column!r}: "
                        f"{r_cell!r} against {b_cell!r}")
    assert len(readme) == len(benchmarks), (f"README.md's headline table has {len(readme) - 2} rows, "
                                            f"BENCHMARKS.md's {len(benchmarks) - 2}")
    # BENCHMARKS.md opens with the table: its first section after the title is the headline numbers.
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert re.findall(r"^## .+", text, flags=re.M)[0] == "## Headline numbers"


def test_each_headline_row_links_to_the_section_that_holds_its_numbers_and_date():
    """Numbers are copied, not retyped: every number of a row's what, posttrain, anchor and ratio cells, and every
    date of its last cell, appears in the section its first cell links to, and the scripts it names exist."""
    sections = benchmark_sections(ROOT / "BENCHMARKS.md")
    rows = headline_table(ROOT / "BENCHMARKS.md")[2:]
    assert len(rows) >= 12
    for line_number, row in rows:
        where = f"BENCHMARKS.md:{line_number}"
        cells = table_cells(row)
        assert len(cells) == len(HEADLINE_COLUMNS), f"{where}: {len(cells)} cells, expected {len(HEADLINE_COLUMNS)}"
        what, command, machine = cells[0], cells[4], cells[5]
        link = re.fullmatch(r"\[.+\]\(BENCHMARKS\.md#([^)]+)\)", what)
        assert link, f"{where}: the what cell is not one link to a BENCHMARKS.md section: {what!r}"
        section = sections.get(link[1])
        assert section is not None, f"{where}: no heading of BENCHMARKS.md has the anchor #{link[1]}"
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", " ".join(cells[:4])):
            number = number.rstrip(",")
            assert re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", section), (
                f"{where}: {number} is not in the section #{link[1]}")
        dates = re.findall(r"\d{4}-\d{2}-\d{2}", machine)
        assert dates and "2 cores" in machine, f"{where}: the last cell names no date or no 2 cores: {machine!r}"
        for fact in dates + [cpu for cpu in ("AMD EPYC", "Intel Xeon", "AMX") if cpu in machine]:
            assert fact in section, f"{where}: {fact} is not in the section #{link[1]}"
        for script in re.findall(r"(?:benchmarks|scripts)/\w+\.(?:py|sh)", command):
            assert (ROOT / script).is_file(), f"{where}: {script} does not exist"
        for config in re.findall(r"configs/\w+\.yaml", what):
            assert (ROOT / config).is_file(), f"{where}: {config} does not exist"
