"""Pure metric math for evaluations: numbers in, numbers out (no torch, no models).

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", section 2.1): draw n ≥ k samples
of a problem, count the c correct ones, and estimate the probability that at least one of k samples is correct
without bias as

    pass@k = 1 − C(n − c, k) / C(n, k)

averaged over problems. The binomial coefficients overflow floats for n in the hundreds, so, as in the paper's
reference code, the ratio is computed as the product

    C(n − c, k) / C(n, k) = ∏_{i = n − c + 1}^{n} (1 − k / i)

which stays in [0, 1] for every factor. When n − c < k every draw of k samples holds a correct one: pass@k = 1.
"""

from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct out of `n` samples (1 ≤ k ≤ n, 0 ≤ c ≤ n)."""
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs n >= 1 samples and 0 <= c <= n correct ones, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k} with n={n} samples")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> tuple[float, int]:
    """(pass@k averaged over the problems, number of problems averaged) from (n, c) per problem; problems with
    fewer than k scored samples (some of their rewards failed) are left out. (nan, 0) when none has k."""
    values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    if not values:
        return float("nan"), 0
    return sum(values) / len(values), len(values)


def calibration_error(confidences: list[float], correct: list[bool], bin_size: int = 100) -> float:
    """RMS calibration error, as Humanity's Last Exam reports it (Phan et al. 2025, "Humanity's Last Exam",
    section 4; the binning of Hendrycks et al.'s calibration tools): sort the answers by stated confidence (in
    [0, 1]), cut them into consecutive bins of `bin_size` (the last bin takes the remainder, so fewer than
    `bin_size` answers make one bin), and take

        sqrt( Σ_b (n_b / N) · (mean confidence_b − accuracy_b)² )

    Departure: HLE's reference script leaves the last bin out of the sum (its loop stops one bin early); every bin
    counts here, so that a set smaller than one bin has an error at all. 0 is perfect calibration, 1 the worst (HLE
    prints it × 100, as a percentage)."""
    if len(confidences) != len(correct):
        raise ValueError(f"calibration_error needs one correctness per confidence, got {len(confidences)} "
                         f"confidences and {len(correct)} outcomes")
    if not confidences:
        raise ValueError("calibration_error needs at least one answer with a stated confidence")
    if bin_size < 1:
        raise ValueError(f"bin_size must be at least 1, got {bin_size}")
    if any(not 0.0 <= c <= 1.0 for c in confidences):
        raise ValueError(f"confidences must lie in [0, 1], got {min(confidences)} .. {max(confidences)}")
    order = sorted(range(len(confidences)), key=lambda i: confidences[i])
    total = len(order)
    starts = list(range(0, max(total - bin_size, 0) + 1, bin_size)) if total >= bin_size else [0]
    squared = 0.0
    for number, start in enumerate(starts):
        end = total if number == len(starts) - 1 else start + bin_size
        members = order[start:end]
        gap = sum(confidences[i] for i in members) / len(members) - sum(correct[i] for i in members) / len(members)
        squared += len(members) / total * gap * gap
    return squared ** 0.5
