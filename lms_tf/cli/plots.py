"""Plots of a simulated step: device memory over time, plain and planned, and the swap traffic.

The memory panel shows the plain step's curve, the planned step's curve with the bytes its
recompute clones and its swapped-in copies hold drawn as bands under it, the budget, and a line
where the backward pass begins. An infeasible plan has no planned curve: the panel says so and
draws the smallest budget a plan fits. Legends sit outside the axes, so no curve is hidden.

Examples:
    >>> from lms_tf.cli.plots import plot_timeline
"""

from __future__ import annotations

from typing import Optional

MiB = 2**20
#: Colours shared by the curves and their bands.
PLAIN, PLANNED, RECOMPUTED, SWAPPED_IN, TO_HOST = "tab:red", "tab:blue", "tab:purple", "tab:green", "tab:orange"


def timeline_figure(baseline, planned, budget_bytes: int, title: str = "",
                    smallest_feasible_bytes: Optional[int] = None):
    """The timeline as a matplotlib ``Figure`` (see :func:`plot_timeline`), for callers that
    want to add to it or look at its parts.

    Args:
        baseline: The plain step's :class:`~lms_tf.simulate.Simulation`.
        planned: The planned step's simulation, or None when no plan fits the budget.
        budget_bytes: The budget planned for.
        title: The figure's title.
        smallest_feasible_bytes: For an infeasible budget, the smallest one a plan fits
            (:attr:`lms_tf.InfeasibleBudgetError.smallest_feasible_bytes`), drawn as a line.

    Examples:
        >>> from lms_tf.simulate import Simulation
        >>> sim = Simulation(10, "a", (), 1.0, 1.0, 0, 0, ((0.0, 5, 0, 0, 0, 0), (1.0, 10, 0, 0, 2, 0)))
        >>> fig = timeline_figure(sim, sim, 8)
        >>> [text.get_text() for text in fig.axes[0].get_legend().get_texts()][:2]
        ['plain (peak 0 MiB)', 'lms-tf plan (peak 0 MiB)']
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, traffic) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ms = 1e3
    if baseline.timeline:
        t, used = zip(*[(e[0] * ms, e[1] / MiB) for e in baseline.timeline])
        memory.step(t, used, where="post", color=PLAIN, label=f"plain (peak {baseline.peak_bytes / MiB:.0f} MiB)")
    if planned is not None and planned.timeline:
        t2 = [e[0] * ms for e in planned.timeline]
        used2, to_host, to_device, recomputed, swapped_in = ([e[k] / MiB for e in planned.timeline] for k in range(1, 6))
        memory.step(t2, used2, where="post", color=PLANNED,
                    label=f"lms-tf plan (peak {planned.peak_bytes / MiB:.0f} MiB)")
        # Bands under the planned curve: what recompute clones and swapped-in copies hold of it.
        stacked = [r + s for r, s in zip(recomputed, swapped_in)]
        memory.fill_between(t2, 0, recomputed, step="post", color=RECOMPUTED, alpha=0.45, linewidth=0,
                            label=f"recomputed (at most {max(recomputed):.0f} MiB)")
        memory.fill_between(t2, recomputed, stacked, step="post", color=SWAPPED_IN, alpha=0.45, linewidth=0,
                            label=f"swapped back in (at most {max(swapped_in):.0f} MiB)")
        traffic.step(t2, to_host, where="post", color=TO_HOST, label="device -> host in flight")
        traffic.step(t2, to_device, where="post", color=SWAPPED_IN, label="host -> device in flight")
    memory.axhline(budget_bytes / MiB, color="black", linestyle="--", label=f"budget {budget_bytes / MiB:.0f} MiB")
    if planned is None:
        if smallest_feasible_bytes is not None:
            memory.axhline(smallest_feasible_bytes / MiB, color="black", linestyle=":",
                           label=f"smallest feasible budget {smallest_feasible_bytes / MiB:.0f} MiB")
        memory.text(0.5, 0.5, "infeasible: no plan fits this budget", transform=memory.transAxes, ha="center",
                    va="center", fontsize=14, color=PLAIN, bbox={"facecolor": "white", "edgecolor": PLAIN})
    backward = (planned or baseline).backward_start_s
    if backward is not None:
        for axes in (memory, traffic):
            axes.axvline(backward * ms, color="gray", linestyle="-.", linewidth=1)
        memory.annotate("forward | backward", (backward * ms, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", color="gray")
    memory.set_ylabel("device memory (MiB)")
    memory.set_ylim(bottom=0)
    memory.set_title(title + (" — infeasible" if planned is None else ""), pad=18)
    traffic.set_ylabel("swap traffic (MiB)")
    traffic.set_xlabel("simulated time (ms)")
    fig.tight_layout()
    memory.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    if planned is not None and planned.timeline:
        traffic.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    return fig


def plot_timeline(path: str, baseline, planned, budget_bytes: int, title: str = "",
                  smallest_feasible_bytes: Optional[int] = None) -> None:
    """Writes a PNG: device memory over the step, plain and planned (recomputed and swapped-in
    bytes as bands), the budget, where the backward pass begins, and the swap traffic.

    Args:
        path: The PNG to write.
        baseline: The plain step's simulation.
        planned: The planned step's simulation, or None when no plan fits the budget (the plot
            then says so and draws ``smallest_feasible_bytes``).
        budget_bytes: The budget planned for.
        title: The figure's title.
        smallest_feasible_bytes: For an infeasible budget, the smallest one a plan fits.

    Examples:
        >>> import os, tempfile
        >>> from lms_tf.simulate import Simulation
        >>> sim = Simulation(10, "a", (), 1.0, 1.0, 0, 0, ((0.0, 5, 0, 0, 0, 0), (1.0, 10, 0, 0, 0, 0)))
        >>> out = os.path.join(tempfile.mkdtemp(), "t.png")
        >>> plot_timeline(out, sim, sim, 8)
        >>> open(out, "rb").read(4) == b"\\x89PNG"
        True
    """
    import matplotlib.pyplot as plt

    fig = timeline_figure(baseline, planned, budget_bytes, title=title, smallest_feasible_bytes=smallest_feasible_bytes)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight" keeps the legends beside the axes
    plt.close(fig)
