"""The errors a user can cause, by kind: the error contract of the CLI (issue 14).

Every mistake in a config, a file or a command line raises one of these at its source, with a
one-line message that names the file / key / override / sample / layer / row and what to do. The
CLI (``moe_rl.cli``) maps exactly ``UserError`` to that line on stderr and exit code 2, with no
traceback (``--debug`` or ``MOE_RL_DEBUG=1`` shows it). Anything else is a bug and keeps its
traceback.

The bottom of the package: imports nothing of it (``moe_rl.config`` sits right above it). Each class is
also a ``ValueError`` so callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager


class UserError(ValueError):
    """Bad input from the user: the message is the whole story (one line, names what to fix)."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, key, value or command-line override is wrong; the message names it."""


class DataError(UserError):
    """A prompt file is unreadable or malformed; the message names the file and 1-based line."""


class CheckpointError(UserError):
    """A checkpoint or weights file is malformed, partial or made for another model/run; the
    message names the file and key."""


class RouteError(UserError):
    """A route record is malformed; the message names sample, layer and row."""


class RunDirError(UserError):
    """The run directory cannot be used as asked (a file, taken, nothing to resume)."""


class DiskFullError(UserError):
    """A write ran out of space (ENOSPC); the message names the path."""


@contextmanager
def disk_full_named(path) -> Iterator[None]:
    """Turn an ENOSPC ``OSError`` inside the block (or a Rust I/O error reporting it, as
    safetensors raises) into ``DiskFullError('no space left on device: PATH')``, PATH the file the
    error names, else ``path``; any other error passes unchanged."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise DiskFullError(f"no space left on device: {e.filename or path}") from None
    except Exception as e:
        if f"(os error {errno.ENOSPC})" not in str(e):
            raise
        raise DiskFullError(f"no space left on device: {path}") from None


def one_line(e: BaseException) -> str:
    """The message of a user error, guaranteed to be one line."""
    return " ".join(str(e).split("\n")).strip() or type(e).__name__
