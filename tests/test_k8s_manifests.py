"""The Kubernetes manifests under deploy/k8s/: the RayJob is valid against KubeRay's ray.io/v1 schema (and has no
field the API server would silently drop), the disruption budgets select the pods the RayJob labels, and the
entrypoint is a posttrain command whose config loads."""

from __future__ import annotations

import gzip
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from posttrain.cli import RECIPES
from posttrain.config.loader import load_config

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "k8s"
SCHEMA = Path(__file__).parent / "data" / "k8s" / "rayjob-v1.schema.json.gz"


def _documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]


def _rayjob() -> dict:
    (job,) = _documents("rayjob-grpo.yaml")
    return job


def _schema() -> dict:
    return json.loads(gzip.decompress(SCHEMA.read_bytes()))


def pruned_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields of `value` that the schema does not declare: a structural CRD schema makes the API server drop them
    without an error (a misspelled key is silently ignored), so they are reported here."""
    found = []
    if isinstance(value, dict) and schema.get("type") == "object":
        declared = schema.get("properties")
        if declared is None:  # a map (additionalProperties) or free-form object: any key is kept
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                for key, item in value.items():
                    found += pruned_fields(item, extra, f"{path}.{key}")
            return found
        for key, item in value.items():
            if key not in declared:
                found.append(f"{path}.{key}".lstrip("."))
            else:
                found += pruned_fields(item, declared[key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += pruned_fields(item, schema["items"], f"{path}[{index}]")
    return found


def _check(job: dict) -> list[str]:
    schema = _schema()
    errors = [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
              for error in jsonschema.Draft7Validator(schema).iter_errors(job)]
    return errors + [f"{field}: not in the RayJob schema (dropped by the API server)"
                     for field in pruned_fields(job, schema)]


def test_the_rayjob_is_valid_against_kuberays_schema_with_no_dropped_field():
    job = _rayjob()
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert _check(job) == []


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda job: job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas="two"),
     "rayClusterSpec.workerGroupSpecs.0.replicas: 'two' is not of type 'integer'"),
    (lambda job: job["spec"].update(entryPoint=job["spec"].pop("entrypoint")),
     "spec.entryPoint: not in the RayJob schema"),
    (lambda job: job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
        volumeMount=[]), "containers[0].volumeMount: not in the RayJob schema"),
    (lambda job: job["spec"]["rayClusterSpec"]["headGroupSpec"].pop("template"), "'template' is a required property"),
])
def test_the_check_catches_a_wrong_type_a_misspelled_field_and_a_missing_one(edit, expected):
    job = _rayjob()
    edit(job)
    assert any(expected in error for error in _check(job)), _check(job)


def test_the_disruption_budgets_select_the_head_and_the_workers_and_the_volume_is_the_claim():
    job = _rayjob()
    cluster = job["spec"]["rayClusterSpec"]
    head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    worker_labels = [group["template"]["metadata"]["labels"] for group in cluster["workerGroupSpecs"]]
    budgets = {doc["metadata"]["name"]: doc for doc in _documents("pdb.yaml")}
    assert all(doc["apiVersion"] == "policy/v1" and doc["kind"] == "PodDisruptionBudget" for doc in budgets.values())

    def selects(budget: dict, labels: dict) -> bool:
        return budget["spec"]["selector"]["matchLabels"].items() <= labels.items()

    head, workers = budgets["posttrain-grpo-head"], budgets["posttrain-grpo-workers"]
    assert selects(head, head_labels) and not any(selects(head, labels) for labels in worker_labels)
    assert head["spec"]["maxUnavailable"] == 0
    assert all(selects(workers, labels) for labels in worker_labels) and not selects(workers, head_labels)
    (claim,) = _documents("pvc.yaml")
    assert claim["kind"] == "PersistentVolumeClaim"
    volumes = cluster["headGroupSpec"]["template"]["spec"]["volumes"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in volumes
    mounts = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "runs", "mountPath": "/runs"} in mounts


def test_the_entrypoint_is_a_posttrain_command_whose_config_loads_with_its_run_directory_on_the_volume():
    words = shlex.split(_rayjob()["spec"]["entrypoint"])
    assert words[:2] == ["posttrain", "grpo"] and words[2] == "--config"
    config = ROOT / words[3].removeprefix("/opt/posttrain/")  # the image holds the repository at /opt/posttrain
    recipe = RECIPES["grpo"]
    cfg = load_config(recipe.schema, str(config), words[4:], base=recipe.base())
    assert cfg.cluster.backend == "ray" and cfg.cluster.address == "auto"
    assert cfg.output_dir.startswith("/runs/")
