"""The errors a user's input causes, apart from the bugs.

A `UserError` says what the user gave (a recipe field, a path, a value) and how to fix it, in one sentence.
`hf-attn-zoo` and `training/train.py` print it as one line on stderr and exit with status 2, the way argparse treats
a bad option; any other exception is a bug and keeps its traceback. It is a `ValueError` (and `MissingPathError`
also a `FileNotFoundError`), so code that catches those keeps working.
"""

import sys

USAGE_STATUS = 2  # argparse's exit status for a usage error


class UserError(ValueError):
    """A bad recipe, option or value; the message names the field and the fix."""


class MissingPathError(UserError, FileNotFoundError):
    """A path the user gave does not exist, or lacks what the command needs (weights, a tokenizer)."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (a message from a library may span several)."""
    return " ".join(str(error).split())


def report(error: UserError, prog: str) -> int:
    """Print `prog: message` on stderr; the exit status of a usage error."""
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
    return USAGE_STATUS
