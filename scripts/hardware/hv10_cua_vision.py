"""HV-10: computer use with a vision-language policy that reads the screenshots, on a CUDA device; KVM guests.

Run on a machine with an NVIDIA GPU, Xvfb and xdotool (`apt-get install -y xvfb xdotool`), after
`bash scripts/setup.sh`:

    .venv/bin/python scripts/hardware/hv10_cua_vision.py [--model NAME_OR_PATH] [--with-tree] [--max-steps 8]

--model is an image-text-to-text model transformers loads with AutoModelForImageTextToText and AutoProcessor (default
Qwen/Qwen2.5-VL-3B-Instruct; give a local directory on a machine without network).

Phases:
  scripted: the bundled tasks with the scripted policy (`posttrain cua-run`'s), through the cua environment: the
      desktop, the app, xdotool and the evaluators work on this machine (the baseline: every task solved).
  vision: each bundled task played by the model. The episode opens with a WAIT (so the first screenshot exists);
      then each turn the model is shown the latest screenshot (step_NNN.png, as saved by the environment) with the
      instruction, the action space, its previous actions and, with --with-tree, the accessibility tree as text, and
      answers one computer_13 action, which the environment performs and scores. Reported per task: reward, actions,
      invalid actions; overall: tasks solved, the share of replies that were valid actions, seconds per model call,
      the image's share of the prompt's tokens.
  kvm: whether /dev/kvm is usable and qemu-system-x86_64 is installed. Desktops in KVM guests (OSWorld's VM images)
      are not built; this phase only reports what the machine offers for them.

Checks (first estimates, in THRESHOLDS): scripted solves every task; vision has no episode masked for an
infrastructure failure, every model call received pixel values, and at least valid_action_rate_min of the replies
are valid actions. Tasks solved by the model are reported, not checked: they measure the model, not posttrain.

Prints one JSON object (also $OUT/hv10.json when OUT is set); exit 0 when every check passes, 1 when one fails, 2
without CUDA, Xvfb/xdotool or the model classes. Expect a few minutes on one H100 for a 3B model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

THRESHOLDS = {"valid_action_rate_min": 0.5}

VISION_PROMPT = (
    "You are operating a {width}x{height} desktop shown in the screenshot. Task: {instruction}\n\n{help}\n\n"
    "{history}{tree}Reply with the next action as one JSON object and nothing else.")


def scripted_phase(workdir: Path) -> dict:
    from posttrain.envs.cua.environment import CuaEnvironment
    from posttrain.envs.cua.scripted import ScriptedPolicy, load_scripts, run_tasks
    from posttrain.envs.cua.tasks import load_tasks

    tasks = load_tasks()
    environment = CuaEnvironment(tasks, episodes_dir=workdir / "scripted")
    try:
        reports = run_tasks(tasks, ScriptedPolicy(load_scripts()), environment)
    finally:
        environment.close()
    return {"solved": sum(r.correct for r in reports), "tasks": len(reports),
            "seconds_per_task": sum(r.seconds for r in reports) / len(reports)}


def vision_phase(workdir: Path, model_name: str, max_steps: int, with_tree: bool) -> dict:
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from posttrain.envs.cua.environment import ACTION_HELP, CuaEnvironment
    from posttrain.envs.cua.scripted import parse_tree
    from posttrain.envs.cua.environment import tree_text
    from posttrain.envs.cua.tasks import load_tasks

    processor = AutoProcessor.from_pretrained(model_name)
    model = AutoModelForImageTextToText.from_pretrained(model_name, dtype=torch.bfloat16, device_map="cuda")
    tasks = load_tasks()
    environment = CuaEnvironment(tasks, episodes_dir=workdir / "vision", max_steps=max_steps + 1)
    width, height = environment.screen
    per_task, call_seconds, image_shares, replies, valid, masked, without_pixels = [], [], [], 0, 0, 0, 0
    try:
        for task in tasks:
            messages = [{"role": "user", "content": task.instruction}, {"role": "assistant", "content": "WAIT"}]
            row = {"task_id": task.id}
            actions: list[str] = []
            while True:
                result = environment.step([messages], [row])
                row = result.metadata[0]
                if result.done[0]:
                    break
                messages.append(result.observations[0])
                tree = ("The accessibility tree:\n" + tree_text(parse_tree(result.observations[0]["content"])) + "\n\n"
                        if with_tree else "")
                history = ("Your actions so far:\n" + "\n".join(actions) + "\n\n") if actions else ""
                text = VISION_PROMPT.format(width=width, height=height, instruction=task.instruction,
                                            help=ACTION_HELP, history=history, tree=tree)
                image = Image.open(row["cua_screenshots"][-1]).convert("RGB")
                chat = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]
                inputs = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True, return_tensors="pt").to(model.device)
                if "pixel_values" not in inputs:
                    without_pixels += 1
                image_token = getattr(processor, "image_token", None)
                if image_token is not None:
                    image_id = processor.tokenizer.convert_tokens_to_ids(image_token)
                    image_shares.append(float((inputs["input_ids"] == image_id).float().mean()))
                started = time.perf_counter()
                with torch.no_grad():
                    output = model.generate(**inputs, max_new_tokens=96, do_sample=False)
                call_seconds.append(time.perf_counter() - started)
                reply = processor.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
                actions.append(reply)
                messages.append({"role": "assistant", "content": reply})
            task_actions = row.get("cua_actions", 1) - 1  # less the opening WAIT
            replies += task_actions
            valid += task_actions - row.get("cua_errors", 0)
            masked += result.rewards[0] is None
            per_task.append({"task_id": task.id, "reward": result.rewards[0], "actions": task_actions,
                             "invalid_actions": row.get("cua_errors", 0), "error": result.errors[0],
                             "replies": actions[-3:]})
    finally:
        environment.close()
    return {"tasks": per_task, "solved": sum(t["reward"] == 1.0 for t in per_task), "masked": masked,
            "valid_action_rate": valid / replies if replies else 0.0, "calls_without_pixels": without_pixels,
            "seconds_per_call": sum(call_seconds) / len(call_seconds) if call_seconds else None,
            "image_token_share": sum(image_shares) / len(image_shares) if image_shares else None}


def kvm_phase() -> dict:
    kvm = Path("/dev/kvm")
    return {"dev_kvm": kvm.exists(), "dev_kvm_usable": kvm.exists() and os.access(kvm, os.R_OK | os.W_OK),
            "qemu": shutil.which("qemu-system-x86_64"), "guest_backend": "not built"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-3B-Instruct")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--with-tree", action="store_true", help="also show the accessibility tree as text")
    parser.add_argument("--phases", default="scripted,vision,kvm")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    phases = args.phases.split(",")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hv10-"))
    results: dict = {"hv": "HV-10", "model": args.model, "workdir": str(workdir), "thresholds": THRESHOLDS,
                     "checks": {}}
    missing = [name for name in ("Xvfb", "xdotool") if shutil.which(name) is None]
    if missing:
        results["error"] = f"no {' or '.join(missing)} on PATH (apt-get install -y xvfb xdotool)"
        return finish(results, 2)
    if "vision" in phases:
        import torch

        if not torch.cuda.is_available():
            results["error"] = "no CUDA device"
            return finish(results, 2)
        try:
            from transformers import AutoModelForImageTextToText  # noqa: F401
        except ImportError as error:
            results["error"] = f"transformers has no AutoModelForImageTextToText: {error}"
            return finish(results, 2)
    if "scripted" in phases:
        results["scripted"] = scripted_phase(workdir)
        results["checks"]["scripted_solves_every_task"] = \
            results["scripted"]["solved"] == results["scripted"]["tasks"]
    if "vision" in phases:
        results["vision"] = vision_phase(workdir, args.model, args.max_steps, args.with_tree)
        results["checks"]["vision_no_masked_episode"] = results["vision"]["masked"] == 0
        results["checks"]["vision_every_call_had_pixels"] = results["vision"]["calls_without_pixels"] == 0
        results["checks"]["vision_valid_action_rate"] = \
            results["vision"]["valid_action_rate"] >= THRESHOLDS["valid_action_rate_min"]
    if "kvm" in phases:
        results["kvm"] = kvm_phase()
    return finish(results, 0 if all(results["checks"].values()) else 1)


def finish(results: dict, code: int) -> int:
    results["passed"] = code == 0
    text = json.dumps(results, indent=1, default=str)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "hv10.json").write_text(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
