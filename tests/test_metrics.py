"""Validation metrics (mean / best / majority @n) and what the console and curves.png
show: validation lines, labelled bar fields, compiling, axes."""

import json

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from jrl import metrics

VAL = "val-core/synthetic/arithmetic/acc/mean@1"


def _step(score: float, kl: float = 0.00123, seconds: float = 0.41) -> dict[str, float]:
    return {"critic/score/mean": score, "actor/ppo_kl": kl, "timing_s/step": seconds}


@pytest.fixture
def writer(tmp_path):
    w = metrics.MetricsWriter(str(tmp_path), ["console", "jsonl"], total_steps=4)
    yield w
    w.close()


def test_validation_is_printed_with_its_value(writer, capsys):
    writer.write(0, {VAL: 0.297, "val-aux/synthetic/arithmetic/reward/mean@1": 0.1})
    writer.write(1, _step(0.5))
    writer.write(2, {**_step(0.6), VAL: 0.9137})
    out = capsys.readouterr().out.splitlines()
    assert f"step 0: {VAL} = 0.297" in out
    assert f"step 2: {VAL} = 0.914" in out
    assert not any(line.startswith("step 1:") and "val-" in line for line in out)
    assert not any("val-aux" in line for line in out)


def test_validation_line_is_short():
    many = {f"val-core/source{i}/acc/mean@4": 0.5 for i in range(5)}
    many.update({f"val-core/source{i}/acc/best@4/mean": 0.9 for i in range(5)})
    line = metrics.validation_line(7, many)
    assert line == ("step 7: val-core/source0/acc/mean@4 = 0.500, "
                    "val-core/source1/acc/mean@4 = 0.500, "
                    "val-core/source2/acc/mean@4 = 0.500 (+2 more)")
    assert metrics.validation_line(7, _step(0.5)) is None


def test_multi_turn_runs_show_their_tool_calls_turns_and_errors(writer, capsys):
    """A multi-turn step's bar shows tool calls and turns per row and tool errors; its
    validation line adds the validation's."""
    turns = {"multi_turn/tool_calls/mean": 0.75, "num_turns/mean": 2.5,
             "multi_turn/tool_errors": 3.0}
    writer.write(1, {**_step(0.53), **turns})
    assert writer._bar.postfix == ("score=0.53, ppo_kl=0.00123, calls/row=0.75, turns/row=2.5, "
                                   "tool errors=3, s/step=0.41")
    writer.write(2, {**_step(0.6), VAL: 0.5, **{f"val-aux/{k}": v for k, v in turns.items()}})
    assert (f"step 2: {VAL} = 0.500; calls/row 0.75, turns/row 2.5, tool errors 3"
            in capsys.readouterr().out.splitlines())


def test_validation_samples_as_console_lines():
    columns = {"input": ["User: 12*34\nAssistant: ", "User: 2*3\nAssistant: "],
               "output": ["<tool_call>12*34</tool_call>\nTool: 408\nAssistant: 408", "6"],
               "gts": ["408", "6"], "score": [1.0, 0.0]}
    assert metrics.sample_lines(5, columns, 1) == [
        "step 5: validation sample 1 of 2, score 1, ground truth '408'",
        "  prompt:   User: 12*34",
        "            Assistant: ",
        "  response: <tool_call>12*34</tool_call>",
        "            Tool: 408",
        "            Assistant: 408"]
    assert len(metrics.sample_lines(5, columns, 10)) == 6 + 4  # both samples, no more


def test_nothing_is_printed_without_the_console_logger(tmp_path, capsys):
    w = metrics.MetricsWriter(str(tmp_path), ["jsonl"], total_steps=4)
    w.write(0, {VAL: 0.297})
    w.write(1, {**_step(0.5), VAL: 0.5})
    w.close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert len(metrics.read_jsonl(w.path)) == 2


def test_bar_fields_are_labelled(writer):
    writer.write(1, _step(0.53))
    assert writer._bar.postfix == "score=0.53, ppo_kl=0.00123, s/step=0.41"
    assert writer._bar.n == 1


def test_compiling_until_the_first_training_step(writer, capsys):
    assert writer._bar.desc == "rl (compiling the first step)"
    writer.write(0, {VAL: 0.297})  # validation before RL: still compiling
    assert "compiling" in writer._bar.desc
    writer.write(1, _step(0.5, seconds=63.2))
    assert writer._bar.desc == "rl"
    assert "step 1: 63.2 s (including compilation)" in capsys.readouterr().out
    # The clock restarts after step 1, so rate and ETA leave out compilation.
    assert writer._bar.n == writer._bar.initial == 1
    writer.write(2, _step(0.6))
    assert writer._bar.desc == "rl" and writer._bar.n == 2
    assert "compilation" not in capsys.readouterr().out


