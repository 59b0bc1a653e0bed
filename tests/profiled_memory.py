"""Peak live CPU bytes while a function runs, from torch.profiler's memory events (shared by the
tests that hold memory against a bound: the weight stream, the estimate's activations)."""

from __future__ import annotations

import json
from pathlib import Path


def profiled_peak(fn, trace: str) -> tuple[int, list[dict]]:
    """(peak live CPU bytes above the start while ``fn`` runs, the trace's events).

    torch.profiler's ``[memory]`` events (chrome trace: address and signed size of every CPU
    allocation and free, from every thread the profiler covers) replayed in time order, each
    allocation live until its free; a later allocation at the same address proves an unrecorded
    free (gloo's worker threads sometimes drop a collective's input outside the profiler's scope),
    and a block never seen again counts as live to the end: a measurement can only overstate."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(trace)
    events = json.loads(Path(trace).read_text())["traceEvents"]
    live_bytes, peak, alive = 0, 0, {}
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        addr, n = e["args"]["Addr"], e["args"]["Bytes"]
        live_bytes -= alive.pop(addr, 0)  # a free, or a reuse that proves an unrecorded free
        if n > 0:
            alive[addr] = n
            live_bytes += n
        peak = max(peak, live_bytes)
    return peak, events
