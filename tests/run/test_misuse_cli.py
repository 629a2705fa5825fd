"""CLI arguments out of range are usage errors (exit status 2, usage on stderr) caught before
anything runs, and ``plot`` names a file given as the run directory as such; never a traceback."""

from __future__ import annotations

import pytest

from engine.cli.main import main


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_demo_seed_out_of_range_is_a_usage_error_and_writes_nothing(tmp_path, capsys, seed):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as caught:
        main(["demo", "--dir", str(run_dir), "--seed", seed, "--epochs", "1", "--progress", "off"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --seed: {seed} is out of range: expected 0..4294967295" in err
    assert "Traceback" not in err
    assert not run_dir.exists()


def test_demo_seed_at_the_top_of_its_range_is_accepted():
    from engine.cli.main import build_parser

    assert build_parser().parse_args(["demo", "--dir", "d", "--seed", str(2**32 - 1)]).seed == 2**32 - 1


@pytest.mark.parametrize("code", ["256", "-1"])
def test_launch_exit_code_out_of_range_is_a_usage_error_before_launching(tmp_path, capsys, code):
    marker = tmp_path / "ran"
    with pytest.raises(SystemExit) as caught:
        main(["launch", "--exit-code", code, "--", "touch", str(marker)])
    assert caught.value.code == 2
    assert "argument --exit-code" in capsys.readouterr().err
    assert not marker.exists()


def test_plot_of_a_file_says_it_is_a_file(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path / "metrics.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: run directory") and "is a file, not a run directory" in err
