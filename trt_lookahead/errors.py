"""UserError: bad input from a user; the CLI prints its message on one line and exits 2."""


class UserError(ValueError):
    """A problem with what the user asked for; the message names the problem and the fix."""
