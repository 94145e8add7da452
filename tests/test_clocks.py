"""The clock summary that sits beside each end-to-end backend (bench/clocks.py)."""
from fastcomm_bench import clocks

SAMPLES = """\
0, 345, 3201, 75.10, 0
1, 345, 3201, 74.00, 0
0, 1980, 3201, 410.5, 97
1, 1755, 3201, 690.0, 99
0, 1980, 3201, 420.5, 95
1, 1830, 3201, 700.0, 98
0, [N/A], 3201, 80.0, 3
garbage line
"""


def test_summary_uses_busy_samples_only():
    s = clocks.summarize(SAMPLES)
    assert s[0] == {"samples": 3, "busy_samples": 2, "sm_mhz_median": 1980.0, "sm_mhz_min": 1980.0,
                    "mem_mhz_median": 3201.0, "power_w_median": 415.5}
    assert s[1]["sm_mhz_median"] == 1792.5 and s[1]["sm_mhz_min"] == 1755.0 and s[1]["samples"] == 3
    line = clocks.format_line("nccl", s)
    assert line.startswith("nccl: GPU0 SM 1980 MHz (min 1980)") and "GPU1 SM 1792 MHz (min 1755)" in line


def test_idle_or_empty_files_say_so(tmp_path, capsys):
    assert "no busy samples (1 in all)" in clocks.format_line("x", clocks.summarize("0, 345, 3201, 75.1, 0\n"))
    f = tmp_path / "clocks-vllm.csv"
    f.write_text("")
    assert clocks.main([str(f)]) == 0
    assert capsys.readouterr().out.strip() == "clocks-vllm: no samples"


def test_missing_file_is_one_line(tmp_path, capsys):
    assert clocks.main([str(tmp_path / "clocks-none.csv")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "clocks-none.csv: No such file" in err
