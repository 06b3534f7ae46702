"""Suites: sets of (member, seed) training runs described as data, run resumably and reported
as tables of mean and spread over seeds (``capsctl suite``)."""

from capsctl.suites.commands import pair_commands
from capsctl.suites.report import MemberRow, SuiteReport, report_suite
from capsctl.suites.results_file import read_results, write_results
from capsctl.suites.runner import plan_pairs, run_suite, score_run
from capsctl.suites.spec import Member, Suite, list_suites, load_suite

__all__ = [
    "Member",
    "MemberRow",
    "Suite",
    "SuiteReport",
    "list_suites",
    "load_suite",
    "pair_commands",
    "plan_pairs",
    "read_results",
    "report_suite",
    "run_suite",
    "score_run",
    "write_results",
]
