"""Ray generation actors on GPUs and vLLM generation actors, as far as a CPU machine checks them: where an actor
samples (from the GPUs Ray granted it), the weight-sync group's backend (NCCL only between distinct GPUs), the plan a
vLLM actor computes from the model's config, the refusals at load and at actor start, and the vLLM actor's plumbing
(weight pushes by the object store and by broadcast, versions, log-probabilities) with a stand-in for the engine.
The GPU runs themselves are HV-13 (scripts/hardware/hv13_ray_generation_gpu.py). Ray tests are skipped without ray."""

from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.config.schema import GRPOConfig

from rl_configs import DIGITS, TINY_RL
from ray_for_tests import assert_same_steps, needs_ray

RAY = ["cluster.backend=ray", "cluster.timeout_s=600"]
VLLM = [*RAY, "rollout.backend=vllm", "cluster.gpus_per_generation_worker=1"]


def config(output_dir: Path, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, [*TINY_RL, *DIGITS, f"output_dir={output_dir}", *overrides])


# ---- where an actor samples, and which backend a weight-sync group uses -----------------------------------------


def test_a_generation_actor_samples_on_the_first_gpu_it_was_granted_and_on_the_cpu_without_one():
    from posttrain.distributed.ray_groups import sampling_device

    assert sampling_device([], 0) == torch.device("cpu")
    assert sampling_device([], 2) == torch.device("cpu")  # GPUs visible but none granted: Ray's accounting wins
    assert sampling_device([3], 1) == torch.device("cuda", 0)  # Ray shows the actor only its own GPU, as cuda:0
    problem = sampling_device(["3"], 0)
    assert isinstance(problem, str)
    assert "GPU 3" in problem and "sees no CUDA device" in problem and "cluster.gpus_per_generation_worker=0" in problem


def test_a_vllm_actor_names_what_it_lacks_vllm_first_then_a_gpu():
    from posttrain.distributed.ray_groups import vllm_import_problem, vllm_worker_problem

    missing = "the vllm package is not installed"
    assert vllm_worker_problem([0], 1, missing) == missing
    assert "Ray granted this actor none" in vllm_worker_problem([], 1, None)
    assert "sees no CUDA device" in vllm_worker_problem([0], 0, None)
    assert vllm_worker_problem([0], 1, None) is None
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert "pip install 'posttrain[vllm]'" in vllm_import_problem()
    else:
        assert vllm_import_problem() is None


def test_the_weight_sync_group_goes_over_nccl_only_between_distinct_gpus():
    from posttrain.distributed.weight_broadcast import backend_offer, choose_backend

    assert backend_offer(None) == backend_offer(torch.device("cpu")) == "gloo"
    assert choose_backend({"holder": "nccl:GPU-a", "actor 0": "nccl:GPU-b", "actor 1": "nccl:GPU-c"}) == ("nccl", None)
    backend, why = choose_backend({"holder": "nccl:GPU-a", "actor 0": "nccl:GPU-b", "actor 1": "nccl:GPU-a"})
    assert backend == "gloo" and "actor 1 and holder share one GPU (GPU-a)" in why
    backend, why = choose_backend({"holder": "nccl:GPU-a", "actor 0": "gloo"})
    assert backend == "gloo" and "actor 0 has no CUDA device" in why
    assert choose_backend({"holder": "gloo", "actor 0": "gloo"}) == ("gloo", None)


def test_the_weight_specs_read_from_a_models_config_are_those_of_the_loaded_model(tiny_model_dir):
    """A vLLM actor plans broadcasts and checks pushes from these: they must be the loaded model's state dict."""
    from posttrain.config.schema import ModelConfig
    from posttrain.distributed.weight_broadcast import weight_specs
    from posttrain.models.loading import load_causal_lm, weight_specs_of

    for dtype in ("float32", "bfloat16"):
        model = ModelConfig(name_or_path="posttrain/tiny", dtype=dtype)
        loaded = weight_specs(load_causal_lm(model).state_dict().items())
        assert weight_specs_of(model) == loaded
        assert {d for _, d, _ in loaded} == {dtype}


