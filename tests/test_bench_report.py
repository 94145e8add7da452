"""The microbenchmark's report (table and ratios) on CPU, from rows as the ranks return them."""
import math

import pytest

from fastcomm_bench import bench_allreduce as B


def _row(impl, us, redop="sum", size=12288):
    return dict(size=size, count=size // 2, type="bfloat16", redop=redop, impl=impl, graph_us=us, eager_us=10.0,
                wrong=0 if redop == "sum" else -1)


def test_ratios_cover_back_to_back_and_after_a_gemm():
    rows = [_row("fastcomm-auto", 4.0), _row("nccl", 8.0), _row("symm-one_shot", 5.0),
            _row("fastcomm-auto 1x6144", 3.0, "gemm+"), _row("nccl 1x6144", 12.0, "gemm+"),
            _row("fastcomm-host-auto 8x6144", 0.0, "gemm+", 98304)]
    text = B.ratios(rows)
    assert "fastcomm-auto / nccl: 12K 0.50" in text and "fastcomm-auto / symm-one_shot: 12K 0.80" in text
    assert "fastcomm-auto / nccl after a GEMM, 1x6144: 0.25 (adds 3.00 us against 12.00 us per call)" in text
    assert "host-auto / nccl after a GEMM" not in text  # no NCCL row of that shape to compare with


def test_table_tolerates_a_fully_hidden_interleaved_row():
    table = B.table([_row("fastcomm-auto 8x6144", 0.0, "gemm+", 98304), _row("nccl", 8.0)], world=2)
    lines = table.splitlines()
    assert len(lines) == 4 and "gemm+" in lines[2] and "nan" in lines[2] and "n/a" in lines[2]
    assert not math.isnan(float(lines[3].split()[6]))  # ordinary rows keep their bandwidth


def test_interleave_flag():
    import argparse

    p = argparse.ArgumentParser()
    B.add_arguments(p)
    assert p.parse_args(["--interleave"]).interleave and not p.parse_args([]).interleave


def test_plot_renders_a_png_from_rows(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(impl, us, size=size) for size in (4096, 12288, 1 << 20)
            for impl, us in (("fastcomm-auto", 4.0 + size / 1e5), ("nccl", 8.0 + size / 1e5))]
    rows.append(_row("fastcomm-auto 1x6144", 3.0, "gemm+"))  # not a size sweep: left out of the plot
    path = B.plot(rows, 2, tmp_path / "r.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_no_matplotlib_is_an_import_error_the_command_reports(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("no matplotlib")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(ImportError):
        B.plot([_row("nccl", 8.0)], 2, tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()


def test_table_rows_print_one_by_one(capsys):
    row = _row("nccl", 8.0)
    B._show(row, 0, 2)
    B._show(row, 1, 2)
    assert capsys.readouterr().out == B.table_row(row, 2) + "\n"
    assert B.table([row], 2).splitlines() == [*B.table_header(2), B.table_row(row, 2)]


def test_wire_column_comes_from_the_layout():
    # 12 KB at 8 ranks: fastcomm's one-shot writes 7 payload copies (no flag bytes); NCCL's ring 2 (n-1)/n.
    from fastcomm.policy import Algo, Transport

    class Workspace:  # the three things wire_for reads off a real one
        plan, transport, islands = object(), Transport.P2P, None

        def algo_for(self, nbytes, algo):
            return Algo.ONE_SHOT

    assert B.wire_for((Workspace(), "auto"), 12288, 8) == 7 * 12288
    assert B.wire_for(("nccl", None), 12288, 8) == 2 * 7 * 12288 // 8
    assert B.wire_for(("symm", "one_shot"), 12288, 8) is None
    line = B.table_row(dict(_row("fastcomm-auto", 4.0), wire_bytes=86016), 8)
    assert line.split()[-1] == "86016" and B.table_row(_row("symm-one_shot", 5.0), 8).split()[-1] == "-"


def test_results_name_the_checkouts_commit():
    # Without a commit from the caller (the scripts' FASTCOMM_COMMIT), the checkout's HEAD, as git names it.
    import subprocess

    from fastcomm import measure

    head = measure.source_commit(None)
    git = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    assert head == (git.stdout.strip() if git.returncode == 0 else None)
