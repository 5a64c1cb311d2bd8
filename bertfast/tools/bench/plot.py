"""`bertfast bench --plot F.png`: a bar chart of each row's speedup over the baseline (hf-sdpa, same
dtype), one panel per dtype, one bar group per workload, one bar per provider. It needs matplotlib,
an optional extra (`pip install 'bertfast[plot]'`); without it `plot` raises `PlotUnavailable` naming
the extra.
"""

from __future__ import annotations

from bertfast.tools.bench.providers import BASELINE
from bertfast.tools.bench.runner import Row

EXTRA = "plot"  # pyproject.toml's optional-dependencies entry that installs matplotlib


class PlotUnavailable(ImportError):
    """matplotlib is not installed; the message says how to get it."""


def require():
    """matplotlib.pyplot (Agg backend); raises PlotUnavailable, naming the extra, when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed: pip install matplotlib "
                              f"(or pip install 'bertfast[{EXTRA}]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(rows: list[Row], path: str, title: str, baseline: str = BASELINE) -> None:
    """Write the speedup chart of `rows` to `path` (PNG). Raises PlotUnavailable without matplotlib and
    ValueError when no row has a speedup to show. baseline: the row the speedups are relative to."""
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    wls = list(dict.fromkeys(r.workload for r in rows))
    val = {(r.dtype, r.workload, r.provider): r.speedup_vs_hf_sdpa for r in rows if r.status == "ok"
           and r.speedup_vs_hf_sdpa is not None}
    # Providers with no timed row (skipped or failed everywhere) get no bar and no legend entry.
    provs = [p for p in dict.fromkeys(r.provider for r in rows)
             if p != baseline and any(k[2] == p for k in val)]
    if not val:
        raise ValueError(f"nothing to plot: no row has a speedup vs {baseline} (is {baseline} among the providers?)")
    plt = require()
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(max(8, 1.6 * len(wls)), 3.6 * len(dtypes)), squeeze=False)
    width = 0.8 / max(1, len(provs))
    for ax, d in zip(axes[:, 0], dtypes):
        for j, p in enumerate(provs):
            values = [val.get((d, w, p)) for w in wls]
            xs = [i + (j - (len(provs) - 1) / 2) * width for i in range(len(wls))]
            bars = ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=p)
            for b, v in zip(bars, values):
                if v is not None:
                    ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(wls)), wls)
        ax.set_ylabel(f"speedup vs {baseline} ({d})")
        ax.legend(fontsize=8)
    axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
