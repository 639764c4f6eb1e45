"""What verified checkpoints cost: writing the manifest (size and SHA-256 of every file) at save, and checking
it at resume, next to the save itself.

    python benchmarks/checkpoint_integrity.py                  # a 67M-parameter model, about 0.8 GB per checkpoint
    python benchmarks/checkpoint_integrity.py --hidden 1024 --layers 12 --repeats 3

The model is a randomly initialised Llama of the given shape with a 32k vocabulary (no download); one AdamW step
fills the optimizer state, so the checkpoint holds what a real one does (weights, two moments, schedule). Each
repeat writes a fresh checkpoint folder with `save_model_state` (what a worker writes), then times
`write_manifest` and `verify_checkpoint` over it. The ratios are the manifest's and the verification's time over
the save's. Save times depend on the disk (and its page cache) more than on the CPU: run it where your
checkpoints go.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import announce_environment  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--directory", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    announce_environment()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.checkpoint import save_model_state, verify_checkpoint, write_manifest

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 64),
                         vocab_size=args.vocab, max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(input_ids=torch.randint(0, args.vocab, (2, 64)), labels=torch.randint(0, args.vocab, (2, 64))).loss.backward()
    optimizer.step()
    parameters = sum(p.numel() for p in model.parameters())

    root = args.directory or Path(tempfile.mkdtemp(prefix="posttrain-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    saves, manifests, verifies, size = [], [], [], 0
    try:
        for repeat in range(args.repeats):
            folder = root / f"step_{repeat}"
            started = time.perf_counter()
            (folder / "policy").mkdir(parents=True)
            save_model_state(folder / "policy", model, None, optimizer, scheduler)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            write_manifest(folder)
            manifests.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert verify_checkpoint(folder) is None
            verifies.append(time.perf_counter() - started)
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            shutil.rmtree(folder)
    finally:
        if args.directory is None:
            shutil.rmtree(root, ignore_errors=True)

    save, manifest, verify = (statistics.median(x) for x in (saves, manifests, verifies))
    print(f"\nmodel: {parameters / 1e6:.1f}M parameters, checkpoint {size / 2**30:.2f} GiB, {args.repeats} repeats "
          "(medians)\n")
    print("| step | seconds | vs save | GiB/s |")
    print("|---|---|---|---|")
    print(f"| save (weights, optimizer, schedule) | {save:.2f} | 1.00 | {size / 2**30 / save:.2f} |")
    print(f"| write manifest (SHA-256 of every file) | {manifest:.2f} | {manifest / save:.2f} | {size / 2**30 / manifest:.2f} |")
    print(f"| verify at resume | {verify:.2f} | {verify / save:.2f} | {size / 2**30 / verify:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
