"""Engines and migrations (alembic, driven programmatically so `mooncake db ...` needs no
alembic.ini in the working directory)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from mooncake.config import normalise_database_url


def async_engine(url: str, *, pool_size: int = 5) -> AsyncEngine:
    return create_async_engine(normalise_database_url(url), pool_size=pool_size, pool_pre_ping=True)


def sync_engine(url: str) -> Engine:
    return create_engine(normalise_database_url(url), pool_pre_ping=True)


def migrations_dir() -> Path:
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "migrations", here.parents[1] / "_migrations"):
        if (candidate / "env.py").exists():
            return candidate
    raise FileNotFoundError("alembic migrations not found next to the package")


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # '%' is interpolation syntax in alembic's ConfigParser.
    cfg.set_main_option("sqlalchemy.url", normalise_database_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def check(url: str) -> None:
    """Raise if the models and the migrations have drifted apart (`alembic check`)."""
    command.check(alembic_config(url))
