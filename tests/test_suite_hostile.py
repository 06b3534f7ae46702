"""Hostile and damaged suite input (issue 37): text that would run in a shell or drive a
terminal, damaged or edited run files, invalid members found only at their turn, YAML errors
that name no file, and the record a busy pair must not get."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import fake_finished_run, run_cli

from capsctl.errors import ConfigError
from capsctl.suites import Member, Suite, load_suite, pair_commands

#: Shell payloads: each creates a file named PWN... in the current folder if it ever runs.
HOSTILE = "$(touch PWN1) `touch PWN2`; touch PWN3 & touch PWN4 | touch PWN5 #'\" x"
#: Characters a terminal would obey (escape sequences, bell, a C1 CSI).
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _one_line(err: str) -> str:
    """The single line of an error output (asserting that it is one line)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def _bash(script: str, cwd: Path) -> list[list[str]]:
    """Feed ``script`` to a real bash in the empty folder ``cwd``, ``capsctl`` being a function
    that records its words (outside ``cwd``); the words of each ``capsctl`` call."""
    calls = cwd.parent / f"{cwd.name}.calls"
    prelude = f"capsctl() {{ printf '%s\\0' \"$@\" END >> {shlex.quote(str(calls))}; }}\n"
    subprocess.run(["bash"], input=prelude + script, cwd=cwd, text=True, timeout=60, check=False)
    if not calls.exists():
        return []
    words = calls.read_text().split("\0")[:-1]
    out, call = [], []
    for w in words:
        if w == "END":
            out.append(call)
            call = []
        else:
            call.append(w)
    return out


def _suite_file(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "suite.json.yaml"
    path.write_text(json.dumps(doc, indent=2))  # JSON is YAML: every string exactly as given
    return path


def _hostile_recipe(tmp_path: Path) -> Path:
    """quickstart's preset copied to a path full of shell syntax."""
    from capsctl.config.presets import preset_dirs

    folder = tmp_path / f"presets {HOSTILE.replace('/', '')}"
    folder.mkdir()
    source = next(d / "quickstart.yaml" for d in preset_dirs() if (d / "quickstart.yaml").exists())
    return Path(shutil.copy(source, folder / "q $(touch PWN6);'x.yaml"))


# -- H2: printed commands, loaded names, the terminal -------------------------------------------


def test_the_bash_harness_sees_a_payload_run(tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    assert _bash("touch PWN0\ncapsctl train 'a b'\n", cwd) == [["train", "a b"]]
    assert [p.name for p in cwd.iterdir()] == ["PWN0"]


def test_printed_commands_fed_to_bash_run_nothing_but_capsctl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from capsctl.training.ownership import RunLock

    recipe = _hostile_recipe(tmp_path)
    doc = {
        "name": "hostile",
        "description": f"d {HOSTILE}\ntouch PWN7",
        "recipe": str(recipe),
        "set": [f"description=x {HOSTILE}", f"data.data_dir=/nowhere/{HOSTILE}"],
        "seeds": [0],
        "tests": [f"t {HOSTILE}"],
        "members": [
            {"name": "done", "note": f"n {HOSTILE}\ntouch PWN8", "seeds": [0, 1]},
            {"name": "partial", "set": [f"name=n {HOSTILE}"]},
            {"name": "busy"},
            {"name": "fresh"},
            {"name": "m", "budget": "matched", "published": {"top1": 0.9, "source": HOSTILE}},
        ],
    }
    suite = _suite_file(tmp_path, doc)
    out = tmp_path / f"out {HOSTILE}"
    args = ["suite", "run", str(suite), "--out", str(out), "--print-commands"]
    code, waiting, err = run_cli(capsys, args)  # nothing finished: the matched one waits
    assert code == 0, err
    assert waiting.splitlines()[-1].startswith("# m seed 0: ")
    for seed in (0, 1):
        fake_finished_run(out / f"done/seed-{seed}", 60.0, {f"t {HOSTILE}": (0.5, 10)})
    (out / "partial/seed-0").mkdir(parents=True)
    (out / "partial/seed-0/last.safetensors").write_bytes(b"")
    lock = RunLock(out / "busy/seed-0").acquire()  # another process trains it
    try:
        code, printed, err = run_cli(capsys, args)
    finally:
        lock.release()
    assert code == 0, err
    for text in (waiting, printed):
        lines = text.splitlines()
        assert len(lines) == 6  # one line per pair, whatever the text holds
        cwd = tmp_path / f"cwd{len(list(tmp_path.glob('cwd*')))}"
        cwd.mkdir()
        calls = _bash(text, cwd)
        assert list(cwd.iterdir()) == []  # no payload ran
        expected = [shlex.split(line) for line in lines if not line.startswith("#")]
        assert [["capsctl", *c] for c in calls] == expected
    words = shlex.split(printed.splitlines()[-1])
    assert f"description=x {HOSTILE}" in words and str(recipe) in words
    assert str(out / "m/seed-0") in words and "train.time_limit=60" in words


def test_a_hostile_name_that_bypassed_the_loader_stays_in_its_comment(tmp_path: Path) -> None:
    hostile = Member("r\ntouch PWN9 #", budget="matched")
    suite = Suite(name="s", recipe="quickstart", members=(Member("a"), hostile), seeds=(0,))
    lines = pair_commands(suite, tmp_path / "out")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    _bash("".join(line + "\n" for line in lines), cwd)
    assert list(cwd.iterdir()) == []
    assert len(lines) == 2 and lines[1].startswith("# ")


@pytest.mark.parametrize(
    "name",
    ["r\ntouch PWN9 #", "a b", "$(touch x)", "a;b", "`x`", ".", "..", "é", "a\x1b[31m", "[red]a"],
)
def test_a_member_name_that_is_not_plain_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    doc = {"recipe": "quickstart", "seeds": [0], "members": ["ok", {"name": name}]}
    with pytest.raises(ConfigError) as e:
        load_suite(_suite_file(tmp_path, doc))
    message = str(e.value)
    assert "\n" not in message and not CONTROL.search(message), message
    assert "suite.members[1].name" in message and repr(name)[:20] in message
    assert "letters, digits" in message


@pytest.mark.parametrize(
    ("member", "needle"),
    [
        ({"name": "a", "seeds": ["0; touch x"]}, "suite.members[0] (a).seeds"),
        ({"name": "a", "seeds": [True]}, "suite.members[0] (a).seeds"),
        ({"name": "a", "set": ["train.epochs=1\ntouch x"]}, "suite.members[0] (a).set[0]"),
        ({"name": "a", "note": "x\x1b]0;title\x07"}, "suite.members[0] (a).note"),
        ({"name": "a", "published": {"top1": 1, "source": "\x1b[2J"}}, "(a).published.source"),
    ],
)
def test_a_member_field_with_control_text_is_refused_naming_the_member(
    tmp_path: Path, member: dict[str, Any], needle: str
) -> None:
    doc = {"recipe": "quickstart", "seeds": [0], "members": [member]}
    with pytest.raises(ConfigError) as e:
        load_suite(_suite_file(tmp_path, doc))
    message = str(e.value)
    assert "\n" not in message and not CONTROL.search(message), message
    assert needle in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("recipe", "quick\nstart"), ("tests", ["t\x1b"]), ("set", ["a=1\rb"]), ("name", "a/../b")],
)
def test_a_suite_field_with_control_text_is_refused(tmp_path: Path, field: str, value: Any) -> None:
    doc = {"recipe": "quickstart", "seeds": [0], "members": ["a"], field: value}
    with pytest.raises(ConfigError, match=f"suite.{field}") as e:
        load_suite(_suite_file(tmp_path, doc))
    assert "\n" not in str(e.value) and not CONTROL.search(str(e.value))


