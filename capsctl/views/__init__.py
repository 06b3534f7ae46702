"""What the terminal shows: rich tables, progress bars and one-line notes, one module per command.

The CLI (:mod:`capsctl.cli`) calls one library function per command and hands its result to a
function here. Nothing in the library imports this package.
"""
