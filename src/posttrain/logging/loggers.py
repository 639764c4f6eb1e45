"""Optional experiment trackers: TensorBoard, Weights & Biases, MLflow.

Each backend's package is imported only when its ``logging.*`` flag is on, and a missing
package fails before any backend starts, with the pip command that fixes it. Every backend
has ``log(step, metrics)`` and ``close(failed=False)``.

Resume: a resumed run redoes the steps after its checkpoint.
- TensorBoard purges those steps (``purge_step``), so the curves have no overlap.
- W&B continues the same run (its id is kept in OUTPUT/wandb_run_id.txt). W&B ignores values
  logged at a step lower than the run's latest step, so the redone steps keep their first
  values there. Offline, each start writes its own OUTPUT/wandb/offline-run-* directory.
- MLflow continues the same run (OUTPUT/mlflow_run_id.txt); the redone steps get a second
  value in the metric history, in log order.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from posttrain.config.schema import LoggingConfig

LOGGERS_EXTRA_HINT = "pip install 'posttrain[loggers]'"

# MLflow rejects parameter values longer than this (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
# The full config is stored untruncated as the config.json artifact and in OUTPUT/config.yaml.
_MLFLOW_MAX_PARAM_LENGTH = 6000
_MLFLOW_MAX_PARAMS_PER_BATCH = 100


class ExperimentLogger(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def require_package(module: str, *, flag: str, pip_name: str) -> ModuleType:
    """Import ``module`` or fail naming the config flag that needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise  # the package is there but one of its own dependencies is not: show that
        raise ModuleNotFoundError(
            f"logging.{flag}=true needs the {pip_name} package: pip install {pip_name} (or {LOGGERS_EXTRA_HINT})"
        ) from error


class TensorBoardLogger:
    """Scalars into OUTPUT/tensorboard via torch's SummaryWriter."""

    def __init__(self, output_dir: Path, *, start_step: int = 0) -> None:
        require_package("tensorboard", flag="tensorboard", pip_name="tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = output_dir / "tensorboard"
        # On resume, purge_step makes TensorBoard discard the previous attempt's events from
        # the first redone step on, so the redone steps do not appear twice.
        purge_step = start_step + 1 if start_step > 0 else None
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=step)
        # Flush per record so a killed run's curves are complete up to its last logged step.
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        self._writer.close()


def _persisted_run_id(path: Path) -> str:
    """The id stored in ``path``, or a new one written there so a resumed run finds it."""
    if path.exists():
        return path.read_text(encoding="utf-8").strip()
    run_id = secrets.token_hex(8)
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


class WandbLogger:
    """A W&B run in OUTPUT/wandb, resumed across restarts through OUTPUT/wandb_run_id.txt."""

    def __init__(
        self,
        output_dir: Path,
        cfg: LoggingConfig,
        *,
        run_name: str,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        wandb = require_package("wandb", flag="wandb", pip_name="wandb")
        self.run_id = _persisted_run_id(output_dir / "wandb_run_id.txt")
        self._run = wandb.init(
            project=cfg.wandb_project,
            name=run_name,
            dir=str(output_dir),
            mode=cfg.wandb_mode,
            config=dict(run_config or {}),
            id=self.run_id,
            resume="allow",
            # A resumed run may change a key (say trainer.max_steps); update it rather than fail.
            allow_val_change=True,
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({key: float(value) for key, value in metrics.items()}, step=step)

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


def flatten_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{'trainer': {'learning_rate': 1e-4}} -> {'trainer.learning_rate': '0.0001'}: MLflow params are flat strings."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten_params(value, prefix=f"{name}.")
        else:
            text = str(value)
            flat[name] = text if len(text) <= _MLFLOW_MAX_PARAM_LENGTH else text[: _MLFLOW_MAX_PARAM_LENGTH - 3] + "..."
    return flat


class MlflowLogger:
    """An MLflow run (default store: file store in OUTPUT/mlruns), resumed through OUTPUT/mlflow_run_id.txt.

    The experiment is MLflow's own ``MLFLOW_EXPERIMENT_NAME`` when set, else "posttrain".
    """

    def __init__(
        self,
        output_dir: Path,
        cfg: LoggingConfig,
        *,
        run_name: str,
        recipe: str,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        require_package("mlflow", flag="mlflow", pip_name="mlflow-skinny")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric_type = Metric
        if cfg.mlflow_tracking_uri is not None:
            self.tracking_uri = cfg.mlflow_tracking_uri
        else:
            self.tracking_uri = (output_dir / "mlruns").resolve().as_uri()
            # MLflow >= 3.x refuses file stores unless MLFLOW_ALLOW_FILE_STORE is set; its
            # replacement (sqlite) needs sqlalchemy, which mlflow-skinny lacks. A file store in
            # the run directory needs no server and no extra package, so opt in, unless the user
            # has set the variable either way.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        run_id_path = output_dir / "mlflow_run_id.txt"
        if run_id_path.exists():
            self.run_id = run_id_path.read_text(encoding="utf-8").strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "posttrain")
            experiment = self.client.get_experiment_by_name(experiment_name)
            experiment_id = (
                experiment.experiment_id if experiment is not None else self.client.create_experiment(experiment_name)
            )
            run = self.client.create_run(experiment_id, run_name=run_name, tags={"posttrain.recipe": recipe})
            self.run_id = run.info.run_id
            run_id_path.write_text(self.run_id + "\n", encoding="utf-8")
        if run_config:
            # MLflow params are immutable: on resume log only keys the run does not have yet.
            existing = self.client.get_run(self.run_id).data.params
            params = [Param(key, value) for key, value in flatten_params(run_config).items() if key not in existing]
            for start in range(0, len(params), _MLFLOW_MAX_PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=params[start : start + _MLFLOW_MAX_PARAMS_PER_BATCH])
            self.client.log_dict(self.run_id, dict(run_config), "config.json")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        timestamp = int(time.time() * 1000)
        batch = [self._metric_type(key, float(value), timestamp, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def create_experiment_loggers(
    output_dir: Path,
    cfg: LoggingConfig,
    *,
    run_name: str,
    recipe: str,
    start_step: int = 0,
    run_config: Mapping[str, Any] | None = None,
) -> list[ExperimentLogger]:
    """The enabled backends, in the order TensorBoard, W&B, MLflow."""
    # Check every enabled package before starting any backend, so a missing one does not leave
    # a W&B run or an MLflow run half-started.
    if cfg.tensorboard:
        require_package("tensorboard", flag="tensorboard", pip_name="tensorboard")
    if cfg.wandb:
        require_package("wandb", flag="wandb", pip_name="wandb")
    if cfg.mlflow:
        require_package("mlflow", flag="mlflow", pip_name="mlflow-skinny")

    loggers: list[ExperimentLogger] = []
    # If a later backend fails to start, close (as failed) the ones already started.
    with contextlib.ExitStack() as started:
        if cfg.tensorboard:
            loggers.append(TensorBoardLogger(output_dir, start_step=start_step))
            started.callback(loggers[-1].close, failed=True)
        if cfg.wandb:
            loggers.append(WandbLogger(output_dir, cfg, run_name=run_name, run_config=run_config))
            started.callback(loggers[-1].close, failed=True)
        if cfg.mlflow:
            loggers.append(MlflowLogger(output_dir, cfg, run_name=run_name, recipe=recipe, run_config=run_config))
        started.pop_all()
    return loggers
