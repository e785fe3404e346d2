"""Expert-parallel load balancing (EPLB): where each MoE layer's experts live, from their load.

Pure functions, no torch.distributed: counts in, placement out. A layer has E logical experts
(the model's) and P = E + R physical slots (R redundant), P / N on each of the N expert-parallel
ranks; slot p is on rank p // (P / N). A placement is, per layer, the logical expert of each slot.

`rebalance` works like vLLM's `rebalance_experts` (a greedy of its own here):
1. replicate: each of the R extra slots goes to the expert with the highest load per replica
   now (ties: the lower id), an expert never holding more replicas than there are ranks;
2. pack: the replicas, heaviest first (load / replicas each), each onto the least-loaded rank
   that has a free slot and no replica of that expert yet;
3. keep: on each rank, an expert it held before keeps its old slot, so fewer weights move;
4. pay: a layer whose busiest rank the new placement would not relieve by at least `MIN_GAIN`
   (each expert's load split evenly over its replicas) keeps its old placement, so a steady load
   moves nothing after its first rebalance (a greedy from counts that barely differ would
   otherwise reshuffle many experts each time: about 200 of 544 slots per rebalance, measured
   on two H100s).
Every rank runs this on the same all-reduced counts and gets the same placement.
"""

from __future__ import annotations

from collections.abc import Sequence

Placement = tuple[tuple[int, ...], ...]  # [L][P]: the logical expert in each physical slot
MIN_GAIN = 0.03  # the busiest rank's load a layer's new placement must save to be applied


def check_eplb(num_experts: int, num_redundant: int, num_ranks: int) -> None:
    """ValueError (naming the counts and valid values) when EPLB cannot place these experts."""
    if num_experts == 0:
        raise ValueError(
            "enable_eplb balances the experts of a mixture-of-experts model; this model is dense "
            "(no experts)."
        )
    slots = num_experts + num_redundant
    if slots % num_ranks:
        first = -num_experts % num_ranks
        valid = ", ".join(str(first + i * num_ranks) for i in range(4))
        raise ValueError(
            f"EPLB needs the {num_experts} experts + num_redundant_experts={num_redundant} = "
            f"{slots} physical experts to divide evenly over the {num_ranks} expert-parallel "
            f"ranks; valid num_redundant_experts: {valid}, ..."
        )


def initial_placement(num_layers: int, num_experts: int, num_physical: int) -> Placement:
    """Before any load is known: experts in order, then the redundant slots from expert 0 on."""
    layer = tuple(p % num_experts for p in range(num_physical))
    return (layer,) * num_layers


def rebalance(load: Sequence[Sequence[int]], old: Placement, num_ranks: int) -> Placement:
    """A placement for `load` ([L][E] tokens per logical expert), keeping slots of `old`."""
    return tuple(
        _rebalance_layer(list(counts), list(prev), num_ranks)
        for counts, prev in zip(load, old, strict=True)
    )


def _rebalance_layer(load: list[int], old: list[int], num_ranks: int) -> tuple[int, ...]:
    num_experts, num_physical = len(load), len(old)
    per_rank = num_physical // num_ranks
    replicas = _replicate(load, num_physical, num_ranks)
    # One item per replica: (load it takes, expert). Heaviest first; ties by expert id.
    items = [(load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])]
    items.sort(key=lambda item: (-item[0], item[1]))
    rank_load = [0.0] * num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for weight, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < per_rank]
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += weight
    placement: list[int] = []
    for r in range(num_ranks):
        placement.extend(_keep_slots(held[r], old[r * per_rank : (r + 1) * per_rank]))
    if busiest_rank_load(load, placement, num_ranks) > (1 - MIN_GAIN) * busiest_rank_load(
        load, old, num_ranks
    ):
        return tuple(old)
    return tuple(placement)


def busiest_rank_load(load: Sequence[int], placement: Sequence[int], num_ranks: int) -> float:
    """The most tokens one rank computes for this layer if each expert's `load` splits evenly
    over its replicas in `placement`."""
    per_slot = [load[e] / placement.count(e) for e in placement]
    return max(tokens_per_rank(per_slot, num_ranks))


def _replicate(load: list[int], num_physical: int, num_ranks: int) -> list[int]:
    """Replicas of each expert: one each, then the extra slots to the hottest per replica."""
    replicas = [1] * len(load)
    for _ in range(num_physical - len(load)):
        candidates = [e for e in range(len(load)) if replicas[e] < num_ranks] or range(len(load))
        best = max(candidates, key=lambda e: (load[e] / replicas[e], -e))
        replicas[best] += 1
    return replicas


def _keep_slots(experts: list[int], old_slots: list[int]) -> list[int]:
    """`experts` (a rank's new set, with repeats) laid out in its slots: each one the rank held
    before stays in its old slot, the rest fill the free slots in order."""
    slots: list[int | None] = [None] * len(old_slots)
    rest = list(experts)
    for i, e in enumerate(old_slots):
        if e in rest:
            slots[i] = e
            rest.remove(e)
    fill = iter(sorted(rest))
    return [e if e is not None else next(fill) for e in slots]


def tokens_per_rank(physical_tokens: Sequence[float], num_ranks: int) -> list[float]:
    """[P] tokens per physical slot -> [N] tokens per rank."""
    per_rank = len(physical_tokens) // num_ranks
    return [sum(physical_tokens[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)]


def imbalance(physical_tokens: Sequence[Sequence[int]], num_ranks: int) -> float:
    """max / mean tokens per rank, summed over layers ([L][P] tokens per slot): how much longer
    the expert computation takes than with perfect balance (1.0: balanced; nothing counted:
    1.0)."""
    worst = mean = 0.0
    for layer in physical_tokens:
        ranks = tokens_per_rank(layer, num_ranks)
        worst += max(ranks)
        mean += sum(ranks) / num_ranks
    return worst / mean if mean else 1.0


def moved_slots(old: Placement, new: Placement) -> int:
    """Physical slots whose expert changes (each one's weights are copied or received)."""
    pairs = zip(old, new, strict=True)
    return sum(a != b for prev, nxt in pairs for a, b in zip(prev, nxt, strict=True))
