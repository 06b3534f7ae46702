"""The Typer application, its global options and the entry point that turns errors into one line.

torch is imported only inside commands, so ``capsctl --help`` stays fast.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from capsctl.errors import CapsctlError
from capsctl.version import __version__

__all__ = ["OUTPUTS", "JsonOpt", "app", "main"]

app = typer.Typer(
    name="capsctl",
    help="Capsule networks with inverted dot-product attention routing (Tsai et al., ICLR 2020).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

_state = {"debug": False}

JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout and nothing else.")
]

#: The help panel of every option that names a path a command writes (``rich_help_panel``);
#: tests/test_output_sweep.py finds the output options by it. Each such path is checked by
#: :func:`capsctl.atomic.check_output` with its kind of output.
OUTPUTS = "Outputs"


def _version(value: bool) -> None:
    if value:
        print(f"capsctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks (also CAPSCTL_DEBUG=1).")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    from capsctl.environment import check_environment, switch

    check_environment()  # every CAPSCTL_* variable, before any work
    _state["debug"] = debug or switch("CAPSCTL_DEBUG", default=False)
    from capsctl.memory import keep_freed_memory
    from capsctl.threads import short_omp_spin

    keep_freed_memory()  # freed tensors' pages are reused, not faulted in again each step
    short_omp_spin()  # before torch is imported: idle OpenMP threads sleep soon
    _log_to_stderr()


def _log_to_stderr() -> None:
    """The library's log records (``capsctl.*`` loggers, e.g. the compiled loops' build notice
    and warnings) as one line each on stderr: ``warning: ...`` or ``note: ...``."""
    import logging

    from capsctl.views.common import err, warning_line

    class _Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            label = "warning:" if record.levelno >= logging.WARNING else "note:"
            err.print(warning_line(record.getMessage(), label), soft_wrap=True)

    log = logging.getLogger("capsctl")
    for h in [h for h in log.handlers if type(h).__name__ == "_Lines"]:
        log.removeHandler(h)  # a second main() in one process (tests) installs it once
    log.addHandler(_Lines(logging.INFO))
    log.setLevel(logging.INFO)
    log.propagate = False


#: The longest error message shown whole. Messages are one short line, but one naming long
#: paths may exceed 200 characters; a longer one (a fault: a listing, a nested message) is cut.
MAX_ERROR_CHARS = 1000


def short_line(message: str) -> str:
    """``message`` as one line of at most :data:`MAX_ERROR_CHARS` characters: its start and its
    end (what to do) kept, the middle cut."""
    if "\n" not in message and len(message) <= MAX_ERROR_CHARS:
        return message
    text = " ".join(message.split())
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[:700]} ... (--debug shows the whole message) ... {text[-200:]}"


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors on stderr, exit code 1 (usage 2); --debug shows tracebacks."""
    debug_flag = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        # Outside standalone mode Typer returns the exit code of a typer.Exit, and turns Ctrl-C
        # (a KeyboardInterrupt before training has installed its own handler) into Exit(130).
        code = app(args=argv, standalone_mode=False)
        if code == 130:
            print("interrupted", file=sys.stderr)
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            sys.exit(code)
    except CapsctlError as e:
        if _state["debug"] or debug_flag:
            raise
        from capsctl.views.common import error

        error(short_line(str(e)))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        if _state["debug"] or debug_flag:
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # click usage errors carry their own exit code
        code = getattr(e, "exit_code", None)
        if code is not None and hasattr(e, "show"):
            e.show()
            sys.exit(code)
        if _state["debug"] or debug_flag:
            raise
        from capsctl.views.common import error

        text = " ".join(str(e).split())  # one line, however long or many-lined the message
        text = text if len(text) <= 160 else text[:157] + "..."
        error(f"{type(e).__name__}: {text} (run with --debug for the traceback)")
        sys.exit(1)
