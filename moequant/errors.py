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


def path_refusal(error: OSError, path) -> str:
    """Why the OS refused `path` (permission, a file in the way, a full or read-only disk), as words."""
    import errno

    reasons = {
        errno.ENOTDIR: "a part of it is a file, not a directory",
        errno.EEXIST: "it exists and is not a directory",
        errno.EACCES: "permission denied",
        errno.EPERM: "the system does not permit it",
        errno.EROFS: "the file system is read-only",
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is used up",
    }
    reason = reasons.get(error.errno, (error.strerror or str(error)).lower())
    where = error.filename if error.filename and str(error.filename) != str(path) else None
    return f"{reason}{f' ({where})' if where else ''}"


def schema_refusal(error: dict) -> str:
    """The first problem a pydantic schema found in a JSON file (one of ValidationError.errors()), as
    words: the dotted key, its value shortened, and what the schema wanted."""
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
    key = f"key '{key}'" if key else "the top level"
    if error["type"] == "missing":
        return f"{key} is missing"
    return f"{key} has value {repr(error.get('input'))[:60]}: {error['msg'][:1].lower()}{error['msg'][1:]}"


PATH_ERRNOS = frozenset(
    {1, 2, 13, 17, 20, 21, 28, 30, 122}
)  # EPERM ENOENT EACCES EEXIST ENOTDIR EISDIR ENOSPC EROFS EDQUOT
