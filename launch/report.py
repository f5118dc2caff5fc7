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


def fail(code, message):
    """One line and lockstep's exit code: 2 for the command line, 3 for an input file."""
    print(f"lockstep report: {message}", file=sys.stderr)
    sys.exit(code)


def read_jsonl(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    fail(3, f"{path}:{n} is not JSON ({e.msg}); is the file damaged?")
    return out


def outside_legend(ax, **kw):
    """The panel's legend beside it, right of the plot: it never hides a marker or a line."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: report.py RUN_DIR OUT_PNG")
    run_dir, out = sys.argv[1], sys.argv[2]
    if os.path.isdir(out):
        fail(2, f"--out '{out}' is a folder; give the path of a .png file to write")
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
        fail(3, f"no {metrics_path}; pass a lockstep run directory (job.dump_folder)")
    records = read_jsonl(metrics_path)
    starts = [i for i, m in enumerate(records) if m.get("event") == "start"]
    if starts:  # a fresh run over an earlier run's file: only the last run's records
        records = records[starts[-1] + 1:]
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
    def steps_with(decision):
        return sorted(s for s, es in events.items() if any(e["decision"] == decision for e in es.values()))
    skips, aborts = steps_with("skip"), steps_with("abort")
    clips, salvages = steps_with("clip"), steps_with("salvage")
    replayed = steps_with("step")  # taken after a replay repaired a transient fault, or probed

    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True,
                             gridspec_kw={"height_ratios": [3, 3, 2, 2]})
    ax_loss, ax_norm, ax_lr, ax_ranks = axes
    title = f"lockstep run {os.path.abspath(run_dir)}: {len(steps)} logged steps, {len(skips)} skipped"
    if clips:
        title += f", {len(clips)} clipped"
    if salvages:
        title += f", {len(salvages)} salvaged"
    if aborts:
        title += f", aborted at step {aborts[-1]}"
    fig.suptitle(title, fontsize=11)

    # Every decision other than a plain step, as a vertical line; the loss panel's legend names them.
    marks = [(skips, dict(color="tab:red", alpha=0.35, lw=1), "skipped step"),
             (clips, dict(color="tab:orange", alpha=0.5, lw=1, ls=":"), "clipped (global spike)"),
             (salvages, dict(color="tab:blue", alpha=0.4, lw=1, ls="-."), "salvaged (ranks dropped)"),
             (replayed, dict(color="tab:purple", alpha=0.4, lw=1, ls="--"), "taken after a replay"),
             (aborts, dict(color="black", ls="--", lw=1.2), "abort")]

    def mark(ax, legend=False):
        for where, style, label in marks:
            for i, s in enumerate(where):
                ax.axvline(s, label=label if legend and i == 0 else None, **style)

    # Lines over accepted steps only; a skipped step shows as a marker.
    updated = ("step", "salvage")  # a clipped step shows as a marker: its loss is the spike
    accepted = [i for i, s in enumerate(steps) if by_step[s].get("decision", "step") in updated]
    keep = lambda xs: [xs[i] for i in accepted]
    a_steps = keep(steps)

    # Loss
    ax_loss.plot(a_steps, keep(col("loss")), color="tab:blue", lw=1.2, label="loss (logged steps)")
    ev_loss = [(s, number(next(iter(events[s].values()))["global"]["loss"])) for s in skips]
    fin = [(s, v) for s, v in ev_loss if math.isfinite(v)]
    if fin:
        ax_loss.scatter(*zip(*fin), color="tab:red", marker="x", zorder=3, label="skipped step's loss")
    clip_loss = [(s, number(next(iter(events[s].values()))["global"]["loss"])) for s in clips]
    if clip_loss:
        ax_loss.scatter(*zip(*clip_loss), color="tab:orange", marker="D", zorder=3,
                        label="clipped step's loss")
    if validation:
        ax_loss.plot([v["step"] for v in validation], [number(v["val_loss"]) for v in validation],
                     color="tab:green", marker="o", ms=3, lw=1.2, label="validation loss")
    ax_loss.set_ylabel("loss")
    ax_loss.set_yscale("log")
    mark(ax_loss, legend=True)
    outside_legend(ax_loss, fontsize=8)

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
    clip_norm = [(s, number(next(iter(events[s].values()))["global"]["grad_norm"])) for s in clips]
    if clip_norm:
        ax_norm.scatter(*zip(*clip_norm), color="tab:orange", marker="D", zorder=3,
                        label="clipped step's norm (before the clip)")
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("grad norm")
    mark(ax_norm)
    outside_legend(ax_norm, fontsize=8)

    # LR
    ax_lr.plot(steps, col("lr"), color="tab:purple", lw=1.2)
    ax_lr.set_ylabel("learning rate")
    mark(ax_lr)

    # Per-rank anomaly timeline: a culprit's marker is coloured by the cause, shaped by the
    # decision, and labelled with every reason; a global anomaly (no culprit) sits on the top row.
    cause_colors = {"data": "tab:red", "transient_fault": "tab:purple", "hardware": "black",
                    "instability": "tab:orange", "": "tab:gray"}
    shapes = {"skip": "o", "abort": "X", "clip": "D", "salvage": "s", "step": "^"}
    n_ranks = max(ranks) + 1 if ranks else 1
    seen = set()
    for s, es in sorted(events.items()):
        e = next(iter(es.values()))
        culprits = set(e.get("culprit_ranks", []))
        cause = e.get("cause", "")
        label = f"{e['decision']}: {'+'.join(e['reasons']) or 'unknown'} ({cause or 'cause unknown'})"
        rows = sorted(culprits) if culprits else [n_ranks]  # the "all ranks" row
        for r in rows:
            ax_ranks.scatter([s], [r], color=cause_colors.get(cause, "tab:gray"),
                             marker=shapes.get(e["decision"], "o"), s=45,
                             label=label if label not in seen else None, zorder=3)
            seen.add(label)
        for r in sorted(ranks):
            if r not in culprits:
                ax_ranks.scatter([s], [r], color="lightgray", marker=".", s=12, zorder=2)
    ax_ranks.set_yticks(range(n_ranks + 1))
    ax_ranks.set_yticklabels([str(r) for r in range(n_ranks)] + ["all (global)"])
    ax_ranks.set_ylim(-0.5, n_ranks + 0.5)
    ax_ranks.set_ylabel("rank (culprit)")
    ax_ranks.set_xlabel("step")
    if seen:
        outside_legend(ax_ranks, fontsize=7)
    ax_ranks.grid(axis="y", alpha=0.3)

    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")  # the legends beside the panels included
    os.replace(tmp, out)
    print(f"lockstep report: wrote {out} ({len(steps)} logged steps, {len(validation)} validations, "
          f"{len(events)} events, {len(skips)} skips, {len(clips)} clips, {len(salvages)} salvages, "
          f"{len(aborts)} aborts)")


if __name__ == "__main__":
    try:
        main()
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        fail(3, f"a record in {sys.argv[1]} (metrics.jsonl or diagnostics/) lacks a field or has "
                f"one of the wrong type ({type(e).__name__}: {e}); is the file damaged?")
