"""The package's exception types, at the bottom of the layers so every part can raise
them: ConfigError for a wrong configuration value (every config section: model,
parallel, optim, data, trainer), CheckpointError for checkpoint and conversion failures,
DataError for token files, tokenizers and the data config, StorageError for a write to
the run folder that failed (a full disk, an I/O error)."""


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


class CheckpointError(ConfigError):
    """A checkpoint or Hugging Face folder is missing, incomplete, corrupt, does not fit
    the model, or holds something olmo_jax cannot represent.

    Every message names the file, item or parameter at fault and, where there is one,
    the fix."""


class DataError(ValueError):
    """A problem with token files, tokenizers or the data config that the user can fix.

    Every message names the offending file or config field and says how to fix it."""


class StorageError(Exception):
    """Writing the run's files failed (a full disk, an I/O error, a lost mount): not the
    user's input but the storage under trainer.run_dir. The message names the run folder,
    what was being written, the space needed and free, and the last complete checkpoint
    (the command line exits with its own code, cli.EXIT_STORAGE)."""


def check_choice(field: str, value, choices, one_of: bool = True) -> None:
    """ConfigError unless `value` is one of `choices` (a list imported from the module that
    implements them): "<field>=<value>: choose one of a, b, c" (or "choose a, b or c")."""
    if value not in choices:
        *rest, last = choices
        listed = f"one of {', '.join(choices)}" if one_of or not rest else f"{', '.join(rest)} or {last}"
        raise ConfigError(f"{field}={value!r}: choose {listed}")
