"""The LM-head cost bench (cloud_verifier.bench.lm_head_cost) prints one time per row count
and refuses bad counts."""

import re

import pytest

from cloud_verifier.bench.lm_head_cost import main


def test_prints_a_positive_time_per_row_count(capsys):
    assert main(["--rows", "1", "3", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [re.match(r"rows (\d+): ", line).group(1) for line in lines] == ["1", "3"]
    assert all(float(line.split(": ")[1].removesuffix(" ms")) > 0 for line in lines)


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--repeats", "0"], ["--threads", "0"]])
def test_bad_counts_are_refused(argv):
    with pytest.raises(SystemExit, match="must be >= 1"):
        main(argv)
