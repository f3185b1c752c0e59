"""The book's figure and table style: colour families, the step axis, formatted tables."""
import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from circuitbook import plotting  # noqa: E402


def test_family_colors_give_each_group_its_own_hue_and_each_curve_a_shade():
    colors = plotting.family_colors({"0-var": ["a", "b"], "1-var": ["c", "d", "e"]})
    assert list(colors) == ["a", "b", "c", "d", "e"]
    a, b, c = colors["a"], colors["b"], colors["c"]
    assert sum(a) < sum(b), "the first curve of a family is the darkest"
    assert a[2] > a[1] and c[1] > c[2], "blues for the first family, greens for the second"


def test_step_axis_goes_log_only_when_the_events_are_early():
    fig, ax = plotting.figure()
    assert plotting.step_axis(ax, range(0, 10001, 100), events=[300, 900]) == "log"
    assert ax.get_xscale() == "symlog" and "log scale" in ax.get_xlabel()
    ax.plot(range(0, 10001, 100), range(101))
    ax.figure.canvas.draw()
    assert ax.get_xlim() == pytest.approx((0, 10000)), "the axis spans the run: no negative steps"
    fig, ax = plotting.figure()
    assert plotting.step_axis(ax, range(0, 10001, 100), events=[3000, 9000]) == "linear"
    assert ax.get_xscale() == "linear"
    fig, ax = plotting.figure()
    assert plotting.step_axis(ax, range(0, 10001, 100), events=[float("nan")]) == "linear"


def test_figures_never_exceed_the_page_width():
    fig, _ = plotting.figure(ncols=2, width=14)
    assert fig.get_figwidth() <= plotting.MAX_WIDTH
    fig, axes = plotting.figure(ncols=2, nrows=2)
    assert axes.shape == (2, 2)


def test_table_formats_steps_accuracies_and_nan():
    df = pd.DataFrame({"step": [380.327870, 1065.573762], "accuracy": [0.98765, float("nan")],
                       "share": [0.5, 0.25]})
    html = plotting.table(df, integers=["step"], percent=["share"]).to_html()
    assert "380" in html and "1,066" in html and "380.32" not in html
    assert "0.988" in html and "-" in html and "50.0%" in html


def test_table_integer_columns_show_inf_for_no_qualifying_value():
    df = pd.DataFrame({"sufficient dim": [3.0, float("inf"), float("nan")]})
    html = plotting.table(df, integers=["sufficient dim"]).to_html()
    assert ">3<" in html and ">inf<" in html and ">-<" in html and "3.0" not in html


def test_figure_legend_puts_one_legend_under_a_figure_of_panels():
    fig, axes = plotting.figure(ncols=2)
    for ax in axes[0]:
        ax.plot([0, 1], [0, 1], label="keep")
        ax.plot([0, 1], [1, 0], label="remove")
    plotting.figure_legend(fig, axes[0][0], ncol=2)
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in axes[0])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["keep", "remove"]
    fig.canvas.draw()
    box = fig.legends[0].get_window_extent()
    assert box.y1 <= min(ax.get_window_extent().y0 for ax in axes[0]), "under the panels"


def test_table_by_turns_a_wide_table_and_formats_each_measurement_as_its_column():
    df = pd.DataFrame({"seed": [0, 100], "core rank": [4.0, float("inf")], "accuracy": [0.98765, float("nan")],
                       "frequencies": [[1, 5], [2]]})
    styler = plotting.table_by(df, "seed", integers=["core rank"])
    assert list(styler.data.columns) == ["0", "100"] and styler.data.columns.name == "seed"
    assert list(styler.data.index) == ["core rank", "accuracy", "frequencies"]
    assert styler.data.loc["core rank"].tolist() == ["4", "inf"]
    assert styler.data.loc["accuracy"].tolist() == ["0.988", "-"]
    assert styler.data.loc["frequencies"].tolist() == ["[1, 5]", "[2]"]


def test_tables_leave_room_between_columns():
    df = pd.DataFrame({"to 0": [0.75, 0.25], "to 1": [0.25, 0.75]})
    for styler in (plotting.table(df), plotting.table_by(df.assign(state=[0, 1]), "state")):
        assert "padding: 0.15em 0.7em" in styler.to_html()
