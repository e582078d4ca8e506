"""The `ndif` command line as a user meets it: help on every flag, every flag in docs/cli.md, bare
`ndif`, `--version`, a mistyped command's suggestion, usage errors as JSON under --json."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from controlplane.ops.cli import _event_line
from dataplane.ops.cli import parser
from schemas.events import ReplicaLoaded
from tests import cli_zygote

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI_MD = (ROOT / "docs" / "cli.md").read_text()
COMMON = {"--nats", "--timeout", "--json", "--help"}  # documented once, at the top of docs/cli.md


def verbs() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def ndif(*args: str) -> subprocess.CompletedProcess[str]:
    """`ndif ARGS` in a process of its own (forked from one that imported the CLI: tests/cli_zygote.py)."""
    return subprocess.CompletedProcess(list(args), *cli_zygote.run_sync(list(args), cwd=ROOT))


def test_every_argument_of_every_command_has_help():
    missing = [f"{verb} {a.option_strings or a.dest}" for verb, p in verbs().items() for a in p._actions
               if not a.help or a.help == argparse.SUPPRESS]
    assert not missing, missing
    top = [a for a in parser()._actions if not isinstance(a, argparse._SubParsersAction)]
    assert all(a.help for a in top)


def test_every_flag_is_on_its_commands_line_in_docs_cli_md():
    """Each `ndif VERB ...` synopsis line of docs/cli.md names every long flag of VERB; the common
    flags are in the block at the top."""
    synopsis: dict[str, str] = {}
    verb = None
    for line in CLI_MD.splitlines():
        m = re.match(r"^\s+ndif ([a-z-]+)\b(.*)$", line)
        if m:
            verb = m.group(1)
            synopsis[verb] = synopsis.get(verb, "") + " " + m.group(2)
        elif verb and re.match(r"^\s+\[", line):  # a synopsis continued on the next line
            synopsis[verb] += " " + line
        else:
            verb = None
    head = CLI_MD.split("## Exit codes")[0]
    missing = []
    for verb, p in verbs().items():
        if verb not in synopsis:
            missing.append(f"no `ndif {verb}` line")
            continue
        for a in p._actions:
            for flag in (o for o in a.option_strings if o.startswith("--")):
                where = head if flag in COMMON else synopsis[verb]
                if not re.search(re.escape(flag) + r"(?![\w-])", where):
                    missing.append(f"ndif {verb} {flag}")
    assert not missing, missing
    assert "--version" in CLI_MD


def test_bare_ndif_prints_the_help_and_exits_2():
    ran = ndif()
    assert ran.returncode == 2 and ran.stdout.startswith("usage: ndif") and "deploy" in ran.stdout, ran


def test_version():
    ran = ndif("--version")
    assert ran.returncode == 0 and re.fullmatch(r"ndif \d+\.\d+\.\d+\S*\n", ran.stdout), ran


@pytest.mark.parametrize(("typed", "meant"), [("stauts", "status"), ("deplyo", "deploy"), ("histroy", "history"),
                                               ("scale-dwn", "scale-down")])
def test_a_mistyped_command_suggests_the_right_one(typed, meant):
    ran = ndif(typed, "x")
    assert ran.returncode == 2 and f"did you mean {meant!r}" in ran.stderr and not ran.stdout, ran
    assert ran.stderr.count("\n") <= 3


def test_an_unknown_command_far_from_any_says_so_without_a_guess():
    ran = ndif("frobnicate")
    assert ran.returncode == 2 and "unknown command 'frobnicate'" in ran.stderr and "did you mean" not in ran.stderr


@pytest.mark.parametrize("args", [["status", "--json", "--bogus"], ["scale", "m", "--json"],
                                  ["replay", "--json"], ["stauts", "--json"]])
def test_usage_errors_under_json_are_one_json_line_on_stdout(args):
    ran = ndif(*args)
    assert ran.returncode == 2, ran
    (line,) = ran.stdout.splitlines()
    body = json.loads(line)
    assert body["ok"] is False and body["error"] == "InvalidCommand" and body["exit_code"] == 2 and body["message"]


def test_infrastructure_errors_under_json_are_json_for_every_verb_with_json():
    """No NATS at the URL: every verb that takes --json answers with a JSON error and exit 5."""
    dead = "nats://127.0.0.1:9"  # discard port: nothing listens
    cases = [("status", []), ("events", []), ("replay", ["--until", "1"]), ("deploy", ["m"]),
             ("scale", ["m", "--replicas", "1"]), ("scale-down", ["m", "--replicas", "0"]), ("evict", ["m"]),
             ("restart", ["m"]), ("queue", []), ("submit", ["m", "--prompt", "hi"])]
    argvs = [[verb, *extra, "--json", "--nats", dead, *(() if verb in ("queue", "submit") else ("--timeout", "2"))]
             for verb, extra in cases]
    with ThreadPoolExecutor(max_workers=len(argvs)) as pool:  # each waits on its connection, not on the CPU
        runs = list(pool.map(lambda argv: ndif(*argv), argvs))
    for (verb, _), ran in zip(cases, runs, strict=True):
        assert "--json" in {o for a in verbs()[verb]._actions for o in a.option_strings}, verb
        assert ran.returncode != 0, (verb, ran)
        body = json.loads(ran.stdout.splitlines()[-1])
        assert body["ok"] is False and body["exit_code"] == ran.returncode and body["message"], (verb, ran)


def test_event_times_say_their_zone():
    ts = datetime(2026, 11, 23, 18, 0, 5, tzinfo=timezone(timedelta(hours=2)))
    ev = ReplicaLoaded(event_id="e", ts=ts, actor="agent:a", model_key="m", replica_id=0, node_id="a")
    assert "2026-11-23 16:00:05Z" in _event_line(7, ev)
    assert ts.astimezone(UTC).hour == 16


def test_an_unknown_flag_is_refused_with_its_commands_usage(capsys: Any) -> None:
    """`ndif deploy M --bogus` prints deploy's usage, not the top level's, and where its flags are."""
    from controlplane.ops.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["deploy", "org/model", "--bogus-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ndif deploy") and "`ndif deploy -h` lists its flags" in err, err


@pytest.mark.parametrize("since", ["-5", "0", "x"])
def test_events_since_takes_only_a_sequence_number(capsys: Any, since: str) -> None:
    """`events --since -5` is refused (exit 2, nothing read), not taken as "from the start"."""
    from controlplane.ops.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["events", f"--since={since}", "--nats", "nats://127.0.0.1:1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --since" in err and "sequence number" in err, err
