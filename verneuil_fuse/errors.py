"""What `verneuilctl` and `verneuil` tell a user when something stops them:
one `UserError` (a message of one line and an exit code, never a traceback)
and the exit codes both programs use."""
from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1         # the operation failed (store, data, timeout)
EXIT_USAGE = 2         # bad arguments or configuration (argparse uses 2 as well)
EXIT_SOURCE = 3        # verneuil: the store cannot be opened or listed
EXIT_MOUNT = 4         # verneuil: the mount point cannot be mounted
EXIT_INTERRUPTED = 130  # SIGINT, as shells report it


class UserError(Exception):
    """A problem the user can fix or must know of: printed as one line."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR):
        super().__init__(" ".join(str(message).splitlines()))  # always one line
        self.exit_code = exit_code


__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_MOUNT", "EXIT_OK", "EXIT_SOURCE", "EXIT_USAGE", "UserError"]
