"""LoRA adapters through peft: wrap a model for training, reload adapters to resume, export adapter and merged model.

With `lora.enabled` a recipe trains only the adapter weights (and, for a reward model, the freshly initialised
score head, which peft keeps as a trainable copy); every base weight stays frozen. Checkpoints then hold the
adapter alone (adapter_config.json + adapter_model.safetensors, a few MB), and the end of the run writes both
OUTPUT/adapter/ (the adapter, loadable with peft onto the base model) and OUTPUT/final/ (the adapter merged into
the base: a plain Hugging Face model directory, as without LoRA).

The frozen base is also the reference model DPO needs: `adapters_disabled(model)` runs the same module with the
adapters switched off, so no second copy of the weights is kept in memory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from safetensors.torch import save_file

from posttrain.config.schema import LoraSection
from posttrain.rundir import check_export_dir, write_manifest

if TYPE_CHECKING:  # annotations only: importing peft takes a moment
    from transformers import PreTrainedModel

ADAPTER_DIR = "adapter"
TaskKind = Literal["causal_lm", "reward"]
_PEFT_TASK = {"causal_lm": "CAUSAL_LM", "reward": "SEQ_CLS"}


def is_lora_model(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def add_lora(model: PreTrainedModel, cfg: LoraSection, task: TaskKind) -> torch.nn.Module:
    """`model` wrapped with fresh LoRA adapters (B = 0, so the wrapped model computes exactly what `model` did);
    only adapter parameters (and a reward model's score head) require gradients."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type=_PEFT_TASK[task],
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # e.g. target_modules that match nothing in this architecture
        raise ValueError(f"lora.target_modules={cfg.target_modules!r}: {error}") from None


def load_lora(model: PreTrainedModel, adapter_dir: str | Path) -> torch.nn.Module:
    """`model` with the trainable adapter saved in `adapter_dir` (a checkpoint), to resume training."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)


def prepare_for_gradient_checkpointing(model: PreTrainedModel) -> None:
    """With a frozen embedding layer, checkpointed blocks would see inputs that need no gradient and the adapters
    inside them would get none; make the embedding output require gradients."""
    model.enable_input_require_grads()


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as its frozen base model (adapters off; modules_to_save copies bypassed) inside the block."""
    with model.disable_adapter():
        yield


def save_adapter(model: torch.nn.Module, directory: str | Path, tokenizer=None) -> Path:
    """Write the adapter alone (peft's format), and the tokenizer if given, to `directory`, replacing it whole:
    the files go to a hidden folder beside it that is renamed into place when complete. A `directory` holding
    files no export wrote is refused, not replaced."""
    target = Path(directory)
    check_export_dir(target)
    staging = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    write_manifest(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(staging, target)
    return target


def merged_model(model: torch.nn.Module) -> PreTrainedModel:
    """The base model with the adapters folded into its weights (in place: `model` is consumed)."""
    return model.merge_and_unload()


ADAPTER_TENSOR = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                            r"(?:\.[^.]+)?\.(?P<leaf>weight)$")
"""An adapter tensor's name: the adapted module, which matrix, an optional adapter name (a peft module's state dict
says `lora_A.default.weight`; peft's saved adapters drop it), the parameter."""


def adapter_file_name(name: str) -> str:
    """An adapter tensor's name as peft saves it (`...q_proj.lora_A.weight`): without the adapter's own name, which a
    sharded policy's full state dict keeps (`...q_proj.lora_A.default.weight`). ValueError for a name that is no
    adapter tensor (a weight adapters-only sync cannot carry)."""
    match = ADAPTER_TENSOR.match(name)
    if match is None:
        raise ValueError(f"{name} is not a LoRA adapter tensor (lora_A / lora_B): adapters-only sync carries the "
                         "adapters alone; a LoRA policy that trains other weights needs weight_sync.lora=merged")
    return f"{match['module']}.{match['kind']}.{match['leaf']}"


def write_adapter(tensors: dict[str, torch.Tensor], cfg: LoraSection, base_model: str, directory: str | Path) -> Path:
    """Write `tensors` (adapter tensors by name, either naming of `adapter_file_name`) as a peft adapter directory
    (adapter_model.safetensors + adapter_config.json) that peft and vLLM's LoRA requests load onto `base_model`. The
    config's target modules are the modules the tensors adapt (what peft resolved `all-linear` to), its rank and
    scaling those of `cfg`."""
    from peft import LoraConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    named = {adapter_file_name(name): tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    modules = sorted({ADAPTER_TENSOR.match(name)["module"].rsplit(".", 1)[-1] for name in named})
    LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, target_modules=modules, task_type="CAUSAL_LM",
               base_model_name_or_path=base_model).save_pretrained(str(directory))
    save_file(named, str(directory / "adapter_model.safetensors"))
    return directory
