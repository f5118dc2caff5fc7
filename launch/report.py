"""lockstep report: pictures of a run directory (embedded in the lockstep binary).

Usage: python report.py RUN_DIR OUT_PNG
Reads RUN_DIR/metrics.jsonl and RUN_DIR/diagnostics/rank*.jsonl; draws loss (and validation loss), grad norm with its
thresholds and z-band, LR, skip markers, and a per-rank anomaly timeline.
"""
import glob
import json
import math
import os
import sys


def number(v):
    if isinstance(v, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(v, math.nan)
    return math.nan if v is None else float(v)


def read_jsonl(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    sys.exit(f"lockstep report: {path}:{n} is not JSON ({e.msg}); is the file damaged?")
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: report.py RUN_DIR OUT_PNG")
    run_dir, out = sys.argv[1], sys.argv[2]
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"lockstep report: {sys.executable} has no matplotlib; run "
                 f"`{sys.executable} -m pip install matplotlib` or set LOCKSTEP_PYTHON to a "
                 "Python that has it")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        sys.exit(f"lockstep report: no {metrics_path}; pass a lockstep run directory (job.dump_folder)")
    records = read_jsonl(metrics_path)
    metrics = [m for m in records if "event" not in m]  # resume/rewind/validation records apart
    validation = [m for m in records if m.get("event") == "validation"]
    # A resumed run appends: keep the last record of each step.
    by_step = {m["step"]: m for m in metrics}
    steps = sorted(by_step)
    col = lambda k: [number(by_step[s].get(k)) for s in steps]

    events = {}  # step -> {rank: event}
    ranks = set()
    for path in sorted(glob.glob(os.path.join(run_dir, "diagnostics", "rank*.jsonl"))):
        for e in read_jsonl(path):
            events.setdefault(e["step"], {})[e["rank"]] = e
            ranks.add(e["rank"])
            ranks.update(r["rank"] for r in e.get("ranks", []))
    skips = sorted(s for s, es in events.items() if any(e["decision"] == "skip" for e in es.values()))
    aborts = sorted(s for s, es in events.items() if any(e["decision"] == "abort" for e in es.values()))

    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True,
                             gridspec_kw={"height_ratios": [3, 3, 2, 2]})
    ax_loss, ax_norm, ax_lr, ax_ranks = axes
    title = f"lockstep run {os.path.abspath(run_dir)}: {len(steps)} logged steps, {len(skips)} skipped"
    if aborts:
        title += f", aborted at step {aborts[-1]}"
    fig.suptitle(title, fontsize=11)

    def mark(ax):
        for s in skips:
            ax.axvline(s, color="tab:red", alpha=0.35, lw=1)
        for s in aborts:
            ax.axvline(s, color="black", ls="--", lw=1.2)

    # Lines over accepted steps only; a skipped step shows as a marker.
    accepted = [i for i, s in enumerate(steps) if by_step[s].get("decision", "step") == "step"]
    keep = lambda xs: [xs[i] for i in accepted]
    a_steps = keep(steps)

    # Loss
    ax_loss.plot(a_steps, keep(col("loss")), color="tab:blue", lw=1.2, label="loss (logged steps)")
    ev_loss = [(s, number(next(iter(events[s].values()))["global"]["loss"])) for s in skips]
    fin = [(s, v) for s, v in ev_loss if math.isfinite(v)]
    if fin:
        ax_loss.scatter(*zip(*fin), color="tab:red", marker="x", zorder=3, label="skipped step's loss")
    if validation:
        ax_loss.plot([v["step"] for v in validation], [number(v["val_loss"]) for v in validation],
                     color="tab:green", marker="o", ms=3, lw=1.2, label="validation loss")
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log")
    mark(ax_loss)
    ax_loss.legend(loc="upper right", fontsize=8)

    # Grad norm with thresholds and z-band
    ax_norm.plot(a_steps, keep(col("grad_norm")), color="tab:green", lw=1.2,
                 label="global grad norm (pre-clip)")
    z, max_norm, min_history = 0.0, 0.0, 0
    for es in events.values():
        t = next(iter(es.values())).get("thresholds", {})
        z = t.get("grad_norm_zscore", z)
        max_norm = t.get("max_grad_norm", max_norm)
        min_history = t.get("min_history", min_history)
    if z > 0:
        band = [(s, number(by_step[s].get("grad_norm_mean")), number(by_step[s].get("grad_norm_std")))
                for s in steps if by_step[s].get("window_history", 0) >= max(min_history, 2)]
        if band:
            xs = [b[0] for b in band]
            ax_norm.fill_between(xs, [b[1] for b in band], [b[1] + z * b[2] for b in band],
                                 color="tab:green", alpha=0.15,
                                 label=f"window mean .. mean + {z:g} std (spike above)")
    if max_norm > 0:
        ax_norm.axhline(max_norm, color="tab:orange", ls=":", label=f"skip.max_grad_norm = {max_norm:g}")
    ev_norm = [(s, number(next(iter(events[s].values()))["global"]["grad_norm"])) for s in skips]
    fin = [(s, v) for s, v in ev_norm if math.isfinite(v)]
    if fin:
        ax_norm.scatter(*zip(*fin), color="tab:red", marker="x", zorder=3, label="skipped step's norm")
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("grad norm")
    mark(ax_norm)
    ax_norm.legend(loc="upper right", fontsize=8)

    # LR
    ax_lr.plot(steps, col("lr"), color="tab:purple", lw=1.2)
    ax_lr.set_ylabel("learning rate")
    mark(ax_lr)

    # Per-rank anomaly timeline
    colors = {"nonfinite_grad": "tab:red", "nonfinite_loss": "darkred", "grad_norm_above_max": "tab:orange",
              "grad_norm_spike": "tab:olive", "loss_spike": "tab:cyan", "loss_scale_overflow": "tab:gray"}
    seen = set()
    for s, es in sorted(events.items()):
        e = next(iter(es.values()))
        culprits = set(e.get("culprit_ranks", []))
        for r in sorted(ranks):
            if r in culprits:
                reason = e["reasons"][0] if e["reasons"] else "unknown"
                label = reason if reason not in seen else None
                seen.add(reason)
                ax_ranks.scatter([s], [r], color=colors.get(reason, "gray"),
                                 marker="X" if e["decision"] == "abort" else "o", s=40, label=label, zorder=3)
            else:
                ax_ranks.scatter([s], [r], color="lightgray", marker=".", s=12, zorder=2)
    n_ranks = max(ranks) + 1 if ranks else 1
    ax_ranks.set_yticks(range(n_ranks))
    ax_ranks.set_ylim(-0.5, n_ranks - 0.5)
    ax_ranks.set_ylabel("rank (culprit)")
    ax_ranks.set_xlabel("step")
    if seen:
        ax_ranks.legend(loc="upper right", fontsize=8)
    ax_ranks.grid(axis="y", alpha=0.3)

    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)
    print(f"lockstep report: wrote {out} ({len(steps)} logged steps, {len(validation)} validations, "
          f"{len(events)} events, {len(skips)} skips)")


if __name__ == "__main__":
    main()
