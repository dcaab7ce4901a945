"""An app's own fixtures: a scratch database with the relay tables.

ORDERS_TEST_DATABASE_URL points at a server where the tests may create and
drop a database (default: the local PostgreSQL as user postgres).
"""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
import sqlalchemy as sa

from relay.db import schema

SERVER = os.environ.get("ORDERS_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def database():
    name = f"orders_app_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = sa.make_url(SERVER.replace("postgresql://", "postgresql+psycopg://", 1)).set(
        database=name
    )
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        schema.apply(conn)
    engine.dispose()
    yield url.render_as_string(hide_password=False)
    with psycopg.connect(SERVER, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture
def engine(database):
    engine = sa.create_engine(database)
    yield engine
    engine.dispose()
