"""capsctl's environment variables: every CAPSCTL_* name the code reads is known to
:mod:`capsctl.environment`; switches take 0/1, false/true, no/yes, off/on in any case and refuse
anything else; numbers are checked whatever else is set; a bad value is one line, exit code 2,
before any work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

from capsctl import environment
from capsctl.errors import UsageError


def test_every_capsctl_variable_the_code_reads_is_known() -> None:
    named = set()
    for path in (ROOT / "capsctl").rglob("*.py"):
        named |= set(re.findall(r"\bCAPSCTL_[A-Z_]+\b", path.read_text()))
    named.discard("CAPSCTL_KERNELS_ABI")  # a C macro of csrc/abi.h, not a variable
    assert named == set(environment.KNOWN), named ^ set(environment.KNOWN)
    read_as = {*environment.SWITCHES, *environment.NUMBERS}
    assert {"CAPSCTL_NATIVE", "CAPSCTL_CHUNK_MIB", "CAPSCTL_DEBUG"} <= read_as


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", False), ("false", False), ("No", False), ("OFF", False), (" 1 ", True),
     ("TRUE", True), ("yes", True), ("On", True), ("", None)],
)  # fmt: skip
def test_switches_take_the_usual_words(
    text: str, value: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAPSCTL_NATIVE", text)
    assert environment.switch("CAPSCTL_NATIVE", default=None) is value  # type: ignore[arg-type]


def test_native_false_turns_the_compiled_loops_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from capsctl.layers.backend import native

    native._load.cache_clear()
    monkeypatch.setenv("CAPSCTL_NATIVE", "false")
    try:
        assert native.native_status().startswith("off (CAPSCTL_NATIVE=false)")
    finally:
        native._load.cache_clear()


@pytest.mark.parametrize("name", sorted(environment.SWITCHES))
def test_a_bad_switch_is_one_line_at_start(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(name, "maybe")
    code, out, err = run_cli(capsys, ["presets", "--json"])
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert f"{name}=maybe" in line and "0 or 1" in line, line


@pytest.mark.parametrize("bad", ["lots", "nan", "inf", "-1", "0", "1e30"])
@pytest.mark.parametrize("name", sorted(environment.NUMBERS))
def test_a_bad_number_is_one_line_at_start_whatever_else_is_set(
    name: str, bad: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CAPSCTL_NATIVE", "1")  # checked with the compiled loops on too
    monkeypatch.setenv(name, bad)
    code, out, err = run_cli(capsys, ["presets", "--json"])
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert name in line and repr(bad) in line, line


def test_the_library_refuses_a_bad_switch_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSCTL_TRITON", "nope")
    with pytest.raises(UsageError, match="CAPSCTL_TRITON=nope"):
        environment.switch("CAPSCTL_TRITON", default=True)


def test_paths_are_not_switches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CAPSCTL_CACHE", str(tmp_path / "yes"))
    environment.check_environment()
