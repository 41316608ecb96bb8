"""The one error type a user sees as a single line (exit code 2), never as a traceback."""


class UserError(Exception):
    """Bad input: the message names the file, the key, the value and the fix, on one line."""
