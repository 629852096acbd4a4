"""Plots of a simulated step: device memory over time, plain and planned, and the swap traffic.

Example:
    >>> from lms_tf.cli.plots import plot_timeline
"""

from __future__ import annotations

MiB = 2**20


def plot_timeline(path: str, baseline, planned, budget_bytes: int, title: str = "") -> None:
    """Writes a PNG: device memory over the step, plain and planned, the budget, and swap traffic.

    Example:
        >>> import os, tempfile
        >>> from lms_tf.simulate import Simulation
        >>> sim = Simulation(10, "a", (), 1.0, 1.0, 0, 0, ((0.0, 5, 0, 0), (1.0, 10, 0, 0)))
        >>> out = os.path.join(tempfile.mkdtemp(), "t.png")
        >>> plot_timeline(out, sim, sim, 8)
        >>> open(out, "rb").read(4) == b"\\x89PNG"
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, traffic) = plt.subplots(2, 1, figsize=(10, 6), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1]})
    scale = 1e3
    t, used = zip(*[(e[0] * scale, e[1] / MiB) for e in baseline.timeline]) if baseline.timeline else ((), ())
    memory.step(t, used, where="post", label=f"plain (peak {baseline.peak_bytes / MiB:.0f} MiB)", color="tab:red")
    if planned is not None and planned.timeline:
        t2, used2, out2, in2 = zip(*[(e[0] * scale, e[1] / MiB, e[2] / MiB, e[3] / MiB) for e in planned.timeline])
        memory.step(t2, used2, where="post", label=f"lms-tf plan (peak {planned.peak_bytes / MiB:.0f} MiB)",
                    color="tab:blue")
        traffic.step(t2, out2, where="post", label="device -> host in flight", color="tab:orange")
        traffic.step(t2, in2, where="post", label="host -> device in flight", color="tab:green")
    memory.axhline(budget_bytes / MiB, color="black", linestyle="--", label=f"budget {budget_bytes / MiB:.0f} MiB")
    memory.set_ylabel("device memory (MiB)")
    memory.set_title(title)
    memory.legend(loc="upper left")
    traffic.set_ylabel("swap traffic (MiB)")
    traffic.set_xlabel("simulated time (ms)")
    if planned is not None and planned.timeline:
        traffic.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
