"""posttrain from Python, as in a notebook: rows built in memory, a short SFT run, then a look at the model.

    python examples/python_api.py                      # 400 steps (configs/sft_arithmetic.yaml takes 2000)
    python examples/python_api.py --steps 5            # a smoke run (tests/test_python_api.py runs this)

Each block below is a notebook cell. Everything runs offline on the embedded tiny model (posttrain/tiny).
"""

import argparse
import random

import posttrain  # instant: torch loads on the first posttrain.train(...)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--held-out", type=int, default=200, help="held-out problems to score")
parser.add_argument("--output-dir", default="runs/python_api")
args = parser.parse_args()

# --- Data: a list of dicts, one row per example (any format a data file may hold: docs/data.md) ---------------
rng = random.Random(0)
problems = [(a, b) for a in range(10, 100) for b in range(10, 100)]
rng.shuffle(problems)
rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b), "answer": str(a + b)} for a, b in problems]
train_rows, held_out = rows[:6000], rows[6000:6000 + args.held_out]

# --- Train: the config as a dict (a YAML file, YAML text or an SFTConfig work too), overrides as dotted keys ----
config = {
    "model": {"name_or_path": "posttrain/tiny"},
    "data": {"max_length": 32},
    "trainer": {"learning_rate": 1.0e-3, "warmup_steps": 20, "adam_beta2": 0.95, "lr_scheduler": "cosine",
                "micro_batch_size": 64, "eval_every": 100, "save_every": 0},
}
result = posttrain.train("sft", config, train_data=train_rows, eval_data=held_out,
                         overrides={"trainer.max_steps": args.steps, "output_dir": args.output_dir})
print(f"trained {result.steps} steps: loss {result.final_loss:.3f}, held-out loss {result.eval_loss:.3f}")
print(f"model in {result.final_dir}; metrics in {result.output_dir}/metrics.jsonl")

# --- Look at a few completions ----------------------------------------------------------------------------------
model = {"model": {"name_or_path": str(result.final_dir)}, "max_new_tokens": 4}
for sample in posttrain.generate({**model, "prompts": ["12+30=", "57+68="]}):
    print(f"{sample.prompt}{sample.completion}  ({sample.finish_reason})")

# --- Score the held-out rows with the arithmetic verifier (their `answer` column) ---------------------------------
report = posttrain.evaluate({**model, "environment": {"kind": "arithmetic"}}, data=held_out)
print(f"held-out accuracy {report.metrics['accuracy']:.1%} on {report.num_prompts} problems")
