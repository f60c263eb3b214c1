"""What reaches the command line: one line per error, the traceback of an unexpected one saved to a file."""
from __future__ import annotations

import pytest

from eagle3 import cli


def parser_raising(e: BaseException):
    """The real parser, with `verify`'s work replaced by one that raises `e` (a bug's exception, here)."""
    ap = cli.build_parser()
    sub = next(x for x in ap._actions if x.dest == "cmd")

    def boom(a):
        raise e

    sub.choices["verify"].set_defaults(func=boom)
    return ap


def test_an_unexpected_exception_is_one_line_naming_its_saved_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EAGLE3_DEBUG", raising=False)
    assert cli.main(["verify", str(tmp_path)], parser=parser_raising(KeyError("rows"))) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("eagle3 verify: error: 'rows' (traceback: ")
    path = err.rsplit("(traceback: ", 1)[1].rstrip(")")
    text = open(path).read()
    assert path.startswith(str(tmp_path / "errors")) and "KeyError: 'rows'" in text and "in boom" in text


def test_a_user_error_is_one_line_without_a_traceback_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path))
    assert cli.main(["verify", str(tmp_path)], parser=parser_raising(ValueError("x.json: not valid JSON"))) == 2
    assert capsys.readouterr().err == "eagle3 verify: error: x.json: not valid JSON\n"
    assert not (tmp_path / "errors").exists()


def test_debug_raises_the_exception_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path))
    with pytest.raises(KeyError):
        cli.main(["verify", str(tmp_path), "--debug"], parser=parser_raising(KeyError("rows")))
