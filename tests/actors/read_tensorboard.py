"""Reads a TensorBoard folder with TensorBoard's own EventAccumulator and prints what it holds as
JSON: every scalar (tag, step, value, wall_time), every text tensor, and the event files read.

    read_tensorboard.py DIR
"""
import json
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator


def main():
    folder = sys.argv[1]
    # Size guidance 0 keeps every event (the defaults sample scalars down to 10000, tensors to 10).
    acc = EventAccumulator(folder, size_guidance={SCALARS: 0, TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    out = {"files": sorted(f for f in os.listdir(folder) if f.startswith("events.out.tfevents.")),
           "file_version": acc.file_version, "scalars": [], "texts": []}
    for tag in tags["scalars"]:
        for e in acc.Scalars(tag):
            out["scalars"].append({"tag": tag, "step": e.step, "value": e.value, "wall_time": e.wall_time})
    for tag in tags["tensors"]:
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        for e in acc.Tensors(tag):
            out["texts"].append({"tag": tag, "step": e.step, "plugin": plugin, "wall_time": e.wall_time,
                                 "dtype": e.tensor_proto.dtype, "dims": len(e.tensor_proto.tensor_shape.dim),
                                 "text": [s.decode("utf-8") for s in e.tensor_proto.string_val]})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
