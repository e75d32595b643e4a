"""The one error type for bad user input.

Every problem a user can fix (a missing file, a bad recipe key, an unsupported architecture)
is raised as `UserError` with one sentence naming the file / key / value and what is accepted.
The CLI prints the sentence and exits with code 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: one clear sentence, exit code 2, nothing written."""


class RankLost(Exception):
    """Another rank of an expert-parallel run stopped or stopped answering: one sentence, exit code 1.

    Not a UserError: the input was fine, and the run's finished layers stay on disk for the rerun."""
