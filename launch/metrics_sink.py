"""lockstep's metrics sink: follows a run's metrics.jsonl and rank 0's diagnostics events while
it trains, and writes what they hold through the maintained writers: TensorBoard event files
(torch.utils.tensorboard's SummaryWriter, into RUN_DIR/<folder>) and an offline W&B run
(wandb, into RUN_DIR/wandb; `wandb sync` uploads it later). Rank 0 starts it (embedded in the
binary, run with $LOCKSTEP_PYTHON) with its stdin a pipe: end of input there (the run ended, or
died) means read what is left, close the writers, exit.

    python metrics_sink.py RUN_DIR METRICS_OFFSET EVENTS_OFFSET [--tensorboard FOLDER] [--wandb]
    python metrics_sink.py --check [--tensorboard FOLDER] [--wandb]    # can the writers load?

Per step: train/loss, train/grad_norm, train/lr, train/clip_coef, skip/skipped_steps,
skip/clipped_steps, skip/tensor_clips, skip/moment_resets, perf/tokens_per_s, perf/mfu,
perf/ms_per_step, loss_scale; val/loss and val/perplexity at each validation; and every skip,
clip, salvage or abort as decision/<kind> = 1 at its step (a mark on the chart) with its
reasons and scope as text.
"""
import json
import math
import os
import select
import sys

SCALARS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
           "clip_coef": "train/clip_coef", "skipped_steps": "skip/skipped_steps",
           "clipped_steps": "skip/clipped_steps", "tensor_clips": "skip/tensor_clips",
           "moment_resets": "skip/moment_resets", "tokens_per_s": "perf/tokens_per_s",
           "mfu": "perf/mfu", "ms_per_step": "perf/ms_per_step", "loss_scale": "loss_scale"}


def number(v):
    """JSON has no NaN: lockstep writes "NaN", "Infinity", "-Infinity" as strings."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if v in ("NaN", "Infinity", "-Infinity"):
        return float(v.replace("Infinity", "inf"))
    return None


def points(record, from_events):
    """(step, {name: value}, text or None) of one record."""
    step = record.get("step")
    if not isinstance(step, int):
        return None
    if from_events:
        kind = record.get("decision", "")
        if kind == "step" and not record.get("reasons"):
            return None
        text = (f"step {step}: {kind.upper()} ({', '.join(record.get('reasons', []))}); scope "
                f"{record.get('scope') or '-'}, culprit ranks {record.get('culprit_ranks', [])}")
        return step, {f"decision/{kind}": 1.0}, text
    if record.get("event") == "validation":
        values = {"val/loss": number(record.get("val_loss")),
                  "val/perplexity": number(record.get("val_perplexity"))}
        return step, {k: v for k, v in values.items() if v is not None}, None
    if "event" in record:
        return None
    values = {name: number(record.get(key)) for key, name in SCALARS.items()}
    return step, {k: v for k, v in values.items() if v is not None}, None


class Follower:
    """The complete lines appended to a file since `offset`."""

    def __init__(self, path, offset):
        self.path, self.offset, self.partial = path, offset, b""

    def lines(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *done, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in done:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


def writers(args, run_dir):
    out = []
    if "--tensorboard" in args:
        import tensorboard  # noqa: F401  (named first: torch's writer below needs it too)
        from torch.utils.tensorboard import SummaryWriter
        folder = args[args.index("--tensorboard") + 1]
        if run_dir:
            out.append(("tb", SummaryWriter(log_dir=os.path.join(run_dir, folder))))
    if "--wandb" in args:
        os.environ.setdefault("WANDB_SILENT", "true")  # lockstep's log says where it goes
        import wandb
        if run_dir:
            run = wandb.init(mode="offline", dir=run_dir, project="lockstep",
                             name=os.path.basename(os.path.abspath(run_dir)),
                             settings=wandb.Settings(console="off", x_disable_stats=True))
            out.append(("wandb", run))
    return out


def write(sinks, step, values, text):
    for kind, w in sinks:
        if kind == "tb":
            for name, v in values.items():
                if math.isfinite(v):
                    w.add_scalar(name, v, step)
            if text:
                w.add_text("decisions", text, step)
        else:
            row = {k: v for k, v in values.items() if math.isfinite(v)}
            if text:
                row["decisions"] = text
            w.log(row, step=step)


def drain(followers, sinks):
    batch = []
    for follower, from_events in followers:
        for record in follower.lines():
            p = points(record, from_events)
            if p:
                batch.append(p)
    batch.sort(key=lambda p: p[0])  # W&B takes steps in order
    for step, values, text in batch:
        write(sinks, step, values, text)
    for kind, w in sinks:
        if kind == "tb":
            w.flush()


def main(args):
    if args[0] == "--check":  # exit 3: no tensorboard, 4: no wandb, 5: no torch (its writer)
        try:
            writers(args, None)
        except ImportError as e:
            name = str(e.name)
            return 4 if "wandb" in name else 5 if name == "torch" else 3
        return 0
    try:  # a side channel: when it fails, one line says so and training goes on without it
        return follow(args)
    except Exception as e:  # noqa: BLE001  (a full disk, a read-only or missing folder, ...)
        what = " and ".join(n for n, on in (("TensorBoard", "--tensorboard" in args),
                                            ("W&B", "--wandb" in args)) if on)
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"lockstep: warning: metrics sink: {what} stopped writing ({type(e).__name__}: "
              f"{first}); training goes on without it (metrics.jsonl holds every record)",
              file=sys.stderr, flush=True)
        return 6


def follow(args):
    run_dir, metrics_offset, events_offset = args[0], int(args[1]), int(args[2])
    sinks = writers(args, run_dir)
    followers = [(Follower(os.path.join(run_dir, "metrics.jsonl"), metrics_offset), False),
                 (Follower(os.path.join(run_dir, "diagnostics", "rank0.jsonl"), events_offset),
                  True)]
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        ended = bool(ready) and not os.read(sys.stdin.fileno(), 4096)
        drain(followers, sinks)
        if ended:
            break
    for kind, w in sinks:
        if kind == "tb":
            w.close()
        else:
            w.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
