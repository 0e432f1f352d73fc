"""What the command lines share (python -m olmo_jax.train, .plan, .report, .convert, .tokenize).

- `CONFIG`: the --config flag (a configs/*.py file, `--config.a.b=c` overrides type-checked
  against its fields: `lock_config=True`), defined once in absl's global flags for train
  and plan; `define_config_flag` defines it in another FlagValues (report parses its own).
- `parse_flags(argv)`: absl's `flags_parser` for `app.run`; `parse(argv, flag_values)`
  raises `UsageError` instead. An override of a field that does not exist is named, with
  the nearest existing fields (or where a removed field's setting lives now).
- `error(msg)` / `fail(msg)`: bad input is ONE `error: <msg>` line on stderr and exit
  code 2 (`EXIT_BAD_INPUT`), never a traceback.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import NoReturn

from absl import app, flags
from ml_collections import config_flags

EXIT_BAD_INPUT = 2
EXIT_STORAGE = 74  # EX_IOERR: writing the run folder failed (errors.StorageError)
CONFIG_HELP = "Path to a config file (configs/*.py)."


class UsageError(ValueError):
    """The command line is wrong (a flag, or an override of the config file)."""


def define_config_flag(flag_values: flags.FlagValues = flags.FLAGS, help: str = CONFIG_HELP):
    return config_flags.DEFINE_config_file("config", None, help, flag_values=flag_values,
                                           lock_config=True)


CONFIG = define_config_flag()


def required_config(argv: list[str], flag=None):
    """The --config ConfigDict of a command taking no positional arguments; absl's usage
    error (with the help text) when either is wrong."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    cfg = (flag or CONFIG).value
    if cfg is None:
        raise app.UsageError("--config=configs/<name>.py is required")
    return cfg


def _config_load_error(path: str, err: BaseException) -> str:
    chain, e = [], err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, SyntaxError):
            return (f"--config={path}: syntax error in {e.filename or path}, line {e.lineno}: "
                    f"{e.msg}; fix the file")
    cause = chain[-1]
    return f"--config={path} cannot be loaded: {type(cause).__name__}: {cause}"


def config_filename(flag_values: flags.FlagValues = flags.FLAGS) -> str:
    """The --config file's path as given (without a ':' argument)."""
    return config_flags.get_config_filename(flag_values["config"])


def error(msg: str) -> int:
    """Prints the one `error:` line of bad input; returns its exit code."""
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def fail(msg: str) -> NoReturn:
    sys.exit(error(msg))


def config_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def explain_parse_error(argv: list[str], err: Exception) -> str:
    """Name the override that does not exist in the config file, if that is the cause."""
    from olmo_jax.config import has_path, unknown_key_error  # jax: only for a bad override

    path = config_path(argv)
    if path is None:
        return f"{err}; pass --config=configs/<name>.py"
    try:
        cfg = runpy.run_path(path.split(":", 1)[0])["get_config"]()
    except Exception as load_err:  # the config file itself is broken
        return f"cannot load config file {path}: {load_err}"
    for a in argv:
        if a.startswith("--config.") and "=" in a:
            dotted = a[len("--config."):].split("=", 1)[0]
            if not has_path(cfg, dotted):
                return f"{unknown_key_error(cfg, dotted)} (from {a})"
    return f"invalid command line: {err}"


def parse(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """flag_values(argv): the arguments left; a parse error raises UsageError naming the
    override or flag at fault."""
    path = config_path(argv)
    if path is not None and not os.path.isfile(path.split(":", 1)[0]):
        raise UsageError(f"--config={path}: no such file {path.split(':', 1)[0]}; pass an "
                         "existing config file, e.g. --config=configs/tiny.py")
    try:
        return flag_values(argv)
    except (SyntaxError, OSError) as e:  # the config file is broken
        raise UsageError(_config_load_error(path or "?", e)) from None
    except flags.UnrecognizedFlagError as e:
        raise UsageError(explain_parse_error(argv, e)) from None
    except flags.Error as e:
        raise UsageError(str(e)) from None
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise UsageError(explain_parse_error(argv, e)) from None


def parse_flags(argv: list[str]) -> list[str]:
    """absl `app.run(main, flags_parser=parse_flags)`: a bad command line exits with code
    2 and one `error:` line."""
    try:
        return parse(argv)
    except UsageError as e:
        fail(str(e))
