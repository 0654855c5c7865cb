"""Progress lines go to stderr, so a verb's stdout stays its result (`regenerate --json > summary.json`)."""

from draftsmith.progress import progress_bar


def test_plain_progress_lines_go_to_stderr_not_stdout(capsys):
    with progress_bar("answers", total=3, unit="turns") as bar:  # pytest's captured streams are not terminals
        for _ in range(3):
            bar.advance(1, tokens=100)
    out, err = capsys.readouterr()
    assert out == ""
    assert "answers: 3/3 turns" in err and "tok/s" in err
