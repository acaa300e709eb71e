"""The attention choice times both sides at one thread (CPU time at many threads counts spinning threads)."""

from __future__ import annotations

import torch

from torchnitro.autotune.recipes._native_attention import _time


def test_both_sides_are_timed_at_one_thread_and_the_count_is_restored():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: dict[str, list[int]] = {"native": [], "sdpa": []}
        t = _time({k: (lambda k=k: seen[k].append(torch.get_num_threads())) for k in seen}, 3)
        # at 2 threads before: [2, 2, 2] each (at 16 threads on an Intel Xeon SDPA's spinning OpenMP threads read
        # 62 ms per layer against 2-3 ms for the native kernel, the reverse of the one-thread order)
        assert seen == {"native": [1, 1, 1], "sdpa": [1, 1, 1]}
        assert set(t) == {"native", "sdpa"} and all(v >= 0 for v in t.values())
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_thread_count_is_restored_when_a_side_raises():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def boom():
            raise RuntimeError("kernel failed")

        try:
            _time({"native": boom}, 1)
        except RuntimeError:
            pass
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
