"""What the benchmark sections share: interleaved timing and bytes per element."""
from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable

import torch


def bytes_per_elem(pdtype: torch.dtype, sdtype: torch.dtype, states: int = 2) -> int:
    """Bytes one step moves per element: param read+write and grad read in the param dtype, each
    state read+write in the state dtype (Adam: 2 states; Lion, Adagrad: 1)."""
    return 3 * pdtype.itemsize + 2 * states * sdtype.itemsize


def interleaved_rounds(contenders: dict[str, Callable[[], None]], repeats: int,
                       sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each call of each contender, round by round, run one call each in turn so that
    drifts of clock, temperature and neighbours hit all of them alike; ``sync`` waits for a device.
    Entry ``r`` of every list comes from the same round, so ratios can be taken round by round.

    Each round runs the contenders in a fresh order, a permutation from a fixed seed (so a run is
    repeatable): a contender that follows one which frees gigabytes of temporaries (torch's
    foreach) pays for the kernel's page work, or finds another's data in the cache, and over the
    rounds each should follow each other about equally often. (A rotation would not do that: it
    keeps every contender's predecessor the same in all but one round in n.)"""
    for fn in contenders.values():  # warm-up: pipelines, allocator, first-step state
        fn()
    sync()
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    orders = random.Random(0)
    for _ in range(repeats):
        order = names[:]
        orders.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            contenders[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def interleaved(contenders: dict[str, Callable[[], None]], repeats: int,
                sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds per call of each contender over ``repeats`` interleaved rounds."""
    return {name: statistics.median(ts) for name, ts in interleaved_rounds(contenders, repeats, sync).items()}


def ratio_spread(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """Round-by-round ratios ``numerator[r] / denominator[r]``: (median, lower quartile, upper
    quartile). The quartiles say how much one round's ratio moves on this machine. With fewer
    than 4 rounds there are no quartiles: the lowest and the highest ratio come instead
    (``bench.spread_note`` says so where they are printed)."""
    ratios = sorted(a / b for a, b in zip(numerator, denominator))
    if len(ratios) < 4:
        return statistics.median(ratios), ratios[0], ratios[-1]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), q1, q3


def alternated_best(switch: Callable[[Any], None], call: Callable[[], None], settings: tuple = (False, True),
                    rounds: int = 2, calls: int = 20, warmup: int = 5) -> dict[Any, float]:
    """Fastest seconds of one ``call`` under each setting of ``switch`` (a toggle such as
    ``_cpu.set_bf16_pairs``), the settings alternated ``rounds`` times, each time after ``warmup``
    untimed calls: an on/off comparison of the same kernel on the same data in one process. The
    caller restores the default setting."""
    best: dict[Any, float] = {}
    for _ in range(rounds):
        for setting in settings:
            switch(setting)
            for _ in range(warmup):
                call()
            for _ in range(calls):
                t0 = time.perf_counter()
                call()
                best[setting] = min(best.get(setting, float("inf")), time.perf_counter() - t0)
    return best

