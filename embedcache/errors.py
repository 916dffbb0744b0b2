"""One exception type for bad user input: the CLI prints it as a single line and exits 2."""


class UserError(Exception):
    """Bad input (file, image, backbone, label, shape...). The message names the offending item."""
