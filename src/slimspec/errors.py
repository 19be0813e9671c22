"""User-facing errors (the CLI prints their message on one line and exits with code 2) and warnings (one
``warning:`` line)."""


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first line of an exception's message (for one-line errors); ``default`` or its type name if empty."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else (type(exc).__name__ if default is None else default)


class SlimSpecError(Exception):
    """An error caused by the user's input (bad files, bad options); never a bug in slimspec."""


class CheckpointError(SlimSpecError):
    """A drafter or target folder that cannot be read or does not hold what it should."""


class RankError(SlimSpecError):
    """A rank specification that cannot be parsed or is out of range."""


class SlimSpecWarning(UserWarning):
    """Something the user should know that does not stop the work (e.g. source tensors a conversion cannot carry)."""


class OptionError(SlimSpecError):
    """A conversion or distillation option that cannot be honoured, in the library's terms.

    The message names options as ``{name}`` fields of ``template``, filled with the option names themselves
    (the Python API's keyword arguments, a manifest's keys); the CLI shows its flags instead (:meth:`render`).
    """

    def __init__(self, template: str, *options: str):
        self.template, self.options = template, options
        super().__init__(self.render(str))

    def render(self, spell) -> str:
        """The message with each option written as ``spell(name)`` (e.g. ``--distill-steps`` for the CLI)."""
        message = self.template
        for name in self.options:
            message = message.replace("{" + name + "}", spell(name))
        return message