def test_first_step_compiled_ahead_names_both_times(writer, capsys):
    # `trainer.parallel_compile`: the programs compiled before the step, which ran fast.
    writer.write(1, {**_step(0.5, seconds=1.9), "timing_s/compile": 57.1})
    assert writer._bar.desc == "rl"
    assert ("step 1: 1.9 s, after 57.1 s compiling (or reading back) its programs"
            in capsys.readouterr().out)


def test_resumed_run_compiles_its_first_step(tmp_path):
    w = metrics.MetricsWriter(str(tmp_path), ["console"], total_steps=6, start_step=4)
    assert "compiling" in w._bar.desc and w._bar.n == 4
    w.write(5, _step(0.5))
    assert w._bar.desc == "rl" and w._bar.n == 5
    w.close()
    done = metrics.MetricsWriter(str(tmp_path), ["console"], total_steps=6, start_step=6)
    assert done._bar.desc == "rl"
    done.close()


def _records() -> list[dict]:
    records = [{"step": 0, VAL: 0.3, "val-core/other/acc/mean@1": 0.1}]
    for step in range(1, 5):
        records.append({"step": step, **_step(0.2 * step)})
    records[-1].update({VAL: 0.8, "val-core/other/acc/mean@1": 0.4})
    return records


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_curves_label_axes_and_keep_legends_off_the_data():
    fig = metrics.curves_figure(_records())
    assert isinstance(fig.canvas, FigureCanvasAgg)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    train, val = fig.axes
    assert train.get_ylabel() == "training score (critic/score/mean)"
    assert val.get_ylabel() == "validation accuracy (val-core)"
    assert all(ax.get_xlabel() == "RL step" for ax in fig.axes)
    assert val.get_ylim() == (0, 1)
    assert train.get_ylim() != (0, 1)
    legend = val.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["other/acc/mean@1",
                                                        "synthetic/arithmetic/acc/mean@1"]
    legend_box = legend.get_window_extent(renderer)
    assert not _overlap(legend_box, val.get_window_extent(renderer))
    assert not _overlap(legend_box, train.get_window_extent(renderer))
    # Constrained layout keeps the legend on the canvas.
    assert fig.bbox.y0 <= legend_box.y0


def test_curves_of_a_reward_keep_their_range():
    records = [{"step": 0, "val-core/src/reward/mean@1": -2.0},
               {"step": 1, "val-core/src/reward/mean@1": 3.0}]
    (ax,) = metrics.curves_figure(records).axes
    assert ax.get_ylabel() == "validation reward (val-core)"
    low, high = ax.get_ylim()
    assert low < -2.0 and high > 3.0


def test_plot_curves_writes_the_png(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    png = metrics.plot_curves(str(jsonl), str(tmp_path / "curves.png"), val_key=VAL)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_validation_metrics_mean_best_maj():
    # Two prompts, n = 3. Prompt 0 answers "7", "7", "8" scoring 0, 0, 1; prompt 1 all "5"
    # scoring 1.
    values = {"reward": [0.1, 0.1, 1.0, 1.0, 1.0, 1.0], "acc": [0, 0, 1, 1, 1, 1]}
    out = metrics.validation_metrics(["s"] * 6, [0, 0, 0, 1, 1, 1], values,
                                     ["7", "7", "8", "5", "5", "5"], n=3)
    assert out["val-core/s/acc/mean@3"] == pytest.approx((1 / 3 + 1) / 2)
    assert out["val-core/s/acc/best@3/mean"] == 1.0
    assert out["val-core/s/acc/maj@3/mean"] == pytest.approx(0.5)
    assert out["val-aux/s/reward/mean@3"] == pytest.approx((0.4 + 1) / 2)


@pytest.mark.parametrize("device_kind, flops, gbps", [
    # Vendor data sheets: H100 SXM 989 TFLOP/s dense bf16 and 3.35 TB/s, H100 PCIe 756
    # and 2.0 TB/s, H100 NVL 835 and 3.9 TB/s, GH200 (HBM3) 989 and 4.0 TB/s, H200 4.8
    # TB/s, TPU v5e 197 TFLOP/s and 819 GB/s.
    ("NVIDIA H100 80GB HBM3", 989e12, 3350.0),
    ("NVIDIA H100 PCIe", 756e12, 2000.0),
    ("NVIDIA H100 NVL", 835e12, 3900.0),
    ("NVIDIA GH200 480GB", 989e12, 4000.0),
    ("NVIDIA H200", 989e12, 4800.0),
    ("TPU v5 lite", 197e12, 819.0),
    ("cpu", None, None),
])
def test_peaks_by_device_kind(device_kind, flops, gbps):
    assert metrics.peak_flops(device_kind) == flops
    assert metrics.peak_hbm_gbps(device_kind) == gbps