# ---- config and check refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ([*RAY, "rollout.backend=vllm"], "needs cluster.gpus_per_generation_worker > 0"),
    ([*VLLM, "cluster.colocated=true"], "colocated generation samples with the transformers backend"),
    ([*VLLM, "rollout.asynchronous=true", "loss.importance_correction=tis", "rollout.in_flight_updates=true"],
     "in_flight_updates=true with rollout.backend=vllm"),
])
def test_vllm_generation_actor_settings_that_cannot_work_fail_at_load(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, *overrides)


def test_vllm_generation_actors_load_and_check_weight_sync_says_there_is_no_copy_to_compare(tmp_path):
    from posttrain.algorithms.weight_check import check_weight_sync
    from posttrain.errors import RunError

    cfg = config(tmp_path, *VLLM, "cluster.generation_workers=2", "rollout.seed_per_group=true",
                 "weight_sync.method=broadcast")
    assert cfg.rollout.backend == "vllm" and cfg.cluster.gpus_per_generation_worker == 1
    with pytest.raises(RunError, match="no copy to compare tensor by tensor"):
        check_weight_sync(cfg)


# ---- Ray: refusals at actor start, and the vLLM actor's plumbing with a stand-in engine -------------------------


@pytest.fixture
def ray_with_one_pretend_gpu(tmp_path):
    """A local Ray instance that offers one GPU this CPU machine does not have: Ray grants it (CUDA_VISIBLE_DEVICES
    in the actor) and torch there sees none. The runs join it as they join any initialised instance."""
    import shutil
    import tempfile

    import ray

    temp_dir = tempfile.mkdtemp(prefix="posttrain-ray-")  # tmp_path is too long for Ray's socket paths
    ray.init(num_cpus=3, num_gpus=1, _temp_dir=temp_dir, include_dashboard=False)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@needs_ray
@pytest.mark.parametrize("backend, message", [
    ("transformers", "Ray granted it GPU 0 (cluster.gpus_per_generation_worker), but torch in its process sees no "
                     "CUDA device"),
    ("vllm", "needs the vllm package, which is not installed"),
])
def test_a_generation_actor_that_cannot_use_its_gpu_or_vllm_stops_the_run_at_start_naming_it(
        tmp_path, tiny_model_dir, ray_with_one_pretend_gpu, backend, message):
    from posttrain.config.schema import ClusterSection, ModelConfig, WeightSyncSection
    from posttrain.distributed.ray_groups import RayCluster
    from posttrain.errors import RunError
    from posttrain.models.loading import load_tokenizer

    try:
        import vllm  # noqa: F401
        if backend == "vllm":
            pytest.skip("vllm is installed here: the refusal is for a node without it")
    except ImportError:
        pass
    section = ClusterSection(backend="ray", timeout_s=120, gpus_per_generation_worker=1, max_restarts=0)
    cluster = RayCluster(section, WeightSyncSection(), tmp_path)
    model = ModelConfig(name_or_path=str(tiny_model_dir))
    try:
        with pytest.raises(RunError, match=r"generation worker 0 of 1 could not start: .*" + message.replace("(", r"\(")
                           .replace(")", r"\)")):
            cluster.generator(model, load_tokenizer(model), batch_size=8, seed=0, backend=backend)
    finally:
        cluster.close()


