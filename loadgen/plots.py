"""PNG plots of a run or a comparison: TTFT CDF per policy, per-replica in-flight over time, hit ratio per policy.

matplotlib comes with the bench extra (``pip install 'kvgate[bench]'``): without it, no plots and a one-line note.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.loadgen.report import inflight_timeline
from kvgate.loadgen.runner import RequestRecord


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(out_dir: Path, runs: dict[str, Sequence[RequestRecord]], summaries: dict[str, dict[str, Any]],
                replicas: dict[str, Sequence[str]], repeats: int = 1) -> list[Path]:
    """Write the PNGs into ``out_dir``; return their paths (empty if matplotlib is missing). With several
    ``repeats``, ``runs`` are the first repeat's records (the in-flight timelines of different repeats cannot be
    overlaid) and ``summaries`` the medians across repeats; each title says which it shows."""
    if not plots_available():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, records in runs.items():
        ttft = sorted(r.ttft_s * 1000 for r in records if r.ok and r.ttft_s is not None)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF" + _first_of(repeats))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir / "ttft_cdf.png"))

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.2 * len(runs)), sharex=True, squeeze=False)
    for ax, (name, records) in zip(axes[:, 0], runs.items()):
        routed = [(r.replica, r.start_s, r.end_s) for r in records if r.ok and r.replica]
        times, series = inflight_timeline(routed, replicas.get(name, []))
        if not times:
            ax.text(0.5, 0.5, "no x-kvgate-replica header in responses", ha="center", transform=ax.transAxes)
        for replica, counts in sorted(series.items()):
            if counts:
                ax.plot(times, counts, linewidth=0.8, label=replica)
        ax.set_title(f"{name}: in-flight requests per replica{_first_of(repeats)}", fontsize=9)
        ax.set_ylabel("in flight")
    axes[-1, 0].set_xlabel("time since start (s)")
    if axes[0, 0].get_legend_handles_labels()[0]:
        axes[0, 0].legend(fontsize=6, ncol=4, loc="upper right")
    written.append(_save(fig, out_dir / "inflight_per_replica.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(summaries)
    ax.bar(names, [summaries[n].get("hit_ratio") or 0.0 for n in names], label="measured")
    oracle = max((summaries[n].get("oracle_hit_ratio") or 0.0 for n in names), default=0.0)
    ax.axhline(oracle, color="black", linestyle="--", label=f"oracle {oracle:.2f}")
    ax.set_ylim(0, 1)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("Cache hit ratio per policy" + (f" (median of {repeats} repeats)" if repeats > 1 else ""))
    ax.legend()
    written.append(_save(fig, out_dir / "hit_ratio.png"))
    return written


def _first_of(repeats: int) -> str:
    return f" (repeat 1 of {repeats})" if repeats > 1 else ""


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
