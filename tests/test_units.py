"""The one size parser: what the command line and the FASTCOMM_* sizes accept."""
import pytest

from fastcomm.measure import sizes
from fastcomm.units import format_size, parse_size


@pytest.mark.parametrize("text,want", [("4096", 4096), ("12K", 12288), ("8M", 8 << 20), ("1.5M", 3 << 19),
                                       ("64KiB", 64 << 10), ("2MB", 2 << 20), ("1g", 1 << 30), ("0", 0)])
def test_parse(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text,says", [("-1K", "negative"), ("-1", "negative"), ("inf", "not a size"),
                                       ("nan", "not a size"), ("1.3", "whole number"), ("", "not a size"),
                                       ("12Q", "not a size")])
def test_refuse(text, says):
    with pytest.raises(ValueError, match=says):
        parse_size(text)


def test_format_round_trips():
    for n in (1, 1000, 12288, 8 << 20, 3 << 30):
        assert parse_size(format_size(n, compact=True)) == n


def test_sweeps_that_never_end_are_refused():
    assert sizes(1024, 4096, 2) == [1024, 2048, 4096]
    for lo, hi, f in ((0, 1 << 20, 2), (-1024, 1 << 20, 2), (1, 1 << 30, 1.0000001), (1, 1 << 20, 1), (4, 2, 2),
                      (1, 16, float("nan")), (1, 16, 0)):
        with pytest.raises(ValueError):
            sizes(lo, hi, f)
