"""The data package's one exception type.

Every `DataError` message names the offending file or config field and says how to fix it.
"""

from __future__ import annotations


class DataError(ValueError):
    """A problem with token files, tokenizers or the data config that the user can fix."""