def test_printed_commands_refuse_an_out_folder_that_is_not_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o\ntouch PWN"
    code, printed, err = run_cli(capsys, ["suite", "run", "cifar10-fast", "--out", str(out),
                                          "--print-commands"])  # fmt: skip
    assert code == 2 and printed == ""
    assert "--out" in _one_line(err) and "one line" in err


def test_the_terminal_never_gets_a_control_character(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.text import Text

    from capsctl.views.common import err, error, note, out, print_plain, styled, table

    evil = "caps\x1b]0;pwned\x07\x1b[31m[red]x[/red]\x9b2J\x08"
    print_plain(f'member,note\n{evil},"two\tcells"\n')  # CSV, printed commands
    out.print(evil)
    out.print(Text(evil))
    out.print(table(f"t {evil}", ["member", "n"], [[evil, "1"]], right=(1,)))
    err.print(styled((evil, "bold"), evil))
    note(evil)
    error(evil)
    printed, said = capsys.readouterr()
    for text in (printed, said):
        assert not CONTROL.search(text), repr(text)
        assert "[red]x[/red]" in text  # markup is shown as typed, never obeyed


# -- M2, M3: damaged and edited run files ------------------------------------------------------


def _finished_suite(tmp_path: Path) -> tuple[Path, Path]:
    """A one-member suite (caps, seeds 0 and 1, test file t1) and its two finished runs."""
    suite = tmp_path / "s.yaml"
    suite.write_text("name: s\nrecipe: quickstart\nseeds: [0, 1]\ntests: [t1]\nmembers: [caps]\n")
    runs = tmp_path / "runs"
    for seed, acc in ((0, 0.75), (1, 0.85)):
        fake_finished_run(runs / f"caps/seed-{seed}", 10.0, {"t1": (acc, 200)}, checkpoints=False)
    return suite, runs


@pytest.mark.parametrize("name", ["results.json", "tests.json", "provenance.json"])
@pytest.mark.parametrize("text", ['{"test": {"accuracy": 0.5', "[1, 2]"])
def test_a_damaged_run_file_is_named_never_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str
) -> None:
    suite, runs = _finished_suite(tmp_path)
    damaged = runs / "caps/seed-1" / name
    damaged.write_text(text)
    for args in (
        ["suite", "run", str(suite), "--out", str(runs)],
        ["suite", "report", str(runs), "--suite", str(suite), "--no-score"],
        ["suite", "archive", str(runs), "--suite", str(suite), "--to", str(tmp_path / "ledger")],
    ):
        code, _, err = run_cli(capsys, args)
        assert code == 1, (args, err)
        line = _one_line(err)
        assert f"{damaged}: damaged" in line, line
        assert "restore" in line
    assert damaged.read_text() == text  # nothing lost


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        for key in path[:-1]:
            doc = doc[key]
        doc[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("name", "path", "value", "field"),
    [
        ("tests.json", ["tests", "t1", "accuracy"], "0.9x", "tests.t1.accuracy"),
        ("tests.json", ["tests", "t1", "accuracy"], float("nan"), "tests.t1.accuracy"),
        ("tests.json", ["tests", "t1", "accuracy"], 1.5, "tests.t1.accuracy"),
        ("tests.json", ["tests", "t1", "count"], "many", "tests.t1.count"),
        ("tests.json", ["tests"], [0.5], "tests"),
        ("results.json", ["seconds"], "abc", "seconds"),
        ("results.json", ["test", "accuracy"], float("inf"), "test.accuracy"),
        ("results.json", ["history", 1, "images_per_s"], "fast", "history[1].images_per_s"),
        ("provenance.json", ["trained_by", 0, "cpu"], "\x1b]0;x\x07", "trained_by[0].cpu"),
    ],
)
def test_an_edited_ledger_value_is_named_with_its_file_and_field(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    path: list[Any],
    value: Any,
    field: str,
) -> None:
    suite, runs = _finished_suite(tmp_path)
    edited = runs / "caps/seed-0" / name
    doc = json.loads(edited.read_text())
    _set(path, value)(doc)
    edited.write_text(json.dumps(doc))
    for extra in ([], ["--csv"]):
        args = ["suite", "report", str(runs), "--suite", str(suite), "--no-score", *extra]
        code, printed, err = run_cli(capsys, args)
        assert code == 1, err
        line = _one_line(err)
        assert f"{edited}: damaged ({field}" in line, line
        assert not CONTROL.search(printed + err)


