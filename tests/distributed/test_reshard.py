

@pytest.mark.exhaustive
@pytest.mark.parametrize("ranks", [1, 4])
@pytest.mark.parametrize("kill_after", [1, 4, 7])  # a first step, an epoch's end, the last epoch
def test_one_world_size_change_at_each_kind_of_boundary(reference: pathlib.Path, tmp_path: pathlib.Path,
                                                       kill_after: int, ranks: int) -> None:
    job = tmp_path / "job"
    assert _torchrun(2, job, 0, kill_after).returncode == 1
    process = _torchrun(ranks, job, 1)
    assert process.returncode == 0, process.stderr[-4000:]
    assert helpers.samples_per_step(job / "out") == helpers.samples_per_step(reference / "out")
    final, uninterrupted = helpers.final_state(job / "out", 0), helpers.final_state(reference / "out", 0)
    for key, value in uninterrupted.items():
        if key.startswith(("param.", "optim.")):
            _assert_close(value, final[key], key)
