"""lockstep's metrics sink: follows a run's metrics.jsonl and rank 0's diagnostics events while
it trains, and writes what they hold through the maintained writers: TensorBoard event files
(tensorboard's own EventFileWriter, into RUN_DIR/<folder>; no torch needed) and a W&B run
(wandb, into RUN_DIR/wandb, with the resolved config; offline by default, and `wandb sync`
uploads it later). Rank 0 starts it (embedded in the
binary, run with $LOCKSTEP_PYTHON) with its stdin a pipe: end of input there (the run ended, or
died) means read what is left, close the writers, exit.

    python metrics_sink.py RUN_DIR METRICS_OFFSET EVENTS_OFFSET [--tensorboard FOLDER]
        [--wandb PROJECT NAME offline|online]
    python metrics_sink.py --check [--tensorboard FOLDER] [--wandb PROJECT NAME MODE]

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
import time

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


class Board:
    """TensorBoard event files through tensorboard's own writer and protos (neither torch nor
    TensorFlow): scalars, and texts as the text plugin reads them."""

    def __init__(self, folder):
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text import plugin_data_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self.pb = (event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, plugin_data_pb2)
        self.writer = EventFileWriter(folder) if folder else None

    def add(self, value, step):
        event_pb2, summary_pb2 = self.pb[0], self.pb[1]
        self.writer.add_event(event_pb2.Event(step=step, wall_time=time.time(),
                                              summary=summary_pb2.Summary(value=[value])))

    def add_scalar(self, tag, v, step):
        self.add(self.pb[1].Summary.Value(tag=tag, simple_value=v), step)

    def add_text(self, tag, text, step):
        _, summary_pb2, tensor_pb2, shape_pb2, plugin_pb2 = self.pb
        meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name="text", content=plugin_pb2.TextPluginData(version=0).SerializeToString()))
        tensor = tensor_pb2.TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                                        tensor_shape=shape_pb2.TensorShapeProto(
                                            dim=[shape_pb2.TensorShapeProto.Dim(size=1)]))
        self.add(summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor), step)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


def resolved_config(run_dir):
    """The run's resolved config (RUN_DIR/config.toml) as a dict, for wandb.config."""
    try:
        import tomllib
        with open(os.path.join(run_dir, "config.toml"), "rb") as f:
            return tomllib.load(f)
    except (ImportError, OSError, ValueError):
        return {}


def writers(args, run_dir):
    out = []
    if "--tensorboard" in args:
        folder = args[args.index("--tensorboard") + 1]
        board = Board(os.path.join(run_dir, folder) if run_dir else None)
        if run_dir:
            out.append(("tb", board))
    if "--wandb" in args:
        project, name, mode = args[args.index("--wandb") + 1:args.index("--wandb") + 4]
        os.environ.setdefault("WANDB_SILENT", "true")  # lockstep's log says where it goes
        import wandb
        if run_dir:
            run = wandb.init(mode=mode, dir=run_dir, project=project,
                             name=name or os.path.basename(os.path.abspath(run_dir)),
                             config=resolved_config(run_dir),
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
    if args[0] == "--check":  # exit 3: no tensorboard, 4: no wandb
        try:
            writers(args, None)
        except ImportError as e:
            return 4 if "wandb" in str(e.name) else 3
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