def stand_in_vllm_actor():
    """`VLLMGenerationWorker` with its engine replaced by the transformers backend on the CPU (what the worker asks
    of an engine: generate, load_weights, finish_weight_update, weights_version), and no vllm or GPU check: the
    actor's own code (plans, pushes, checks, versions) runs as it would around a vLLM engine."""
    import ray

    from posttrain.distributed.ray_groups import VLLMGenerationWorker

    class StandInEngine:
        def __init__(self, model, seed):
            from posttrain.generation.transformers_backend import TransformersGenerator
            from posttrain.models.loading import load_causal_lm, load_tokenizer

            self.sampler = TransformersGenerator(load_causal_lm(model).eval(), load_tokenizer(model), batch_size=256,
                                                 seed=seed, owns_weights=True)
            self.sampler.model.requires_grad_(False)
            self.model = model
            self.weights_version = 0
            self.loads = 0
            self.lora_request = None

        def generate(self, prompts, params, num_samples):
            return self.sampler.generate(prompts, params, num_samples)

        def load_weights(self, bucket):
            with torch.no_grad():
                _, unexpected = self.sampler.model.load_state_dict(dict(bucket), strict=False)
            assert not unexpected
            self.loads += 1
            return sum(t.numel() * t.element_size() for _, t in bucket)

        def finish_weight_update(self, version):
            self.weights_version = version

        def use_adapter(self, directory, version):  # the base model with the adapter written by the actor
            from types import SimpleNamespace

            from peft import PeftModel

            from posttrain.models.loading import load_causal_lm

            peft_model = PeftModel.from_pretrained(load_causal_lm(self.model), directory)
            self.sampler.model = peft_model.get_base_model().eval().requires_grad_(False)
            self.lora_request = SimpleNamespace(lora_path=directory)
            self.weights_version = version

    class StandInVLLMWorker(VLLMGenerationWorker):
        def find_problem(self):
            return None

        def build_engine(self, model, gpu_memory_utilization, seed):
            return StandInEngine(model, seed)

        def engine_loads(self):
            return self.engine.loads

    return ray.remote(StandInVLLMWorker)


@needs_ray
@pytest.mark.slow  # about 70 s on 2 shared cores: a run in one process and two Ray runs
def test_a_vllm_actor_with_a_stand_in_engine_logs_the_in_process_run_synced_by_object_store_and_broadcast(
        tmp_path, tiny_model_dir, monkeypatch, ray_with_one_pretend_gpu):
    """The vLLM generation actor's plumbing around an engine that samples as the in-process run does: every step's
    weights pushed bucket by bucket into the engine (through the object store, then by broadcast with the plan read
    from the model's config) and stamped with the version, the samples' log-probabilities returned; so rewards,
    losses, gradient norms, the generator mismatch and the pushed version equal the in-process run's."""
    from posttrain.algorithms.grpo import train_grpo
    from posttrain.distributed import ray_groups
    from posttrain.logging import read_metrics

    monkeypatch.setattr(ray_groups, "VLLMGenerationActor", stand_in_vllm_actor())
    made = []
    real_generator = ray_groups.RayCluster.generator

    def recording(self, *args, **kwargs):
        generator = real_generator(self, *args, **kwargs)
        made.append((generator.sampling_devices(), generator))
        return generator

    monkeypatch.setattr(ray_groups.RayCluster, "generator", recording)
    steps = ["trainer.max_steps=3", "weight_sync.bucket_mb=0.5"]  # the tiny model's 4.3 MiB in several buckets
    train_grpo(config(tmp_path / "local", *steps))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    keys = ("reward/mean", "loss", "grad_norm", "generator_logprob_error", "weight_sync/version")
    for method in ("object_store", "broadcast"):
        train_grpo(config(tmp_path / method, *steps, *VLLM, "cluster.num_cpus=3", f"weight_sync.method={method}"))
        remote = read_metrics(tmp_path / method / "metrics.jsonl")
        assert_same_steps(local, remote, keys)
        assert [r["weight_sync/version"] for r in remote] == [1, 2, 3]
        assert all(r["weight_sync/bytes"] > 4 * 2**20 for r in remote)
        devices, generator = made[-1]
        assert devices == ["cpu (vllm)"]
        assert generator.sync_backend == ("gloo" if method == "broadcast" else None)


# ---- LoRA adapters-only sync (weight_sync.lora=adapters) ---------------------------------------------------------

LORA = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "trainer.learning_rate=1e-2"]


