"""The plan table people read: names cut in the middle, a "why" for every decision, the preset named."""

from lms_tf.core.plan import Decision, Plan, Predictions, TensorDecision, shorten

LONG = "efficientnetb0_1/block6d_se_reduce_conv_with_a_long_name_1"


def _decision(tensor, layer, nbytes, decision, reason):
    return TensorDecision(tensor, layer, (nbytes // 4,), nbytes, decision, reason, 10, ())


def _plan(*decisions):
    return Plan(decisions, "/device:GPU:0", "/device:CPU:0", {}, {}, budget_bytes=2**30,
                device_spec="v100-16gb-pcie3",
                predictions=Predictions(baseline_peak_bytes=2**31, planned_peak_bytes=2**30, baseline_step_time_s=1.0,
                                        predicted_step_time_s=1.1, feasible=True))


def test_long_names_are_cut_in_the_middle_and_keep_both_ends():
    short = shorten(LONG + "/Conv2D:0", 40)
    assert len(short) == 40 and "…" in short
    assert short.startswith("efficientnet") and short.endswith("long_name_1/Conv2D:0")
    assert shorten("conv1/Relu:0", 40) == "conv1/Relu:0"


def test_every_row_says_why_for_each_decision_it_holds_and_never_repeats_the_decision_alone():
    plan = _plan(
        _decision("pool1_pad_1/Pad:0", "pool1_pad_1", 8 << 20, Decision.SWAP, "swap (copy hidden behind compute)"),
        _decision("pool1_pad_1/Pad/paddings:0", "pool1_pad_1", 64, Decision.KEEP,
                  "derived from variables or constants only"),
        _decision("conv1_relu_1/Relu:0", "conv1_relu_1", 4 << 20, Decision.RECOMPUTE, "recompute (sqrt)"),
        _decision(f"{LONG}/Conv2D:0", LONG, 1 << 20, Decision.KEEP, "fits the budget"),
    )
    rows = {row["layer"]: row for row in plan.layer_table()}
    # The swapped output decides the row; the kept shape constant is named after it, not instead.
    assert rows["pool1_pad_1"]["decision"] == "swap+keep"
    assert rows["pool1_pad_1"]["why"] == "swap (copy hidden behind compute); keep: derived from variables or constants only"
    assert rows["conv1_relu_1"]["why"] == "recompute (sqrt)"
    assert rows[LONG]["why"] == "keep: fits the budget"
    for row in rows.values():
        assert row["why"] and row["why"] not in ("swap", "recompute", "keep")

    text = plan.summary()
    header = text.splitlines()[0]
    assert "planned for v100-16gb-pcie3" in header
    table_lines = [line for line in text.splitlines() if line.startswith("efficientnet")]
    assert table_lines and "…" in table_lines[0] and LONG not in text
    wide = plan.summary(wide=True)
    assert LONG in wide and "…" not in wide
    # Columns still line up when names are whole: the decision column starts after the longest name.
    lines = [line for line in wide.splitlines() if line.startswith(("layer", "pool1", "conv1", "efficientnet"))]
    assert len(lines) == 4
    assert all(line[len(LONG)] == " " and line[len(LONG) + 1] != " " for line in lines), lines
