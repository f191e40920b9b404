"""Capturing timed calls in CUDA graphs (docs/gates.md, "Timing protocol").

Why: a call whose GPU work is shorter than the host's work of launching it is timed as the
host's dispatch. Two routes that launch the same kernels then differ by whatever the host did
meanwhile, and that spread decides the interval instead of the kernels. A replay of a captured
graph is one launch, so the events around it time the GPU's work. Deployments replay their
M <= 8 verify steps this way; the prefill gate also captures the small reference model's whole
cold prefill on CUDA, where its eager form is thousands of launches of small kernels.

The graphs of one capture share one memory pool: they replay one after the other, never
together, and each reads only its own inputs, so one pool holds the temporaries of both sides
of a pair (a 64K-token prefill's are gigabytes) and their outputs, which stay alive. A capture
needs the calls to have run before: lazy handles, workspaces and first-call costs
must happen outside it. So each call runs ``warmup`` times on a side stream first. A call that
cannot be captured (a host sync, a host-to-device copy) raises :class:`CaptureRefused` with
the reason, and the device is left usable: the caller times it eagerly and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class CaptureRefused(RuntimeError):
    """A call could not be captured in a CUDA graph; the message says why."""


@dataclass
class Captured:
    """Graphs of calls captured together: ``replays[i]`` launches call i's graph, and
    ``outputs[i]`` is what call i returned during the capture (its tensors are rewritten by
    every replay). ``warm_s[i]`` is the wall time of call i's last eager warm-up run, device
    synchronized: the eager cost beside the replay's."""

    graphs: list[Any]
    outputs: list[Any]
    warm_s: list[float]

    @property
    def replays(self) -> list[Callable[[], None]]:
        return [graph.replay for graph in self.graphs]


def capture(calls: Sequence[Callable[[], Any]], device: torch.device | str, *,
            warmup: int) -> Captured:
    """Each of ``calls`` captured in its own CUDA graph on ``device``, after ``warmup`` eager
    runs of each on a side stream (at least one); CaptureRefused when any call cannot be."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise CaptureRefused(f"CUDA graphs need a CUDA device, got {dev}")
    graphs: list[Any] = []
    outputs: list[Any] = []
    warm_s: list[float] = []
    try:
        with torch.cuda.device(dev):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for fn in calls:
                    seconds = 0.0
                    for _ in range(max(1, warmup)):
                        began = time.perf_counter()
                        fn()
                        torch.cuda.synchronize(dev)
                        seconds = time.perf_counter() - began
                    warm_s.append(seconds)
            torch.cuda.current_stream().wait_stream(side)
            # what the warm-up runs left cached goes back to the device first: a graph's
            # memory is a pool of its own, and on one GPU every timing worker captures
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            pool = torch.cuda.graph_pool_handle()
            for fn in calls:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs.append(fn())
                graphs.append(graph)
            torch.cuda.synchronize(dev)
    except Exception as exc:  # noqa: BLE001 - any capture failure means: time it eagerly
        torch.cuda.synchronize(dev)
        graphs.clear()
        outputs.clear()
        clear_capturing_rng(dev)
        release(dev)
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CaptureRefused(f"{type(exc).__name__}: {first}") from exc
    return Captured(graphs, outputs, warm_s)


def clear_capturing_rng(device: torch.device) -> None:
    """Give the device's default generator a fresh state with the same seed and offset.

    torch ends a capture's bookkeeping of the generator (its capture epilogue) only after the
    capture itself ended well; a capture refused mid-way (a host sync in the step) leaves the
    generator marked as capturing, and every later random op on the device, in the eager
    timing that follows or in the next gate's job of the same worker, raises "Offset increment
    outside graph capture encountered unexpectedly". A cloned state is not marked.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    generator.graphsafe_set_state(generator.clone_state())


def release(device: torch.device | str, *, down_to: int | None = None) -> None:
    """Give this process's unused device memory back (graphs dropped, cache emptied), so the
    other timing workers on the same GPU can build and capture theirs. A no-op on the CPU.

    A graph held in a reference cycle keeps its pool until a full collection, and a collection
    costs tens of milliseconds in a process that imported torch, paid after every job a worker
    times while the others wait (an H100 verify-step job is 0.25 s of timed rounds and about
    0.1 s besides). With ``down_to`` (the
    bytes reserved before the released work was built) the cache is emptied first and the
    collection runs only when that did not get back there."""
    import gc

    dev = torch.device(device)
    if dev.type != "cuda":
        return
    if down_to is not None:
        torch.cuda.empty_cache()
        if torch.cuda.memory_reserved(dev) <= down_to:
            return
    gc.collect()
    torch.cuda.empty_cache()


def reserved(device: torch.device | str) -> int | None:
    """Bytes this process's caching allocator holds on ``device`` (None on the CPU): what a
    later ``release(down_to=...)`` must get back to."""
    dev = torch.device(device)
    return torch.cuda.memory_reserved(dev) if dev.type == "cuda" else None
