"""How big a batch is worth it: the gradient noise scale and the time-to-target tradeoff.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv 1812.06162). Appendix A.1:
from the squared norm of a gradient over a small batch b and over a big batch B (the same step),

    |G|²  ≈ (B·|G_B|² − b·|G_b|²) / (B − b)          the true gradient's squared norm
    tr(Σ) ≈ (|G_b|² − |G_B|²) / (1/b − 1/B)           the per-example gradient's total variance
    B_noise = tr(Σ) / |G|²                             the simple noise scale, in samples

each of |G|² and tr(Σ) averaged over many steps *before* the ratio (one step's ratio is too noisy).
A run at global batch B then needs E(B) ≈ E_min·(1 + B/B_noise) samples and S(B) ≈ S_min·(1 + B_noise/B)
optimizer steps to reach a given loss (section 2.2): batch growth pays up to about B_noise and little past it.

The rank side (a DDP communication hook that measures |G_b|² before the all-reduce) is
`worker.noise_meter.GradNoiseMeter`; this module is plain arithmetic, used by workers, driver and benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def in_samples(b_noise: float) -> str:
    """B_noise as the console, the report and the answer print it: whole samples with thousands separators from 10
    up, two significant digits below (a network still learning its output's bias can measure 0.3, and "0" would
    read as a meter that measured nothing)."""
    return format(b_noise, ",.0f") if abs(b_noise) >= 10 else format(b_noise, ".2g")


@dataclass(frozen=True)
class NoiseEstimate:
    """The two smoothed parts and their ratio (None unless both are positive: where noise swamps the signal
    the estimate of |G|² can come out ≤ 0, and tr(Σ) < 0 is sampling error)."""

    grad_sq_norm: float  # |G|², the true gradient's squared norm
    grad_trace_cov: float  # tr(Σ), summed per-example gradient variance

    @property
    def grad_noise_scale(self) -> float | None:
        if self.grad_sq_norm > 0 and 0 < self.grad_trace_cov < math.inf:
            return self.grad_trace_cov / self.grad_sq_norm
        return None


def estimate(small_sq: float, big_sq: float, b_small: float, b_big: float) -> NoiseEstimate | None:
    """From the mean squared gradient norms at batch `b_small` and `b_big` (means over the same steps).

    None when there is no pair (b_big ≤ b_small: one worker, no accumulation).
    """
    if not b_big > b_small > 0:
        return None
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return NoiseEstimate(g2, trace)


# ---------------------------------------------------------------------------------------------
# The recommendation


@dataclass(frozen=True)
class Candidate:
    """One global batch: its measured throughput and the predicted cost to reach the same loss."""

    global_batch: int
    samples_per_s: float
    samples: float  # E(B) / E_min = 1 + B / B_noise
    steps: float  # S(B) / S_min = 1 + B_noise / B
    time: float  # T(B) relative to the fastest candidate (1.0): (1 + B/B_noise) / throughput(B), normalised


@dataclass(frozen=True)
class Recommendation:
    noise_scale: float  # B_noise the prediction used, samples
    candidates: list[Candidate]  # by global batch
    source: str  # where B_noise came from, e.g. "trial 3f2a_00001, epoch 6"

    @property
    def fastest(self) -> Candidate:
        return min(self.candidates, key=lambda c: c.time)

    def as_dict(self) -> dict:
        return {"grad_noise_scale": self.noise_scale, "source": self.source,
                "candidates": [c.__dict__ for c in self.candidates]}


def predicted_samples(batch: float, noise_scale: float) -> float:
    """E(B) / E_min."""
    return 1 + batch / noise_scale


def predicted_steps(batch: float, noise_scale: float) -> float:
    """S(B) / S_min."""
    return 1 + noise_scale / batch


def recommend(noise_scale: float, throughput: dict[int, float], source: str = "") -> Recommendation | None:
    """Candidates = the global batches with a measured throughput (samples/s); None without a usable B_noise."""
    usable = {b: r for b, r in throughput.items() if b > 0 and r and r > 0}
    if not usable or not (noise_scale and noise_scale > 0 and math.isfinite(noise_scale)):
        return None
    raw = {b: predicted_samples(b, noise_scale) / r for b, r in usable.items()}
    best = min(raw.values())
    candidates = [Candidate(b, usable[b], predicted_samples(b, noise_scale), predicted_steps(b, noise_scale),
                            raw[b] / best) for b in sorted(usable)]
    return Recommendation(noise_scale, candidates, source)


# ---------------------------------------------------------------------------------------------
# The prediction held against what a sweep measured


@dataclass(frozen=True)
class Held:
    """One global batch: the best time to the target a sweep measured there, and what B_noise predicts."""

    global_batch: int
    trial_id: str  # the batch's fastest trial to the target
    measured_s: float  # its time_to_target_s (training seconds)
    measured_samples: float  # its samples_to_target
    predicted_samples: float  # E_min (1 + B / B_noise), E_min fitted to all the batches (held_against)
    predicted_s: float  # predicted_samples at the trial's own pace (measured_s / measured_samples)

    @property
    def error(self) -> float:
        """predicted ÷ measured − 1 (the same for samples and seconds: one pace)."""
        return self.predicted_s / self.measured_s - 1


def held_against(noise_scale: float, measured: dict[int, tuple[str, float, float]]) -> list[Held]:
    """The model E(B) = E_min (1 + B/B_noise) against a sweep's best measured (trial id, seconds, samples) to a
    target per global batch: E_min is the one number fitted (the geometric mean of E(B) / (1 + B/B_noise) over
    the batches), so what is left, the error per batch, is how well the model's *shape* across batches holds.
    Needs two batches at least (with one, E_min fits it exactly); [] otherwise."""
    usable = {b: m for b, m in measured.items() if m[1] > 0 and m[2] > 0}
    if len(usable) < 2 or not (noise_scale and noise_scale > 0 and math.isfinite(noise_scale)):
        return []
    logs = [math.log(samples / predicted_samples(b, noise_scale)) for b, (_, _, samples) in usable.items()]
    e_min = math.exp(sum(logs) / len(logs))
    rows = []
    for b in sorted(usable):
        trial_id, seconds, samples = usable[b]
        predicted = e_min * predicted_samples(b, noise_scale)
        rows.append(Held(b, trial_id, seconds, samples, predicted, predicted * seconds / samples))
    return rows
