"""`make demo`'s inputs: bad DEMO_* values and options are refused with what to fix."""

from __future__ import annotations

import socket

import pytest

from demo import prometheus as demo_prometheus
from demo import run


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({"DEMO_SECONDS": "three"}, [], "DEMO_SECONDS='three' is not a number"),
        ({"DEMO_SEED": "1.5"}, [], "DEMO_SEED='1.5' is not a whole number"),
        ({"DEMO_MTBF": "0"}, [], "DEMO_MTBF / --mtbf must be > 0"),
        ({"DEMO_SECONDS": "-5"}, [], "DEMO_SECONDS / --seconds must be ≥ 0"),
        ({"DEMO_SECONDS": "30", "DEMO_MTBF": "20"}, [], "leaves no room for 1 failure"),
        ({}, ["--failure", "Cosmic Rays"], "unknown component(s) 'Cosmic Rays'"),
        ({"DEMO_MTBF": "nan"}, [], "DEMO_MTBF='nan' is not a number"),
        ({"DEMO_SECONDS": "inf"}, [], "DEMO_SECONDS='inf' is not a number"),
        ({}, ["--seconds", "inf"], "must be finite numbers"),
    ],
)
def test_bad_input_is_refused_with_what_to_fix(monkeypatch, capsys, env, argv, message):
    for k in ("DEMO_SECONDS", "DEMO_MTBF", "DEMO_SEED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        run.parse(argv)
    assert exc.value.code != 0
    assert message in f"{exc.value}{capsys.readouterr().err}"


def test_environment_sets_the_run(monkeypatch):
    monkeypatch.setenv("DEMO_SECONDS", "180")
    monkeypatch.setenv("DEMO_MTBF", "45")
    monkeypatch.setenv("DEMO_SEED", "9")
    args = run.parse([])
    assert (args.seconds, args.mtbf, args.seed) == (180.0, 45.0, 9)
    assert run.parse(["--seed", "4"]).seed == 4  # an option wins


def test_defaults_are_the_documented_ones(monkeypatch):
    for k in ("DEMO_SECONDS", "DEMO_MTBF", "DEMO_SEED"):
        monkeypatch.delenv(k, raising=False)
    args = run.parse([])
    assert (args.seconds, args.mtbf, args.seed) == (0.0, 60.0, 3)


def test_a_busy_port_is_named_and_nothing_starts(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code = run.main(
            [
                "--port",
                str(port),
                "--var-dir",
                str(tmp_path / "v"),
                "--report",
                str(tmp_path / "r.json"),
            ]
        )
    assert code == 2
    assert f"[{port}]" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_help_works_whatever_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("DEMO_SECONDS", "abc")
    with pytest.raises(SystemExit) as exc:
        run.parse(["--help"])
    assert exc.value.code == 0
    assert "DEMO_SECONDS" in capsys.readouterr().out


def test_a_run_shorter_than_the_mtbf_says_it_injects_nothing(monkeypatch, capsys):
    monkeypatch.setenv("DEMO_SECONDS", "20")
    monkeypatch.delenv("DEMO_MTBF", raising=False)
    run.parse([])
    assert "no failure will be injected" in capsys.readouterr().err


def test_prometheus_mode_is_off_unless_asked_for(monkeypatch, tmp_path):
    exe = tmp_path / "prometheus"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("DEMO_PROMETHEUS", raising=False)
    assert run.parse([]).prometheus is False
    monkeypatch.setenv("DEMO_PROMETHEUS", "0")
    assert run.parse([]).prometheus is False
    monkeypatch.setenv("DEMO_PROMETHEUS", "1")
    args = run.parse([])
    assert args.prometheus is True
    assert args.prometheus_exe == str(exe)  # the one on PATH
    assert run.parse(["--no-prometheus"]).prometheus is False  # an option wins


def test_prometheus_mode_without_prometheus_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(demo_prometheus, "DEFAULT_EXECUTABLE", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DEMO_PROMETHEUS", "1")
    with pytest.raises(SystemExit) as exc:
        run.parse([])
    assert exc.value.code == 2
    assert "apt-get install prometheus" in capsys.readouterr().err


def test_a_bad_prometheus_flag_is_refused(monkeypatch):
    monkeypatch.setenv("DEMO_PROMETHEUS", "maybe")
    with pytest.raises(SystemExit, match="DEMO_PROMETHEUS='maybe' is not 0 or 1"):
        run.parse([])
