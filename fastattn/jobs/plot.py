"""Draw each op's achieved rate against the machine's roofs (matplotlib, optional)."""
from __future__ import annotations

from . import Result
from .roofs import Roofs


def roof_for(result: Result, roofs: Roofs) -> tuple[float, str]:
    """The roof an op's rate is judged against: FMA peak for GFLOP/s, DRAM copy bandwidth for GB/s."""
    if result.rate_unit == "GFLOP/s":
        return roofs.fma_gflops, "FMA peak"
    return roofs.copy_gbs, "copy bandwidth"


def plot(results: list[Result], roofs_by_threads: dict[int, Roofs], path: str) -> None:
    """One horizontal bar per (op, shape, path, threads): achieved rate as a share of its roof."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise SystemExit("--plot needs matplotlib: python -m pip install matplotlib") from error

    labels, shares, notes = [], [], []
    for r in results:
        roof, roof_name = roof_for(r, roofs_by_threads[r.threads])
        labels.append(f"{r.op} {r.shape} [{r.path}] {r.threads}T")
        shares.append(100.0 * r.rate / roof)
        notes.append(f"{r.rate:.1f} {r.rate_unit} of {roof:.0f} ({roof_name})")
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(labels) + 1.6))
    y = range(len(labels))
    ax.barh(y, shares, color=["tab:orange" if "FLOP" in n else "tab:blue" for n in notes])
    for i, (share, note) in enumerate(zip(shares, notes)):
        ax.text(share + 1, i, note, va="center", fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(100, color="black", lw=0.8)
    ax.set_xlim(0, max(120, max(shares, default=0) * 1.45))
    ax.set_xlabel("% of roof (blue: GB/s vs DRAM copy bandwidth, orange: GFLOP/s vs float32 FMA peak)")
    threads = ", ".join(f"{t}T: copy {rf.copy_gbs:.0f} GB/s, read {rf.read_gbs:.0f} GB/s, FMA {rf.fma_gflops:.0f} "
                        f"GFLOP/s" for t, rf in sorted(roofs_by_threads.items()))
    ax.set_title(f"fastattn: achieved rate per op against measured roofs\n{threads}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
