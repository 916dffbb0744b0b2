"""What both command lines (`embedcache`, `fedheads`) share: the exception boundary.

- `UserError` (bad input): one line `error: ...`, exit 2.
- Ctrl-C: one line, exit 130.
- Anything else is a bug or an unforeseen failure (the known ones are turned into UserErrors
  where they happen): one line `error: internal error: <Type>: <msg> (...)`, exit 1; with
  FEDFROZEN_DEBUG=1 the traceback is shown instead.
- `embedcache.store.reader.StoreWarning` (a store read correctly but not as written): one `note:` line.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator

import click

from embedcache.errors import StoreWarning, UserError

DEBUG_ENV = "FEDFROZEN_DEBUG"


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


class UserErrorGroup(click.Group):
    """Turns a `UserError` anywhere below into one line on stderr (`error: ...`) and exit code 2,
    and any other exception into one `internal error` line and exit code 1 (see module doc)."""

    def invoke(self, ctx: click.Context):
        try:
            with _store_notes():
                return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click prints usage errors itself; Exit carries --help/--version
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # the reader went away (`fedheads algorithms | head`): nothing to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
            sys.exit(1)
        except Exception as exc:
            if _debug():
                raise
            msg = " ".join(str(exc).split()) or "(no message)"
            click.echo(f"error: internal error: {type(exc).__name__}: {msg} "
                       f"(run with {DEBUG_ENV}=1 for the traceback)", err=True)
            sys.exit(1)


@contextlib.contextmanager
def _store_notes() -> Iterator[None]:
    """Show `StoreWarning`s as `note: ...` lines on stderr while a command runs."""
    with warnings.catch_warnings():  # restores showwarning and the filters afterwards
        warnings.simplefilter("always", StoreWarning)  # the reader already says each note once
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, StoreWarning):
                click.echo(f"note: {message}", err=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield
