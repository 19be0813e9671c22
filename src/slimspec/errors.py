"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class SlimSpecError(Exception):
    """An error caused by the user's input (bad files, bad options); never a bug in slimspec."""


class CheckpointError(SlimSpecError):
    """A drafter or target folder that cannot be read or does not hold what it should."""


class RankError(SlimSpecError):
    """A rank specification that cannot be parsed or is out of range."""
