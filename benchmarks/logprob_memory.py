"""Peak memory and time of token log-probabilities + backward through the LM head, full vs chunked.

    .venv/bin/python benchmarks/logprob_memory.py                      # T 4,096, V 151,936, H 512, fp32
    .venv/bin/python benchmarks/logprob_memory.py --tokens 1024 --vocab 32000 --chunk-sizes 256,1024

One row of T positions with hidden size H scores its next tokens through a V-way LM head, then backpropagates a
random weighting of the log-probabilities into the hidden states and the head:

- `full`: logits = hidden @ W.T, log_softmax over V, gather — what a model's forward pass and a gather do; the
  [T, V] logits and log-probabilities (and their gradients) all exist at once;
- `chunked-C`: posttrain.losses.chunked.chunked_token_logprobs with chunk size C (posttrain.losses.chunked).

Each variant runs in its own fresh process, repeats alternating; the memory figure is the rise of the process's
peak RSS (VmHWM) over its RSS once the inputs exist, so the inputs and their gradient buffers are not counted
twice in the ratio. Values and gradients are checked against `full` (max abs difference printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import announce_environment, markdown_table, median, run_worker  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import time

    import torch

    from _common import peak_rss_mib, reset_peak_rss, rss_mib
    from posttrain.losses.chunked import chunked_token_logprobs

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(args.tokens, args.hidden, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    upstream = torch.randn(args.tokens, generator=g)
    # Gradient buffers exist before the measurement, as an optimizer's would.
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    reset_peak_rss()
    before = rss_mib()
    started = time.perf_counter()
    if args.variant == "full":
        logprobs = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    else:
        logprobs = chunked_token_logprobs(hidden, weight, targets, chunk_size=int(args.variant.split("-")[1]))
    (logprobs * upstream).sum().backward()
    seconds = time.perf_counter() - started
    peak = peak_rss_mib()
    torch.save({"logprobs": logprobs.detach(), "hidden_grad": hidden.grad, "weight_grad": weight.grad},
               Path(args.result).with_suffix(".pt"))
    Path(args.result).write_text(json.dumps({"seconds": seconds, "rise_mib": peak - before, "peak_mib": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-sizes", default="1024,256")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    announce_environment()
    variants = ["full", *(f"chunked-{c}" for c in args.chunk_sizes.split(","))]
    shape = ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
             "--threads", str(args.threads)]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for variant in variants if repeat % 2 == 0 else variants[::-1]:
                result_path = Path(tmp) / f"{variant}-{repeat}.json"
                result = run_worker([__file__, "--worker", "--variant", variant, "--result", str(result_path),
                                     *shape], result_path, Path(tmp) / f"{variant}.log", timeout_s=1800)
                tensors = torch.load(result_path.with_suffix(".pt"))
                if variant == "full":
                    reference = tensors
                result["max_abs_diff"] = max(float((tensors[k] - reference[k]).abs().max()) for k in tensors)
                results[variant].append(result)
                print(f"  {variant} repeat {repeat}: {result}", flush=True)
    full_rise = max(r["rise_mib"] for r in results["full"])
    full_seconds = median(r["seconds"] for r in results["full"])
    rows = []
    for variant in variants:
        rise = max(r["rise_mib"] for r in results[variant])
        seconds = median(r["seconds"] for r in results[variant])
        rows.append([variant, f"{rise:,.0f}", f"{rise / full_rise:.3f}", f"{seconds:.2f}",
                     f"{full_seconds / seconds:.2f}", f"{max(r['max_abs_diff'] for r in results[variant]):.1e}"])
    print(f"\nT {args.tokens:,}, V {args.vocab:,}, H {args.hidden}, fp32, {args.threads} threads, "
          f"{args.repeats} repeats (memory: the worst repeat; time: the median)")
    print(markdown_table(["variant", "peak RSS rise (MiB)", "vs full", "seconds", "speed vs full",
                          "max abs diff vs full"], rows))


if __name__ == "__main__":
    main()
