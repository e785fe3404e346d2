"""Token sampling for one step: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh.engine.parallel.comm import host_to_device
from pdmesh.sampling_params import SamplingParams

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing by a smaller one
# overflows float32 logits to inf, and the softmax of a row of infs is NaN.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, vocab size where off
    top_p: torch.Tensor  # [S] float32, 1 where off
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_greedy: bool
    need_filter: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        temps = [p.temperature if p.temperature >= MIN_TEMPERATURE else 0.0 for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        # Pinned, non-blocking copies: a copy from pageable memory would wait for the step
        # already queued on the device (async scheduling launches this one behind it).
        return cls(
            temperature=host_to_device(torch.tensor(temps, dtype=torch.float32), device),
            top_k=host_to_device(torch.tensor(top_k, dtype=torch.int64), device),
            top_p=host_to_device(torch.tensor(top_p, dtype=torch.float32), device),
            generators=generators,
            all_greedy=all(t == 0 for t in temps),  # a seeded row still draws (see _sample)
            any_greedy=any(t == 0 for t in temps),
            need_filter=any(k < vocab_size for k in top_k) or any(p < 1 for p in top_p),
        )


class Sampler:
    """Samples one token per row of logits. Seeded rows draw from their own generator, so a
    seeded request gives the same tokens whatever else is in the batch."""

    def __init__(self, seed: int = 0) -> None:
        self._generator: torch.Generator | None = None
        self._seed = seed

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # logits: [S, V] -> tokens: [S] int64
        logits = logits.float()
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        temps = batch.temperature
        scaled = logits / torch.where(temps > 0, temps, 1.0).unsqueeze(1)
        if batch.need_filter:
            scaled = filter_top_k_top_p(scaled, batch.top_k, batch.top_p)
        probs = torch.softmax(scaled, dim=-1)
        sampled = self._sample(probs, batch.generators)
        if not batch.any_greedy:
            return sampled
        return torch.where(temps > 0, sampled, logits.argmax(dim=-1))

    @staticmethod
    def skip_draw(generator: torch.Generator) -> None:
        """Advance a seeded request's generator past one sampled token (drawn elsewhere)."""
        _uniform(1, generator, torch.device("cpu"))

    def _sample(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        # Inverse transform: one uniform u per row picks the first token whose cumulative
        # probability exceeds u (times the row's total, which rounding keeps near 1). One draw
        # per row, from the row's own generator when seeded, keeps seeded rows independent of
        # their neighbours. (An exponential race, argmax(p / E) with E ~ Exp(1), draws from the
        # same distribution but needs a draw per vocabulary entry: 10 ms a step for 8 rows of a
        # 49k vocabulary on a 2-core CPU, against 0.3 ms here.)
        if self._generator is None:
            self._generator = torch.Generator(device=probs.device).manual_seed(self._seed)
        rows = probs.shape[0]
        seeded = [(row, gen) for row, gen in enumerate(generators) if gen is not None]
        if len(seeded) < rows:
            u = _uniform(rows, self._generator, probs.device)
        else:
            u = torch.empty(rows, dtype=torch.float64, device=probs.device)
        if seeded:
            # Per-request generators live on the CPU so seeds mean the same on every device.
            # (A list index would be copied to the device from pageable memory: a stream sync.)
            draws = torch.cat([_uniform(1, gen, torch.device("cpu")) for _, gen in seeded])
            index = host_to_device(torch.tensor([row for row, _ in seeded]), probs.device)
            u.index_copy_(0, index, host_to_device(draws, probs.device))
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [S, V]
        target = (u * cdf[:, -1]).unsqueeze(1)  # [S, 1]
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
        return tokens.clamp_(max=probs.shape[-1] - 1)


def _uniform(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """n draws from U[0, 1), float64, from `generator` (on `device`)."""
    return torch.rand(n, generator=generator, dtype=torch.float64, device=device)


# How many of a row's largest logits its top-k / top-p filter is tried on (CPU), in turn: when
# each row's kept tokens are among them, a partial sort (topk) replaces the sort of the whole
# vocabulary. 256 hold a peaked distribution's top-p; a flat one (a random prompt's) may need
# thousands.
TOP_CANDIDATES = (256, 4096)


def filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    # logits: [S, V]; masked entries become -inf.
    if logits.device.type == "cpu":  # on a GPU the check below would wait for the device
        for candidates in TOP_CANDIDATES:
            filtered = _filter_among_candidates(logits, top_k, top_p, candidates)
            if filtered is not None:
                return filtered
    return filter_top_k_top_p_sorted(logits, top_k, top_p)


def _filter_among_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int
) -> torch.Tensor | None:
    """`filter_top_k_top_p_sorted`'s result from each row's largest `candidates` logits (or its
    top_k, if larger), or None when some row may keep a token outside them: a row whose top_k
    is off and whose candidates hold less than its top_p of the probability. 8 rows of a 49k
    vocabulary on a 2-core CPU: 1.6 ms (256 candidates) against 20 ms for the sort."""
    vocab = logits.shape[-1]
    limited = top_k < vocab  # [S]
    widest = int(top_k[limited].max()) if bool(limited.any()) else 0
    k = min(vocab, max(candidates, widest))
    values, order = logits.topk(k, dim=-1)  # [S, k], descending
    mask = torch.arange(k).unsqueeze(0) >= top_k.unsqueeze(1)
    values = values.masked_fill(mask, float("-inf"))
    # The softmax's denominator: over the row's top-k, or over its whole row when k is off.
    log_total = torch.where(limited, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - log_total.unsqueeze(1)).exp()
    if not bool((limited | (probs.sum(dim=-1) >= top_p)).all()):
        return None
    return _mask_top_p(values, probs, mask, top_p, order, logits)


def filter_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The filters over the whole vocabulary, sorted once for both."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    mask = ranks >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    return _mask_top_p(sorted_logits, probs, mask, top_p, order, logits)


def _mask_top_p(
    values: torch.Tensor,  # [S, k]: a row's largest logits, descending, top-k applied (-inf)
    probs: torch.Tensor,  # [S, k]: their probabilities (after top-k)
    mask: torch.Tensor,  # [S, k]: the top-k filter's mask
    top_p: torch.Tensor,  # [S]
    order: torch.Tensor,  # [S, k]: their columns in `logits`
    logits: torch.Tensor,  # [S, V]
) -> torch.Tensor:
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
    # already does. The first token always stays. Columns outside `order` are dropped.
    mass_before = probs.cumsum(dim=-1) - probs
    mask = mask | (mass_before >= top_p.unsqueeze(1))
    mask[:, 0] = False
    kept = values.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, kept)
