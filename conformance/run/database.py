"""Where a run keeps its failing examples: a directory, or Redis, so that machines can share it.

Hypothesis saves every failing example in its example database and replays
the saved ones first on the next run. Pointed at one shared place (a
directory on a shared volume or a CI cache, or a Redis server through
Hypothesis's own :class:`~hypothesis.extra.redis.RedisExampleDatabase`), a
failure found on one machine replays first on every machine. Each backend and
pass has its own part of the database (a subdirectory, or a Redis key prefix).

>>> database_location("/tmp/ci/../examples")
'/tmp/examples'
>>> database_location("s3://bucket/x")
Traceback (most recent call last):
...
ValueError: 's3://bucket/x': not a directory nor a Redis URL (redis://, rediss://, unix://)
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from conformance.errors import SetupError

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
"""The URL schemes taken as a Redis server (those of ``redis.Redis.from_url``)."""
KEY_PREFIX = "paged-spec"
"""Every Redis key of the suite starts with this, then the backend and pass."""


def database_location(text: str) -> str:
    """A ``--database`` value, checked (also an argparse ``type``): a Redis URL, or a directory.

    A directory is returned absolute (a child process or a later ``cd`` cannot
    move it); it need not exist yet. ``ValueError`` names the problem: a path
    that is a file, an unknown URL scheme, a Redis URL without the ``redis``
    package.
    """
    if text.startswith(REDIS_SCHEMES):
        if not _has_redis():
            raise ValueError(
                f"{text!r} is a Redis URL, but the redis package is not installed "
                "(pip install redis): Hypothesis's RedisExampleDatabase needs it"
            )
        return text
    if "://" in text:
        raise ValueError(f"{text!r}: not a directory nor a Redis URL ({', '.join(REDIS_SCHEMES)})")
    if not text.strip():
        raise ValueError("an empty path is not a directory")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{text!r} exists and is not a directory")
    return str(path.resolve())


def open_database(location: Path | str | None, name: str) -> ExampleDatabase | None:
    """The database of one backend and pass (``name``) at ``location``; ``None``: no database.

    Raises :class:`SetupError` when a Redis server cannot be reached.
    """
    if location is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "backend"
    text = str(location)
    if text.startswith(REDIS_SCHEMES):
        return _redis(text, slug)
    return DirectoryBasedExampleDatabase(str(Path(location) / slug))


def _has_redis() -> bool:
    return importlib.util.find_spec("redis") is not None


def _redis(url: str, slug: str) -> ExampleDatabase:
    """Hypothesis's Redis database at ``url``, its keys under ``paged-spec:<slug>:``."""
    try:
        redis: Any = importlib.import_module("redis")
        extra: Any = importlib.import_module("hypothesis.extra.redis")
    except ImportError as err:
        raise SetupError(
            f"--database {url}: the redis package is not installed (pip install redis): {err}"
        ) from None
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.exceptions.RedisError as err:
        raise SetupError(f"--database {url}: cannot reach the Redis server: {err}") from None
    database: ExampleDatabase = extra.RedisExampleDatabase(
        client, key_prefix=f"{KEY_PREFIX}:{slug}:".encode()
    )
    return database
