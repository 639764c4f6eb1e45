"""The tiny RL set-up the GRPO and PPO tests share: the embedded random model on 256 arithmetic prompts, 8 prompts x
4 samples of up to 6 tokens a step, and the digit-fraction reward (a learnable signal: the share of digits)."""

from pathlib import Path

REWARDS = str(Path(__file__).with_name("reward_fns_for_tests.py"))

TINY_RL = [
    "model.name_or_path=posttrain/tiny",
    "data.train_files=['posttrain/arithmetic[:256]']",
    "data.max_length=32",
    "rollout.prompts_per_step=8",
    "rollout.num_generations_per_prompt=4",
    "rollout.max_new_tokens=6",
    "trainer.learning_rate=1e-3",
    "trainer.lr_scheduler=constant",
    "trainer.micro_batch_size=16",
    "logging.progress=none",
    "logging.plot=false",
]

DIGITS = ["environment.kind=python", f"environment.options={{functions: ['{REWARDS}:digit_fraction'], num_workers: 0}}"]
