"""Model cards and Hugging Face Hub uploads of a run's exports.

Every export (OUTPUT/final/, and OUTPUT/adapter/ with LoRA) gets a README.md: the Hub's YAML metadata header
(library_name, base_model, tags, datasets, pipeline_tag), then what was trained from what, on which data, with which
settings, the run's last logged and evaluation metrics (from OUTPUT/metrics.jsonl) and how to load it. It is
written from the files of the run directory alone (config.yaml, metrics.jsonl, run_info.json), so `posttrain push`
can write it again for a run of any age, with the repository id in its loading example.

`push_export` uploads one export with huggingface_hub (create_repo, then upload_folder: one commit). The token is
huggingface_hub's own (HF_TOKEN or `hf auth login`); it is sent to the endpoint (HF_ENDPOINT, read when the push
starts) and written nowhere.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import httpx2
import yaml
from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from posttrain.version import __version__ as posttrain_version
from posttrain.config.schema import HubSection
from posttrain.errors import RunError
from posttrain.logging.metrics import read_metrics
from posttrain.logging.report import read_run_info
from posttrain.rundir import MANIFEST, add_to_manifest

CARD_FILENAME = "README.md"
EXPORT_FOLDERS = ("final", "adapter")
REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")

HYPERPARAMETERS = (
    "trainer.max_steps", "trainer.num_epochs", "trainer.learning_rate", "trainer.lr_scheduler", "trainer.warmup_steps",
    "trainer.micro_batch_size", "trainer.gradient_accumulation_steps", "trainer.weight_decay",
    "trainer.max_grad_norm", "trainer.precision", "data.max_length", "data.packing", "data.completion_only_loss",
    "seed", "lora.r", "lora.alpha", "lora.target_modules", "loss.type", "loss.beta", "mode", "kd_loss_mode",
    "advantage.estimator", "rollout.prompts_per_step", "rollout.num_generations_per_prompt",
    "rollout.max_new_tokens", "rollout.temperature", "environment.kind", "update.ppo_epochs",
    "update.num_minibatches", "critic.learning_rate", "gae.kl_coef",
)
"""The config keys a card lists (those the run's config has; lora.* only when LoRA was on)."""

FINAL_METRICS = ("loss", "reward/mean", "reward_accuracy", "accuracy", "kl", "entropy", "response_length/mean")
"""Training metrics a card quotes from the last logged step, where the recipe logs them."""

EVALUATION_PREFIXES = ("eval_", "eval/", "val/")


def write_model_card(run_dir: str | os.PathLike[str], export_dir: str | os.PathLike[str],
                     repo_id: str | None = None) -> Path:
    """Write EXPORT_DIR/README.md from the run directory's config.yaml, metrics.jsonl and run_info.json, and list
    it in the export's manifest; return its path. `repo_id` goes into the loading example (else the folder's
    path)."""
    run_dir, export_dir = Path(run_dir), Path(export_dir)
    path = export_dir / CARD_FILENAME
    path.write_text(model_card(run_dir, export_dir, repo_id), encoding="utf-8")
    if (export_dir / MANIFEST).is_file():
        add_to_manifest(export_dir, [CARD_FILENAME])
    return path


def model_card(run_dir: Path, export_dir: Path, repo_id: str | None = None) -> str:
    """The text of the model card of `export_dir` (run_dir/final or run_dir/adapter)."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise RunError(f"{config_file} does not exist: {run_dir} is not a posttrain run directory")
    config = yaml.safe_load(config_file.read_text()) or {}
    info = read_run_info(run_dir) or {}
    recipe = info.get("recipe", "posttrain")
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    is_adapter = (export_dir / "adapter_config.json").is_file()
    base = str(_get(config, "model.name_or_path") or "")
    hub_base = _hub_id(base)
    datasets = [name for name in (_hub_id(f.split(":")[0]) for f in _get(config, "data.train_files") or []) if name]
    loader = _auto_class(export_dir)

    metadata: dict[str, Any] = {"library_name": "peft" if is_adapter else "transformers"}
    if hub_base:
        metadata["base_model"] = hub_base
    metadata["tags"] = ["posttrain", recipe] + (["lora"] if is_adapter or _get(config, "lora.enabled") else [])
    if datasets:
        metadata["datasets"] = datasets
    metadata["pipeline_tag"] = "text-classification" if loader.endswith("SequenceClassification") else "text-generation"

    where = repo_id or str(export_dir)
    lines = ["---", yaml.safe_dump(metadata, sort_keys=False).rstrip(), "---", "",
             f"# {repo_id.split('/')[-1] if repo_id else run_dir.resolve().name}", ""]
    what = "LoRA adapter" if is_adapter else "Model"
    lines += [f"{what} trained with posttrain {posttrain_version}, "
              f"recipe `{recipe}`, from `{base}`" + (" (a model embedded in posttrain, built offline)"
                                                     if base.startswith("posttrain/") else "") + ".", ""]
    lines += ["## Data", ""]
    lines += [f"- training: {', '.join(f'`{f}`' for f in _get(config, 'data.train_files') or []) or 'none listed'}"]
    if _get(config, "data.eval_files"):
        lines += [f"- held out: {', '.join(f'`{f}`' for f in _get(config, 'data.eval_files'))}"]
    starts = info.get("starts") or []
    if starts and starts[-1].get("data"):
        lines += [f"- as read: {starts[-1]['data']}"]
    lines += ["", "## Settings", "", "| key | value |", "|---|---|"]
    for key in HYPERPARAMETERS:
        value = _get(config, key)
        if value is None or (key.startswith("lora.") and not _get(config, "lora.enabled")):
            continue
        lines.append(f"| `{key}` | `{json.dumps(value)}` |")
    lines += ["", f"The run's whole resolved config (`posttrain {recipe} --config config.yaml` trains it again):", "",
              "<details><summary>config.yaml</summary>", "", "```yaml",
              yaml.safe_dump(config, sort_keys=False).rstrip(), "```", "", "</details>", ""]
    lines += _metrics_section(records)
    lines += ["## Use", "", "```python"]
    if is_adapter:
        lines += ["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
                  f"model = AutoPeftModelForCausalLM.from_pretrained({where!r})  # loads the base model too",
                  f"tokenizer = AutoTokenizer.from_pretrained({where!r})"]
    else:
        lines += [f"from transformers import {loader}, AutoTokenizer", "",
                  f"model = {loader}.from_pretrained({where!r})",
                  f"tokenizer = AutoTokenizer.from_pretrained({where!r})"]
    lines += ["```", ""]
    if not is_adapter and loader == "AutoModelForCausalLM":
        lines += ["or from the command line:", "", "```bash",
                  f"posttrain generate --model {where} --prompt 'Hello'", "```", ""]
    return "\n".join(lines)


def _metrics_section(records: list[dict[str, Any]]) -> list[str]:
    """The last logged step's training metrics, and each evaluation metric's first and last value."""
    if not records:
        return []
    last = records[-1]
    lines = ["## Results", ""]
    shown = [(key, last[key]) for key in FINAL_METRICS if isinstance(last.get(key), (int, float))]
    if shown:
        lines += [f"At the last logged step ({last['step']}):", "", "| metric | value |", "|---|---|"]
        lines += [f"| `{key}` | {_number(value)} |" for key, value in shown]
        lines.append("")
    evaluated: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith(EVALUATION_PREFIXES) and isinstance(value, (int, float)) and not isinstance(value, bool):
                evaluated.setdefault(key, []).append((record["step"], value))
    if evaluated:
        lines += ["Evaluation (first and last evaluated step):", "", "| metric | first | last |", "|---|---|---|"]
        for key, points in sorted(evaluated.items()):
            (first_step, first), (last_step, latest) = points[0], points[-1]
            lines.append(f"| `{key}` | {_number(first)} (step {first_step}) | {_number(latest)} (step {last_step}) |")
        lines.append("")
    return lines


def push_export(run_dir: str | os.PathLike[str], repo_id: str, private: bool = False,
                folder: str = "final") -> str:
    """Upload RUN_DIR/final/ (or adapter/) to the Hub repository `repo_id` (created if absent, private if asked),
    its model card written again first; return the repository's URL. RunError, naming what to do, when there is
    no token, no such export, no network or the Hub refuses."""
    run_dir = Path(run_dir)
    if folder not in EXPORT_FOLDERS:
        raise RunError(f"folder={folder!r}: a run exports final/ (and adapter/ with LoRA), one of {EXPORT_FOLDERS}")
    if not REPO_ID.match(repo_id):
        raise RunError(f"repo id {repo_id!r}: expected NAME or NAMESPACE/NAME (letters, digits, '-', '_', '.')")
    export_dir = run_dir / folder
    if not export_dir.is_dir():
        why = ("a run writes adapter/ only with lora.enabled=true" if folder == "adapter"
               else "the run writes it when it finishes")
        raise RunError(f"{export_dir} does not exist ({why}); nothing to push")
    token = get_token()
    if token is None:
        raise RunError("no Hugging Face token: set HF_TOKEN to a write token (https://huggingface.co/settings/tokens) "
                       f"or run `hf auth login`, then `posttrain push {run_dir} --repo-id {repo_id}` again")
    write_model_card(run_dir, export_dir, repo_id)
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    api = HfApi(endpoint=endpoint, token=token)
    retry = f"then run `posttrain push {run_dir} --repo-id {repo_id}{' --private' if private else ''}` again"
    try:
        url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=export_dir, ignore_patterns=[MANIFEST, ".cache/*"],
                          commit_message=f"Upload {folder}/ of a posttrain run")
    except OfflineModeIsEnabled:
        raise RunError(f"HF_HUB_OFFLINE is set, so nothing may be uploaded to {endpoint}: unset it, {retry}") from None
    except httpx2.TransportError as error:
        raise RunError(f"could not reach {endpoint} ({error}): check the network connection (and HF_ENDPOINT), "
                       f"{retry}") from None
    except HfHubHTTPError as error:
        raise RunError(f"{endpoint} refused the upload to {repo_id}: {str(error).splitlines()[0]}; check that the "
                       f"token may write to {repo_id.split('/')[0] if '/' in repo_id else 'your namespace'}, "
                       f"{retry}") from None
    return str(url)


def check_push_possible(hub: HubSection) -> None:
    """With hub.push_at_end: RunError now, before training, when there is no token to push with at the end."""
    if hub.push_at_end and get_token() is None:
        raise RunError("hub.push_at_end=true and no Hugging Face token: set HF_TOKEN to a write token "
                       "(https://huggingface.co/settings/tokens) or run `hf auth login` before the run, or set "
                       "hub.push_at_end=false and push later with `posttrain push RUN_DIR --repo-id ID`")


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _hub_id(name: str) -> str | None:
    """`name` when it reads as a Hub repository id (NAMESPACE/NAME, not a local path, not an embedded model)."""
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", name) or name.startswith("posttrain/") or Path(name).exists():
        return None
    return name


def _auto_class(export_dir: Path) -> str:
    """The transformers Auto class that loads the export, from its config.json's architectures."""
    config_file = export_dir / "config.json"
    architectures = json.loads(config_file.read_text()).get("architectures") or [] if config_file.is_file() else []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return "AutoModelForSequenceClassification"
    return "AutoModelForCausalLM"


def _number(value: float) -> str:
    return str(value) if not math.isfinite(value) else f"{value:.4g}"