# -- M7: the whole suite is checked before the first run ---------------------------------------


@pytest.mark.parametrize(
    ("member_set", "needle"),
    [
        ("['model.router={name: dynamc}']", "model.router.name"),
        ("[model=resnet81]", "resnet81"),
        ("[train.epochs=many]", "train.epochs"),
    ],
)
def test_an_invalid_member_is_refused_before_the_first_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    member_set: str,
    needle: str,
) -> None:
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\nrecipe: quickstart\nseeds: [0]\nmembers:\n  - name: good\n"
        f"  - name: typo\n    set: {member_set}\n"
    )

    def no_training(*a: object, **k: object) -> None:
        raise AssertionError("a pair trained before the suite was checked")

    monkeypatch.setattr("capsctl.training.train_from_preset", no_training)
    for extra in ([], ["--print-commands"]):
        args = ["suite", "run", str(suite), "--out", str(tmp_path / "out"), *extra]
        code, printed, err = run_cli(capsys, args)
        assert code == 2, err
        line = _one_line(err)
        assert "member typo" in line and needle in line, line
        assert printed == ""
        assert not (tmp_path / "out").exists()  # refused before anything is written


# -- M8: a busy pair's provenance --------------------------------------------------------------


def test_a_busy_pair_gets_no_resumed_record(tmp_path: Path, tiny_trained_run: Path) -> None:
    """An interrupted pair that another process holds is left to it: this process adds nothing
    to its provenance (it did not train it)."""
    from capsctl.config.yaml_io import load_yaml
    from capsctl.suites import run_suite
    from capsctl.training.ownership import RunLock

    seed = load_yaml((tiny_trained_run / "preset.yaml").read_text())["train"]["seed"]
    folder = tmp_path / f"runs/caps/seed-{seed}"
    shutil.copytree(tiny_trained_run, folder)
    (folder / "results.json").unlink()  # interrupted: a checkpoint, no results
    recipe = shutil.copy(folder / "preset.yaml", tmp_path / "recipe.yaml")
    suite = Suite(name="s", recipe=str(recipe), members=(Member("caps"),), seeds=(seed,))
    events: list[dict[str, Any]] = []
    lock = RunLock(folder).acquire()
    try:
        result = run_suite(suite, tmp_path / "runs", on_event=events.append, handle_sigint=False)
    finally:
        lock.release()
    assert [p["status"] for p in result.pairs] == ["busy"]
    assert not (folder / "provenance.json").exists()


