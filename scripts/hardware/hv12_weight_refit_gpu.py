"""HV-12: weight refit seconds for a 1.5B-parameter model on GPUs, by each path posttrain has, against a
device-to-device copy of the same bytes.

    .venv/bin/python scripts/hardware/hv12_weight_refit_gpu.py [--bucket-mb 64,256,1024] [--repeats 3]

The model is a random Qwen2.5-1.5B-shaped Llama built here from a config (hidden 1536, 28 layers, 12 heads / 2 KV
heads, MLP 8960, vocabulary 151,936, tied embeddings; no download) in bfloat16. The weights pushed are its
`state_dict()`, as a policy worker's `named_weights` gives them: the tied head appears under both its names, so a
push moves the embedding's bytes twice, as posttrain's pushes do. Paths, each its own processes:

  (a) nccl        `weight_sync.method=broadcast` (distributed/weight_broadcast.py): two processes, the holder with
                  `WeightSender` and the generator with `WeightLoader` over a `SyncGroup` on NCCL, the project's
                  sorted bucket plan (`bucket_plan`), one broadcast per bucket straight into the generator's model.
                  On two GPUs: one process per GPU. On one GPU: two processes sharing it, which NCCL refuses
                  ("Duplicate GPU detected"); the script then reports the refusal and this figure is missing.
  (b) bytes       `weight_sync.method=object_store` without the actor call: `weight_buckets` in the order given,
                  each bucket made a NumPy byte payload (`bucket_payload`: device to host), put into and read
                  back from Ray's object store in this process, and loaded by the generator's `load_bucket` into a
                  second copy of the model on the same GPU (host to device).
  (c) d2d         the reference: each tensor copied into a preallocated tensor on the same GPU (`copy_`), and with
                  two GPUs from GPU 0 into GPU 1 (peer copy: the link NCCL uses). Ratios are against the copy
                  over the same link as NCCL's bytes (peer with 2 GPUs, else same device).
  (d) cuda_ipc    NOT a posttrain path (posttrain has no CUDA IPC sync): `torch.multiprocessing` sharing of the
                  holder's CUDA tensors with a second process on the same GPU (CUDA IPC handles), bucket by bucket
                  as `weight_buckets` groups them, the receiver copying each tensor into its own model and
                  answering before the next bucket: the figure a colocated path could reach.

Every path is timed over full pushes after one untimed warm-up push per bucket size (NCCL's communicator, opened
IPC handles and the object store are set up once per run; `first_push_seconds` keeps that push's time): seconds
per push (min / median / max over --repeats) and GB/s (10^9 bytes of the push over the median). The generator's
copy is zeroed before every push and, after the last, compared with the holder's weights by SHA-256 of every tensor
(`weight_digests`): bitwise equality.

Prints one JSON object (also $OUT/hv12.json when OUT is set); exit 0 when every check passes, 1 on a failed check
(NCCL refused or failed included: its error is in the JSON), 2 without CUDA or ray. Checks (first estimates, in
THRESHOLDS): both NCCL members planned the same buckets; NCCL, bytes and IPC copies bitwise equal to the holder's
weights; NCCL at least 30% of the reference copy's bandwidth for every bucket size of 256 MB or more.

--allow-cpu dry-runs the same code on the CPU (gloo instead of NCCL, shared memory instead of CUDA IPC, one thread
per process) with a smaller model from --hidden/--layers/--vocab; its timings say nothing about GPUs, and the
bandwidth check is left out:

    .venv/bin/python scripts/hardware/hv12_weight_refit_gpu.py --allow-cpu --hidden 256 --layers 2 --vocab 8192 \\
        --bucket-mb 1,4,64
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
import types
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.distributed.weight_check import weight_digests
from posttrain.generation.base import weight_buckets

# The modules that import ray (weight_broadcast, ray_groups) are imported where used, after the check that ray is
# installed (exit 2 without it).

THRESHOLDS = {"nccl_of_reference_min": 0.30, "nccl_check_from_bucket_mb": 256}
QWEN2_5_1_5B = {"hidden": 1536, "layers": 28, "vocab": 151936}


def model_config(hidden: int, layers: int, vocab: int) -> LlamaConfig:
    """Qwen2.5's proportions at any width: head dimension 128 (fewer, wider heads below that), 6 query heads per KV
    head where the heads divide by 6, MLP 35/6 of the width (1536 -> 12 heads, 2 KV heads, 8960)."""
    heads = max(1, hidden // 128)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=round(hidden * 35 / 6),
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads // 6 if heads % 6 == 0 else 1, tie_word_embeddings=True,
                       max_position_embeddings=4096)


def build_model(settings: dict, device: torch.device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(model_config(settings["hidden"], settings["layers"], settings["vocab"]))
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def zero(state: dict[str, torch.Tensor]) -> None:
    for tensor in state.values():
        tensor.zero_()


def child_setup(settings: dict, device_index: int) -> torch.device:
    if settings["cuda"]:
        torch.cuda.set_device(device_index)
        return torch.device("cuda", device_index)
    torch.set_num_threads(1)  # two processes on two cores
    return torch.device("cpu")


def report_errors(phase: str, rank: int, results, body) -> None:
    """Run a child's body; an exception is sent to the parent as this member's error (NCCL's refusal of two ranks
    on one GPU ends up in the JSON this way), then the child exits 1."""
    try:
        body()
    except Exception as error:  # reported to the parent, which waits with a deadline and prints it
        text = "".join(traceback.format_exception_only(type(error), error))
        results.put({"phase": phase, "rank": rank, "error": " | ".join(text.split("\n")).strip(" |")[-1500:],
                     "traceback_tail": traceback.format_exc()[-1500:]})
        sys.exit(1)


# ---- (b) and (c): one process, two copies of the model ----

def local_phase(settings: dict, results) -> None:
    report_errors("local", 0, results, lambda: _local(settings, results))


def _local(settings: dict, results) -> None:
    import ray

    from posttrain.distributed.ray_groups import GenerationWorker, bucket_payload

    device = child_setup(settings, 0)
    source = build_model(settings, device, seed=0).state_dict()
    target_model = build_model(settings, device, seed=1)
    target = target_model.state_dict()
    repeats, out = settings["repeats"], {"phase": "local", "rank": 0}
    out["holder_digests"] = weight_digests(source.items())
    out["bytes_per_push"] = sum(t.numel() * t.element_size() for t in source.values())
    out["parameters"] = sum(p.numel() for p in target_model.parameters())

    def timed(push, before=None) -> list[float]:
        seconds = []
        for _ in range(repeats + 1):
            if before:
                before()
            synchronize(device)
            start = time.perf_counter()
            push()
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        return seconds

    def copy_into(state: dict[str, torch.Tensor]) -> None:
        for name, tensor in source.items():
            state[name].copy_(tensor)

    out["d2d_same_device"] = timed(lambda: copy_into(target), lambda: zero(target))
    if settings["cuda"] and torch.cuda.device_count() >= 2:
        peer = {name: torch.empty_like(tensor, device="cuda:1") for name, tensor in source.items()}
        out["d2d_peer"] = timed(lambda: (copy_into(peer), synchronize(torch.device("cuda", 1))))
        del peer

    # The generation actor's own loading code (GenerationWorker.load_bucket), on a copy of the model in this
    # process: what an actor does with a bucket, without the actor call and the actor's model loading.
    generator = GenerationWorker.__new__(GenerationWorker)
    generator.generator, generator._loaded = types.SimpleNamespace(model=target_model), set()
    ray.init(num_cpus=1, include_dashboard=False, _temp_dir=settings["scratch"], log_to_driver=False)

    def object_store_push(bucket_bytes: int) -> None:
        for bucket in weight_buckets(source.items(), bucket_bytes):
            ref = ray.put(bucket_payload(bucket))
            generator.load_bucket(ray.get(ref))
            del ref  # one bucket in the object store at a time, as in a push

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for mb in settings["bucket_mb"]:
            out[f"bytes_{mb}"] = timed(lambda: object_store_push(mb * 2**20), lambda: zero(target))
            out[f"bytes_{mb}_digests"] = weight_digests(target.items())
    ray.shutdown()
    results.put(out)


# ---- (a): NCCL broadcast between two processes ----

def nccl_phase(rank: int, settings: dict, address: str, port: int, results) -> None:
    report_errors("nccl", rank, results, lambda: _nccl(rank, settings, address, port, results))


def _nccl(rank: int, settings: dict, address: str, port: int, results) -> None:
    from posttrain.distributed.weight_broadcast import SyncGroup, WeightLoader, WeightSender, plan_digest

    device_index = rank if settings["cuda"] and torch.cuda.device_count() >= 2 else 0
    device = child_setup(settings, device_index)
    model = build_model(settings, device, seed=rank)
    state = model.state_dict()
    timeout_s = settings["timeout_s"]
    group = SyncGroup(address, port, rank, 2, "nccl" if settings["cuda"] else "gloo", timeout_s)
    out = {"phase": "nccl", "rank": rank, "backend": group.backend, "device": str(device)}
    if rank == 0:
        out["holder_digests"] = weight_digests(state.items())
    start_signal = torch.zeros(1, dtype=torch.uint8, device=group.device)
    for mb in settings["bucket_mb"]:
        sender = WeightSender(state.items(), mb * 2**20) if rank == 0 else None
        loader = WeightLoader(model, mb * 2**20) if rank == 1 else None
        plan = sender.plan if rank == 0 else loader.plan
        out[f"plan_{mb}"] = {"digest": plan_digest(plan), "buckets": len(plan),
                             "bytes": sum(bucket.nbytes for bucket in plan)}
        seconds = []
        for _ in range(settings["repeats"] + 1):
            if rank == 1:
                zero(state)
            synchronize(device)
            group.broadcast(start_signal).wait()  # both members start the push together
            synchronize(device)
            start = time.perf_counter()
            for index in range(len(plan)):
                if rank == 0:
                    sender.send(group, index).wait()
                else:
                    loader.receive(group, index, timeout_s)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        out[f"nccl_{mb}"] = seconds
        if rank == 1:
            out[f"nccl_{mb}_digests"] = weight_digests(state.items())
    results.put(out)


# ---- (d): torch.multiprocessing CUDA tensor sharing (CUDA IPC), not a posttrain path ----

def ipc_phase(rank: int, settings: dict, to_receiver, to_holder, results) -> None:
    report_errors("cuda_ipc", rank, results, lambda: _ipc(rank, settings, to_receiver, to_holder, results))


def _ipc(rank: int, settings: dict, to_receiver, to_holder, results) -> None:
    device = child_setup(settings, 0)
    state = build_model(settings, device, seed=rank).state_dict()
    timeout_s = settings["timeout_s"]

    def get(channel, what: str):
        try:
            return channel.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"cuda_ipc {'holder' if rank == 0 else 'receiver'}: no {what} within "
                               f"--timeout-s={timeout_s:g} s") from None

    out: dict = {"phase": "cuda_ipc", "rank": rank}
    if rank == 0:
        out["holder_digests"] = weight_digests(state.items())
        out["bytes_per_push"] = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
        for mb in settings["bucket_mb"]:
            seconds = []
            for _ in range(settings["repeats"] + 1):
                get(to_holder, "'ready' from the receiver before a push")
                synchronize(device)
                start = time.perf_counter()
                for bucket in weight_buckets(state.items(), mb * 2**20):
                    to_receiver.put(("bucket", bucket))
                    get(to_holder, f"'loaded' from the receiver for a bucket of {mb} MB")
                seconds.append(time.perf_counter() - start)
                to_receiver.put(("end", None))
            out[f"cuda_ipc_{mb}"] = seconds
        to_receiver.put(("stop", None))
    else:
        for mb in settings["bucket_mb"]:
            for _ in range(settings["repeats"] + 1):
                zero(state)
                synchronize(device)
                to_holder.put("ready")
                while (message := get(to_receiver, "bucket or end of push from the holder"))[0] == "bucket":
                    with torch.no_grad():
                        for name, tensor in message[1]:
                            state[name].copy_(tensor)
                    synchronize(device)
                    del message, tensor  # the holder's memory is released by the receiver first
                    to_holder.put("loaded")
            out[f"cuda_ipc_{mb}_digests"] = weight_digests(state.items())
        get(to_receiver, "the holder's stop")
    results.put(out)


# ---- the parent: start each phase's processes, wait for their results within a deadline ----

def run_phase(name: str, processes: list, results, timeout_s: float) -> list[dict]:
    """Start the phase's processes and collect one result per process by the deadline. A member that fails (or
    exits without a result, e.g. killed by a signal) makes the others wait at most 30 s more, since a collective they
    share cannot finish; then every one still running is killed. The results, or an error per member without one."""
    for process in processes:
        process.start()
    received: dict[int, dict] = {}
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(received) < len(processes):
        try:
            result = results.get(timeout=1.0)
        except queue.Empty:
            now = time.monotonic()
            for rank, process in enumerate(processes):
                if rank not in received and process.exitcode is not None:
                    exited_at.setdefault(rank, now)
            # A result is in the queue before its process exits: 5 s after an exit without one, there is none.
            for rank in [rank for rank, at in exited_at.items() if rank not in received and now - at > 5]:
                received[rank] = {"phase": name, "rank": rank,
                                  "error": f"exited with code {processes[rank].exitcode} without a result"}
                deadline = min(deadline, now + 30)
            if now < deadline:
                continue
            failed = any("error" in result for result in received.values())
            for rank in set(range(len(processes))) - set(received):
                received[rank] = {"phase": name, "rank": rank,
                                  "error": "stopped: another member of the phase failed" if failed else
                                  f"no result within --timeout-s={timeout_s:g} s"}
            break
        received[result["rank"]] = result
        if "error" in result:
            deadline = min(deadline, time.monotonic() + 30)
    for process in processes:
        process.join(timeout=max(deadline - time.monotonic(), 5))
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
    return [received[rank] for rank in sorted(received)]


def summary(seconds: list[float], nbytes: int, reference: float | None, same_device: float | None = None) -> dict:
    """The warm-up push, then min / median / max seconds of the timed pushes and GB/s (10^9 bytes) of the median,
    as a share of the reference copy's (and of the same-device copy's, when the reference is the peer copy)."""
    timed = seconds[1:]
    median = statistics.median(timed)
    result = {"first_push_seconds": seconds[0], "seconds_min": min(timed), "seconds_median": median,
              "seconds_max": max(timed), "gb_per_s": nbytes / median / 1e9}
    if reference is not None:
        result["of_reference"] = result["gb_per_s"] / reference
    if same_device is not None and same_device != reference:
        result["of_d2d_same_device"] = result["gb_per_s"] / same_device
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-mb", default="64,256,1024", help="weight_sync.bucket_mb values, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per path and bucket size")
    parser.add_argument("--hidden", type=int, default=QWEN2_5_1_5B["hidden"])
    parser.add_argument("--layers", type=int, default=QWEN2_5_1_5B["layers"])
    parser.add_argument("--vocab", type=int, default=QWEN2_5_1_5B["vocab"])
    parser.add_argument("--phases", default="local,nccl,cuda_ipc", help="which processes to run")
    parser.add_argument("--timeout-s", type=float, default=600, help="deadline of each phase and each collective")
    parser.add_argument("--allow-cpu", action="store_true", help="dry-run on the CPU (gloo, shared memory)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1 (the warm-up push is not counted)")
    cuda = torch.cuda.is_available()
    if not (cuda or args.allow_cpu) or importlib.util.find_spec("ray") is None:
        print(json.dumps({"skipped": "needs CUDA (or --allow-cpu for a dry run) and the ray extra"}))
        return 2
    from posttrain.distributed.weight_broadcast import free_port

    phases = args.phases.split(",")
    bucket_mb = [int(mb) for mb in args.bucket_mb.split(",")]
    result: dict = {"dry_run_on_cpu": not cuda, "model": {"hidden": args.hidden, "layers": args.layers,
                                                           "vocab": args.vocab, "dtype": "bfloat16",
                                                           "tied_embeddings": True},
                    "gpus": torch.cuda.device_count() if cuda else 0,
                    "device": torch.cuda.get_device_name(0) if cuda else "cpu", "bucket_mb": bucket_mb,
                    "versions": {"torch": torch.__version__, "ray": importlib.metadata.version("ray"),
                                 "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}}
    if not cuda:
        result["note"] = "CPU dry run: gloo and shared memory, not NCCL and CUDA IPC; timings say nothing of GPUs"
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="hv12-") as scratch:
        settings = {"cuda": cuda, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                    "bucket_mb": bucket_mb, "repeats": args.repeats, "timeout_s": args.timeout_s,
                    "scratch": scratch}
        raw: dict[str, list[dict]] = {}
        if "local" in phases:
            raw["local"] = run_phase("local", [context.Process(target=local_phase, args=(settings, results))],
                                     results, args.timeout_s)
        if "nccl" in phases:
            address, port = free_port()
            members = [context.Process(target=nccl_phase, args=(rank, settings, address, port, results))
                       for rank in range(2)]
            raw["nccl"] = run_phase("nccl", members, results, args.timeout_s)
        if "cuda_ipc" in phases:
            to_receiver, to_holder = context.Queue(), context.Queue()
            members = [context.Process(target=ipc_phase, args=(rank, settings, to_receiver, to_holder, results))
                       for rank in range(2)]
            raw["cuda_ipc"] = run_phase("cuda_ipc", members, results, args.timeout_s)
    result |= evaluate(raw, bucket_mb, cuda)
    text = json.dumps(result, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "hv12.json").write_text(text + "\n")
    return 0 if result["passed"] else 1


def evaluate(raw: dict[str, list[dict]], bucket_mb: list[int], cuda: bool) -> dict:
    """Figures and checks from the phases' results."""
    figures: dict = {}
    checks: dict = {}
    errors = {f"{name} rank {r['rank']}": r["error"] for name, members in raw.items() for r in members if "error" in r}
    local = raw.get("local", [{}])[0]
    nbytes = local.get("bytes_per_push")
    reference = same_device = None
    if "d2d_same_device" in local:
        figures["parameters"] = local["parameters"]
        figures["bytes_per_push"] = nbytes
        figures["d2d_same_device"] = summary(local["d2d_same_device"], nbytes, None)
        reference = same_device = figures["d2d_same_device"]["gb_per_s"]
        if "d2d_peer" in local:
            figures["d2d_peer"] = summary(local["d2d_peer"], nbytes, None)
            reference = figures["d2d_peer"]["gb_per_s"]
        figures["reference"] = "d2d_peer" if "d2d_peer" in local else "d2d_same_device"
        for mb in bucket_mb:
            figures[f"bytes_{mb}"] = summary(local[f"bytes_{mb}"], nbytes, reference, same_device)
            checks[f"bytes_{mb}_bitwise"] = local[f"bytes_{mb}_digests"] == local["holder_digests"]
    nccl = {r["rank"]: r for r in raw.get("nccl", []) if "error" not in r}
    if "nccl" in raw:
        checks["nccl_ran"] = len(nccl) == 2
    if len(nccl) == 2:
        holder, receiver = nccl[0], nccl[1]
        figures["nccl_backend"] = holder["backend"]
        figures["nccl_devices"] = [holder["device"], receiver["device"]]
        figures["nccl_on"] = ("2 GPUs" if holder["device"] != receiver["device"] else
                              "1 GPU shared by 2 processes" if cuda else "CPU (gloo)")
        for mb in bucket_mb:
            checks[f"nccl_{mb}_same_plan"] = holder[f"plan_{mb}"]["digest"] == receiver[f"plan_{mb}"]["digest"]
            seconds = [max(a, b) for a, b in zip(holder[f"nccl_{mb}"], receiver[f"nccl_{mb}"])]
            figures[f"nccl_{mb}"] = summary(seconds, holder[f"plan_{mb}"]["bytes"], reference, same_device) | {
                "buckets": holder[f"plan_{mb}"]["buckets"]}
            checks[f"nccl_{mb}_bitwise"] = receiver[f"nccl_{mb}_digests"] == holder["holder_digests"]
            if cuda and mb >= THRESHOLDS["nccl_check_from_bucket_mb"] and reference is not None:
                checks[f"nccl_{mb}_bandwidth"] = (figures[f"nccl_{mb}"]["of_reference"]
                                                  >= THRESHOLDS["nccl_of_reference_min"])
    ipc = {r["rank"]: r for r in raw.get("cuda_ipc", []) if "error" not in r}
    if len(ipc) == 2:
        figures["cuda_ipc_label"] = ("not a posttrain path: torch.multiprocessing sharing of the holder's CUDA "
                                     "tensors with a process on the same GPU, copied into its model (the mechanism "
                                     "of a colocated CUDA IPC sync)" if cuda else
                                     "not a posttrain path: torch.multiprocessing shared memory on the CPU")
        for mb in bucket_mb:
            figures[f"cuda_ipc_{mb}"] = summary(ipc[0][f"cuda_ipc_{mb}"], ipc[0]["bytes_per_push"], reference,
                                              same_device)
            checks[f"cuda_ipc_{mb}_bitwise"] = ipc[1][f"cuda_ipc_{mb}_digests"] == ipc[0]["holder_digests"]
    elif "cuda_ipc" in raw:
        checks["cuda_ipc_ran"] = False
    if "local" in raw:
        checks["local_ran"] = "error" not in local
    return {"figures": figures, "errors": errors, "checks": checks, "thresholds": THRESHOLDS,
            "not_checked": [] if cuda else ["nccl bandwidth (a CPU dry run)"],
            "passed": bool(checks) and all(checks.values())}


if __name__ == "__main__":
    sys.exit(main())
