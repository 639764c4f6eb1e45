"""Models: loading Hugging Face checkpoints and tokenizers, the embedded tiny models, LoRA, value heads. Scoring text
with a trained reward model (`RewardModel`) is a worker's job: posttrain.workers.RewardModel."""