# -- L3: one-line errors -----------------------------------------------------------------------

BROKEN = "name: x\nrecipe: quickstart\nseeds: [0\nmembers: [a]\n"


def test_a_broken_suite_file_is_named_with_line_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN)
    args = ["suite", "run", str(bad), "--out", str(tmp_path / "o"), "--print-commands"]
    code, _, err = run_cli(capsys, args)
    assert code == 2
    line = _one_line(err)
    assert f"{bad}:4:" in line and "column 8" in line and "fix" in line, line
    assert "<unicode string>" not in line and len(line) - len(str(bad)) <= 200


def test_a_broken_suite_copy_or_pair_preset_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite, runs = _finished_suite(tmp_path)
    copy = runs / "suite.yaml"
    copy.write_text(BROKEN)
    code, _, err = run_cli(capsys, ["suite", "report", str(runs)])
    assert code == 2 and f"{copy}:4:" in _one_line(err)
    copy.unlink()
    preset = runs / "caps/seed-0/preset.yaml"
    preset.write_text("name: q\nmodel: {a: [1,\n")
    code, _, err = run_cli(capsys, ["suite", "run", str(suite), "--out", str(runs)])
    assert code == 2
    line = _one_line(err)
    assert f"{preset}:3:" in line and "<unicode string>" not in line, line


def test_archive_to_an_existing_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite, runs = _finished_suite(tmp_path)
    target = tmp_path / "ledger.txt"
    target.write_text("keep me")
    args = ["suite", "archive", str(runs), "--suite", str(suite), "--to", str(target)]
    code, _, err = run_cli(capsys, args)
    assert code == 2
    line = _one_line(err)
    assert str(target) in line and "folder" in line and "FileExistsError" not in line, line
    assert target.read_text() == "keep me"


def test_an_unexpected_error_is_shown_on_one_short_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("first line\n  second line\x1b[31m\n" + "x" * 500)

    monkeypatch.setattr("capsctl.suites.list_suites", boom)
    code, _, err = run_cli(capsys, ["suite", "list"])
    assert code == 1
    line = _one_line(err)
    assert "RuntimeError: first line second line" in line and "--debug" in line
    assert len(line) <= 260 and not CONTROL.search(line)


# -- H2 sweep: the commands suggested to the user ----------------------------------------------


def _suggested(text: str, start: str) -> str:
    """The command in ``text`` that starts with ``start``, to the end of its line (or the
    closing parenthesis a message puts around it)."""
    line = text[text.index(start) :].splitlines()[0]
    return line.removesuffix(" scores it)").removesuffix(") or pass another run folder")


def test_suggested_commands_quote_their_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite, runs = _finished_suite(tmp_path)
    hostile = runs.rename(tmp_path / f"runs {HOSTILE}")
    code, _, err = run_cli(capsys, ["suite", "run", str(suite), "--out", str(hostile)])
    assert code == 0, err
    commands = [_suggested(err, "capsctl suite report ")]
    tests = hostile / "caps/seed-1/tests.json"
    tests.write_text('{"tests": {}}')  # unscored: archive names the command that scores it
    args = ["suite", "archive", str(hostile), "--to", str(tmp_path / "ledger")]
    code, printed, err = run_cli(capsys, args)
    assert code == 0, err
    commands.append(_suggested(printed, "capsctl suite report "))
    plain = tmp_path / "p $(touch PWN6);'x"  # short: a long error message is cut
    plain.mkdir()  # a folder without metrics.jsonl: the error names how to train one
    code, _, err = run_cli(capsys, ["plot", str(plain)])
    assert code == 1, err
    commands.append(_suggested(err, "capsctl train --preset NAME").replace("NAME", "n"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    calls = _bash("".join(c + "\n" for c in commands), cwd)
    assert list(cwd.iterdir()) == []
    assert calls == [
        ["suite", "report", str(hostile)],
        ["suite", "report", str(hostile)],
        ["train", "--preset", "n", "--out", str(plain)],
    ]


def test_a_model_card_quotes_its_folder_in_its_commands(tmp_path: Path) -> None:
    from capsctl.export.card import model_card

    name = f"m {HOSTILE}"
    card = model_card({}, name=name, params={"total": 1, "trainable": 1}, gflops=None)
    block = card.split("```bash\n")[1].split("```")[0]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    calls = _bash(block, cwd)
    assert list(cwd.iterdir()) == []
    assert calls == [
        ["eval", name],
        ["inspect-routing", name],
        ["export", name, "--format", "onnx"],
    ]