@pytest.mark.parametrize("overrides, message", [
    ([*VLLM, "weight_sync.lora=adapters"], "needs lora.enabled=true"),
    ([*RAY, *LORA, "weight_sync.lora=adapters"], "only vLLM generation actors"),
    ([*LORA, "rollout.backend=vllm", "weight_sync.lora=adapters"], "only vLLM generation actors"),
    ([*VLLM, *LORA, "weight_sync.lora=adapters", "weight_sync.method=broadcast"], "is not built"),
    ([*VLLM, *LORA, "weight_sync.lora=all"], "weight_sync.lora"),
])
def test_adapters_only_sync_is_refused_at_load_where_no_generator_takes_adapters(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, *overrides)
    assert config(tmp_path, *VLLM, *LORA, "weight_sync.lora=adapters").weight_sync.lora == "adapters"


def test_an_adapter_written_from_pushed_tensors_loads_with_peft_onto_the_base_and_computes_the_trained_model(
        tiny_model_dir, tmp_path):
    """Either naming a push may carry (peft's saved names; a sharded policy's state-dict names with `.default.`)
    writes the same adapter, whose logits on the base model are the LoRA model's; a non-adapter tensor is refused."""
    from peft import PeftModel, get_peft_model_state_dict

    from posttrain.config.schema import LoraSection, ModelConfig
    from posttrain.models.loading import load_causal_lm
    from posttrain.models.lora import adapter_file_name, add_lora, write_adapter

    model = ModelConfig(name_or_path="posttrain/tiny")
    lora = LoraSection(enabled=True, r=4, alpha=8)
    torch.manual_seed(0)
    trained = add_lora(load_causal_lm(model), lora, "causal_lm").eval()
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:  # B starts at 0: the adapter would change nothing
                parameter.normal_(std=0.5)
    tokens = torch.randint(0, 100, (2, 9))
    expected = trained(tokens).logits
    saved_names = get_peft_model_state_dict(trained)
    state_dict_names = {name: tensor for name, tensor in trained.state_dict().items() if "lora_" in name}
    assert set(state_dict_names) != set(saved_names)
    assert {adapter_file_name(name) for name in state_dict_names} == set(saved_names)
    for index, tensors in enumerate((saved_names, state_dict_names)):
        directory = write_adapter(tensors, lora, str(tiny_model_dir), tmp_path / str(index))
        loaded = PeftModel.from_pretrained(load_causal_lm(model), str(directory)).eval()
        assert torch.allclose(loaded(tokens).logits, expected, atol=1e-6)
    base = load_causal_lm(model).eval()(tokens).logits
    assert (base - expected).abs().max() > 1e-2  # the adapter matters: a test that ignored it would fail
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight is not a LoRA adapter tensor"):
        adapter_file_name("base_model.model.model.layers.0.mlp.up_proj.weight")


@needs_ray
@pytest.mark.slow  # about 40 s on 2 shared cores: a LoRA run in one process and one on Ray
def test_adapters_only_sync_to_a_vllm_actor_with_a_stand_in_engine_logs_the_in_process_lora_run(
        tmp_path, tiny_model_dir, monkeypatch, ray_with_one_pretend_gpu):
    """weight_sync.lora=adapters: each push carries the adapter tensors alone (a fraction of the model's bytes), the
    actor writes them as a peft adapter and its engine samples with it over the base model it loaded; the rewards,
    losses, gradient norms and generator mismatch are the in-process LoRA run's, and each step's version is pushed."""
    from posttrain.algorithms.grpo import train_grpo
    from posttrain.distributed import ray_groups
    from posttrain.logging import read_metrics

    monkeypatch.setattr(ray_groups, "VLLMGenerationActor", stand_in_vllm_actor())
    steps = ["trainer.max_steps=3", *LORA]
    train_grpo(config(tmp_path / "local", *steps))
    train_grpo(config(tmp_path / "adapters", *steps, *VLLM, "cluster.num_cpus=3", "weight_sync.lora=adapters"))
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "adapters" / "metrics.jsonl")
    assert_same_steps(local, remote, ("reward/mean", "loss", "grad_norm", "generator_logprob_error"))
    assert [r["weight_sync/version"] for r in remote] == [1, 2, 3]
    assert all(0 < r["weight_sync/bytes"] < 0.2 * 4 * 2**20 for r in remote)  # adapters of rank 4, not 4.3 MiB
