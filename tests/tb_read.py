"""Reads a TensorBoard folder with TensorBoard's own reader (EventAccumulator) and prints every
scalar series and text as JSON: {"scalars": {tag: [[step, value], ...]}, "texts": [[step,
text], ...]}. The test of metrics.enable_tensorboard compares it with the run's metrics.

    python tests/tb_read.py TB_DIR
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(folder):
    ea = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()
    scalars = {t: [[e.step, e.value] for e in ea.Scalars(t)] for t in tags["scalars"]}
    texts = []
    for t in tags.get("tensors", []):
        for e in ea.Tensors(t):
            texts.append([e.step, e.tensor_proto.string_val[0].decode()])
    print(json.dumps({"scalars": scalars, "texts": texts}))


if __name__ == "__main__":
    main(sys.argv[1])
