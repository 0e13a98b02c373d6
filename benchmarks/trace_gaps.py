"""Where a step's GPU waits on the host, from Chrome traces of profile_lora.py --trace (host and GPU).

    python benchmarks/trace_gaps.py TRACE.json[.gz] ...

For each trace: the GPU's busy and idle time over the step, the idle time before and after the
first backward operator (forward and backward phases), and for the compiled blocks (each
`Torch-Compiled Region` on the main thread) the medians of the host's time in the region, in its
compiled function, before that function calls its graph (the wrapper's unwrapping and checks), and
in the guards of the next call (`TorchDynamo Cache Lookup`).
"""

import gzip
import json
import statistics
import sys


def events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path) as file:
        return [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]


def gaps(kernels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, end) of each interval the GPU runs nothing, between its first and last kernel."""
    idle, end = [], kernels[0][0]
    for start, finish in kernels:
        if start > end:
            idle.append((end, start))
        end = max(end, finish)
    return idle


def inside(outer: dict, events_: list[dict], name: str) -> list[dict]:
    return [e for e in events_ if e["name"] == name and e["tid"] == outer["tid"] and outer["ts"] <= e["ts"] <= outer["ts"] + outer["dur"]]


def report(path: str) -> None:
    all_events = events(path)
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in all_events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    idle = gaps(kernels)
    span = kernels[-1][1] - kernels[0][0]
    idle_total = sum(b - a for a, b in idle)
    print(f"{path}: GPU span {span / 1e3:.1f} ms, busy {(span - idle_total) / 1e3:.1f} ms, idle {idle_total / 1e3:.1f} ms")
    host = [e for e in all_events if e.get("cat") in ("cpu_op", "user_annotation")]
    backward = min((e["ts"] for e in host if "Backward" in e["name"]), default=None)
    if backward is not None:
        before = sum(b - a for a, b in idle if b <= backward)
        print(f"  idle before the first backward operator {before / 1e3:.1f} ms, after it {(idle_total - before) / 1e3:.1f} ms")
    main = min(e["tid"] for e in host)
    regions = sorted((e for e in host if e["name"].startswith("Torch-Compiled Region") and e["tid"] == main), key=lambda e: e["ts"])
    if not regions:
        return
    functions = [inside(r, host, "CompiledFunction")[0] for r in regions]
    calls = [inside(f, host, "## Call CompiledFxGraph None ##")[0] for f in functions]
    lookups = sorted((e for e in host if e["name"] == "TorchDynamo Cache Lookup" and e["tid"] == main), key=lambda e: e["ts"])
    median = lambda values: statistics.median(values)
    print(f"  {len(regions)} compiled regions ({regions[0]['name']}), medians: region {median([r['dur'] for r in regions]):.0f} us, "
          f"compiled function {median([f['dur'] for f in functions]):.0f} us, before its graph call {median([c['ts'] - f['ts'] for f, c in zip(functions, calls)]):.0f} us, "
          f"guards {median([e['dur'] for e in lookups]):.0f} us")


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        report(trace)
