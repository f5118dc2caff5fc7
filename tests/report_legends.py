"""Runs `report.py RUN_DIR OUT_PNG` (launch/report.py, as lockstep report does) and checks the
figure it saves: no panel's legend overlaps the panel's plotting area, where the markers are.
Prints "legends clear of N panels" or the first overlap.

    python tests/report_legends.py REPORT_PY RUN_DIR OUT_PNG
"""
import runpy
import sys

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

saved = []
original = Figure.savefig


def capture(self, *args, **kwargs):
    saved.append(self)
    return original(self, *args, **kwargs)


Figure.savefig = capture
script, run_dir, out = sys.argv[1:4]
sys.argv = [script, run_dir, out]
runpy.run_path(script, run_name="__main__")
fig = saved[0]
renderer = fig.canvas.get_renderer()
panels = 0
for ax in fig.axes:
    legend = ax.get_legend()
    if legend is None:
        continue
    panels += 1
    if legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)):
        sys.exit(f"the legend of '{ax.get_ylabel()}' overlaps its panel")
print(f"legends clear of {panels} panels")
