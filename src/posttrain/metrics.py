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
