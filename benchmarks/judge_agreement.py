"""How often an arithmetic judge agrees with the verifier, by kind of reply, on held-out problems.

    python benchmarks/judge_agreement.py                                  # posttrain/tiny-arithmetic-judge
    python benchmarks/judge_agreement.py --judge runs/sft_judge_arithmetic/final --problems 800

The judge is asked what configs/grpo_judge_arithmetic.yaml asks it ("12+34=47?", greedy, its score 0 or 1) about
five replies to each held-out problem: the right sum, a plausible wrong sum (off by one or ten, two digits swapped),
any other number from 0 to 199, an empty reply and the right sum with a digit appended. Agreement is the share of
replies whose score equals the verifier's verdict; a reply the judge gives no readable score is masked (counted
apart, as the RL loop masks it). An RL policy trained on the judge's reward is pushed toward whatever the judge
wrongly accepts, so the wrong kinds' acceptance rates are where to expect reward hacking.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import announce_environment, apply_offline_env, markdown_table, write_json  # noqa: E402

KINDS = ("right", "plausible wrong", "any number", "empty", "digit appended")


def replies(problem, rng: random.Random) -> list[str]:
    from posttrain.envs.arithmetic import wrong_answers

    other = rng.choice([n for n in range(200) if str(n) != problem.answer])
    return [problem.answer, rng.choice(wrong_answers(problem)), str(other), "", problem.answer + "0"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--judge", default="posttrain/tiny-arithmetic-judge")
    parser.add_argument("--problems", type=int, default=400, help="held-out problems (five replies each)")
    parser.add_argument("--output", type=Path, default=Path("runs/benchmarks/judge_agreement.json"))
    args = parser.parse_args(argv)
    apply_offline_env()
    announce_environment()

    import posttrain.algorithms  # noqa: F401  (registers the builder of the embedded trained models)
    from posttrain.config.loader import load_config
    from posttrain.config.schema import GRPOConfig
    from posttrain.envs.arithmetic import exact_match, sample_problems
    from posttrain.algorithms.environments import build_recipe_environment

    preset = load_config(GRPOConfig, Path(__file__).resolve().parent.parent / "configs/grpo_judge_arithmetic.yaml")
    options = next(c for c in preset.environment.options.components if c.kind == "judge").options
    judge = build_recipe_environment({"kind": "judge", "options": {**options.model_dump(), "path": args.judge}})
    rng = random.Random(0)
    logs, truth = [], []
    for problem in sample_problems("heldout", args.problems):
        for reply in replies(problem, rng):
            logs.append([{"role": "user", "content": problem.prompt}, {"role": "assistant", "content": reply}])
            truth.append(exact_match(reply, problem.answer))
    step = judge.step(logs, [{}] * len(logs))
    judge.close()
    results, rows = {}, []
    for k, kind in enumerate(KINDS):
        index = range(k, len(logs), len(KINDS))
        scored = [i for i in index if step.rewards[i] is not None]
        agree = sum(step.rewards[i] == truth[i] for i in scored)
        accepted = sum(step.rewards[i] == 1.0 for i in scored)
        results[kind] = {"replies": len(index), "masked": len(index) - len(scored), "agree": agree,
                         "accepted": accepted}
        rows.append([kind, str(len(index)), f"{agree / len(index):.1%}", f"{accepted / max(len(scored), 1):.1%}",
                     str(len(index) - len(scored))])
    print(markdown_table(["reply", "n", "agrees with the verifier", "judged right (of scored)", "no score"], rows))
    write_json(args.output, {"judge": args.judge, "problems": args.problems, "kinds": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
