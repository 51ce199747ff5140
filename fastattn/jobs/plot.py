"""Draw each op's achieved rate against the machine's roofs (matplotlib, optional)."""
from __future__ import annotations

from . import Result
from .roofs import BUFFER_BYTES, Roofs, size_class


def working_set(result: Result) -> float:
    """Bytes one fast call reads and writes (from its GB/s and its time)."""
    return result.rate * 1e6 * result.fast_ms if result.rate_unit == "GB/s" else 0.0


def cache_limit(roofs: Roofs) -> int:
    """Working sets up to this size stay in cache between the timing's calls: the last-level cache's size, or
    the in-cache copy's working set where that is unknown."""
    return roofs.last_level_cache_bytes or roofs.cache_bytes


def roof_for(result: Result, roofs: Roofs) -> tuple[float, str]:
    """The roof an op's rate is judged against: FMA peak for GFLOP/s; for GB/s, when the op's working set fits
    the last-level cache (the timing repeats calls on the same buffers, which then never leave the cache, so DRAM
    bandwidth is no bound for them), a copy of a working set of its size class on the same threads (``copy_at``;
    the fixed in-cache copy where none was measured), else the DRAM copy bandwidth. An op below the parallel size
    runs on one thread: against a one-thread copy of a working set of that size."""
    if result.rate_unit == "GFLOP/s":
        return roofs.fma_gflops, "FMA peak"
    if not result.extra.get("parallel", True) and roofs.serial_copy_gbs:
        return roofs.serial_copy_gbs, "1-thread in-cache copy"
    if working_set(result) <= cache_limit(roofs):
        size = size_class(working_set(result))
        if size in roofs.copy_at:
            return roofs.copy_at[size], f"copy of {_mib(size)}"
        if roofs.cache_copy_gbs:
            return roofs.cache_copy_gbs, "in-cache copy"
    return roofs.copy_gbs, "DRAM copy"


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.0f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.0f} KiB"


#: Bar colours by roof.
COLOURS = {"FMA peak": "tab:orange", "DRAM copy": "tab:blue", "in-cache copy": "tab:green",
           "1-thread in-cache copy": "tab:olive"}


def plot(results: list[Result], roofs_by_threads: dict[int, Roofs], path: str) -> None:
    """One horizontal bar per (op, shape, path, threads): achieved rate as a share of its roof (``roof_for``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise SystemExit("--plot needs matplotlib: python -m pip install matplotlib") from error

    labels, shares, notes, colours = [], [], [], []
    for r in results:
        if r.skipped:
            continue
        roof, roof_name = roof_for(r, roofs_by_threads[r.threads])
        labels.append(f"{r.op} {r.shape} [{r.path}] {r.threads}T")
        shares.append(100.0 * r.rate / roof)
        size = f", {_mib(working_set(r))} per call" if r.rate_unit == "GB/s" else ""
        notes.append(f"{r.rate:.1f} {r.rate_unit} of {roof:.0f} ({roof_name}{size})")
        colours.append(COLOURS.get(roof_name, COLOURS["in-cache copy"]))  # "copy of N MiB": in cache
    height = 0.42 * len(labels) + 2.6
    fig, ax = plt.subplots(figsize=(11, height))
    y = range(len(labels))
    ax.barh(y, shares, color=colours)
    for i, (share, note) in enumerate(zip(shares, notes)):
        ax.text(share + 1, i, note, va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(100, color="black", lw=0.8)
    ax.set_xlim(0, max(120, max(shares, default=0) * 1.6))
    ax.set_xlabel("% of the op's roof (100%: the roof)")
    any_roofs = next(iter(roofs_by_threads.values()))
    limit = cache_limit(any_roofs)
    fig.legend(handles=[
        Patch(color=COLOURS["DRAM copy"], label=f"GB/s, working set above {_mib(limit)}: against the copy "
                                                 f"bandwidth of DRAM ({_mib(2 * BUFFER_BYTES)} copied)"),
        Patch(color=COLOURS["in-cache copy"],
              label=f"GB/s, working set within {_mib(limit)} (the last-level cache"
                    f"{'' if any_roofs.last_level_cache_bytes else ', size unknown: the in-cache copy size'}): the "
                    f"timing repeats calls on the same buffers,\nso they stay in cache and DRAM bandwidth does not "
                    f"bound them: against a copy of a working set of the same size (the next power of 2) on the "
                    f"same threads;\nan op in place writes the lines it reads, which a copy to other lines cannot, "
                    f"and may pass its roof"),
        Patch(color=COLOURS["1-thread in-cache copy"],
              label=f"GB/s of an op below the parallel size (it runs on one thread): against a one-thread copy of "
                    f"a {_mib(any_roofs.serial_bytes)} working set"),
        Patch(color=COLOURS["FMA peak"], label="GFLOP/s: against the float32 FMA peak")],
        loc="lower left", fontsize=7, frameon=False)
    threads = ", ".join(f"{t}T: copy {rf.copy_gbs:.0f} GB/s (DRAM), {rf.cache_copy_gbs:.0f} GB/s (in cache; 1 thread "
                        f"{rf.serial_copy_gbs:.0f}), read {rf.read_gbs:.0f} GB/s, FMA {rf.fma_gflops:.0f} GFLOP/s"
                        for t, rf in sorted(roofs_by_threads.items()))
    ax.set_title(f"fastattn: achieved rate per op against measured roofs\n{threads}", fontsize=9)
    fig.tight_layout(rect=(0, 1.0 / height, 1, 1))  # the legend's lines below the axes
    fig.savefig(path, dpi=110)
    plt.close(fig)
