"""``megarlhf plot RUN_DIR``: PNG curves from ``metrics.jsonl``."""

from __future__ import annotations

import os

from megarlhf.engine.metrics import read_metrics

PANELS = [
    ("reward", ["objective/score", "eval/gold_score"]),
    ("KL to reference", ["objective/kl", "objective/kl_coef"]),
    ("response length", ["rollout/response_len_mean", "eval/response_len"]),
    ("losses", ["ppo/policy/loss", "ppo/val/loss", "train/loss", "eval/loss"]),
    ("PPO diagnostics", ["ppo/policy/clipfrac", "ppo/policy/approxkl", "ppo/val/explained_var",
                         "eval/accuracy"]),
]


def plot_run(run_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    panels = [(title, [k for k in keys if any(k in r for r in records)])
              for title, keys in PANELS]
    panels = [(t, keys) for t, keys in panels if keys]
    if not panels:
        raise ValueError(f"{run_dir}/metrics.jsonl holds none of the plotted metrics")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=key)
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step / iteration")
    fig.tight_layout()
    path = os.path.join(run_dir, "curves.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
