"""ConfigError: the one exception for a wrong configuration value, at the bottom of the
layers so every config section (model, parallel, optim, data, trainer) can raise it."""


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


def check_choice(field: str, value, choices, one_of: bool = True) -> None:
    """ConfigError unless `value` is one of `choices` (a list imported from the module that
    implements them): "<field>=<value>: choose one of a, b, c" (or "choose a, b or c")."""
    if value not in choices:
        *rest, last = choices
        listed = f"one of {', '.join(choices)}" if one_of or not rest else f"{', '.join(rest)} or {last}"
        raise ConfigError(f"{field}={value!r}: choose {listed}")
