"""Planted slowdowns that cost what they claim on this machine.

A self-test that plants "3% slower" must make the call 3% slower *here*, on the device the gate
times, in the way the gate times it:

* CPU: a busy wait on the calling thread right after the wrapped call, of ``fraction`` times
  the duration that very call just took (``perf_counter_ns``). The planted cost follows the
  machine's noise and the call's size call by call, so the ratio of a slowed call to the same
  call unslowed is ``1 + fraction`` whatever the load.
* CUDA: the gates time GPU work with events on the current stream, so a host-side wait would be
  invisible (or visible only by accident). The slowdown is a spin kernel
  (``torch.cuda._sleep``) enqueued on the same stream after the call, of ``fraction`` times the
  call's GPU time. That time is measured once per call signature (shapes and dtypes) with events
  (median of three synchronized runs), and the spin kernel's cycles per second once per device,
  so a timed call is never synchronized by the self-test.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

_CALIBRATION_RUNS = 3
_SPIN_PROBE_CYCLES = 20_000_000
_cycles_per_s: dict[int, float] = {}


def busy_wait(seconds: float) -> None:
    """Spin the calling thread for ``seconds`` (a sleep would give the core to the other side)."""
    if seconds <= 0:
        return
    end = time.perf_counter_ns() + int(seconds * 1e9)
    while time.perf_counter_ns() < end:
        pass


@functools.cache
def wait_overhead_s() -> float:
    """What a busy wait costs beyond the time asked of it (its clock reads, the overshoot of its
    last read), measured once per process: a wait of 1 ns against a wait of 0, median of 5
    batches of 200. A planted CPU slowdown asks for that much less, so the slowed call costs
    ``1 + fraction`` times the call rather than that plus the wait's own overhead."""
    per: list[float] = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(200):
            busy_wait(1e-9)
        t1 = time.perf_counter_ns()
        for _ in range(200):
            busy_wait(0.0)
        t2 = time.perf_counter_ns()
        per.append(((t1 - t0) - (t2 - t1)) / 200 / 1e9 - 1e-9)
    return max(0.0, statistics.median(per))


def _device_index(device: Any) -> int:
    import torch

    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


def spin_cycles_per_s(device: Any) -> float:
    """Clock cycles per second of ``torch.cuda._sleep`` on ``device`` (measured once)."""
    import torch

    index = _device_index(device)
    if index not in _cycles_per_s:
        with torch.cuda.device(index):
            torch.cuda._sleep(_SPIN_PROBE_CYCLES // 10)  # first launch pays module loading
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(_SPIN_PROBE_CYCLES)
            end.record()
            end.synchronize()
        _cycles_per_s[index] = _SPIN_PROBE_CYCLES / (start.elapsed_time(end) / 1e3)
    return _cycles_per_s[index]


def gpu_spin(seconds: float, device: Any) -> None:
    """Enqueue a spin kernel of ``seconds`` of GPU time on ``device``'s current stream."""
    import torch

    if seconds <= 0:
        return
    cycles = int(seconds * spin_cycles_per_s(device))
    if cycles > 0:
        with torch.cuda.device(_device_index(device)):
            torch.cuda._sleep(cycles)


def gpu_seconds(call: Callable[[], Any], device: Any) -> float:
    """GPU seconds of ``call`` on ``device``: the median of three runs, events around each."""
    import torch

    times = []
    with torch.cuda.device(_device_index(device)):
        for _ in range(_CALIBRATION_RUNS):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class Slowdown:
    """``fraction`` extra time on every call run through :meth:`run`, calibrated as above.

    ``fraction = 0`` is the same host path with no wait: every planted route runs through one,
    so a slowed route and the route it is compared with (its copy, the pass-through verify
    route) pay the same clock reads and calls, and differ by the wait alone. At the quick size
    a verify step is tens of microseconds, and that bookkeeping on one side only made a planted
    2% read as 4-17%.
    """

    def __init__(self, fraction: float) -> None:
        if not 0 <= fraction < 10:
            raise ValueError(f"a planted slowdown must be a fraction in [0, 10), got {fraction}")
        self.fraction = float(fraction)
        self._gpu_time: dict[Hashable, float] = {}
        # measured at the first slowed call (a gate's untimed warm-up), not here: routes are
        # built while timing workers start side by side, and a wait's overhead measured on a
        # contended core is overstated, which shrank a planted 2% to about 0.6%
        self._overhead_s: float | None = None if self.fraction else 0.0

    def run(self, call: Callable[[], Any], *, device: Any, signature: Hashable) -> Any:
        """``call()`` followed by ``fraction`` times its cost on ``device``."""
        if getattr(device, "type", device) == "cuda":
            if not self.fraction:
                return call()  # events time the GPU: no host bookkeeping to match
            if signature not in self._gpu_time:
                # calibration runs are untimed by construction: the gate has not started its
                # timer when a new signature first arrives (its warm-up calls come first)
                self._gpu_time[signature] = gpu_seconds(call, device)
            result = call()
            gpu_spin(self.fraction * self._gpu_time[signature], device)
            return result
        if self._overhead_s is None:
            self._overhead_s = wait_overhead_s()
        start = time.perf_counter_ns()
        result = call()
        busy_wait(self.fraction * (time.perf_counter_ns() - start) / 1e9 - self._overhead_s)
        return result

    def __repr__(self) -> str:
        return f"<Slowdown +{self.fraction:.1%}>"
