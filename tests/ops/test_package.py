"""The package people install (the distribution relay-outbox): `relay
--version` says the version it was built with, and the built wheel runs
from a fresh virtual environment outside the checkout."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import tarfile

import pytest

import relay
from tests.conftest import REPO


def test_relay_version_prints_the_installed_distributions_version(run_relay):
    result = run_relay("--version")
    assert result.returncode == 0, result.stderr
    # The distribution that installed the `relay` command (its name on the
    # index is not `relay`: that one is someone else's).
    (version,) = {
        dist.version
        for dist in importlib.metadata.distributions()
        for ep in dist.entry_points
        if ep.group == "console_scripts" and ep.value == "relay.cli:main"
    }
    assert result.stdout.strip() == f"relay, version {version}"
    assert version == relay.__version__


@pytest.mark.timeout(300)
def test_the_built_wheel_runs_from_a_fresh_environment(tmp_path):
    """The wheel and sdist `python -m build` makes, the wheel installed into a
    new virtual environment away from the checkout: the commands run from it
    (its dependencies come from this environment, by a path, not a copy;
    .ci/run installs them from the index)."""
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    version = relay.__version__
    (wheel,) = dist.glob(f"relay_outbox-{version}-py3-none-any.whl")
    (sdist,) = dist.glob(f"relay_outbox-{version}.tar.gz")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert f"relay_outbox-{version}/CHANGELOG.md" in names
    assert f"relay_outbox-{version}/schema/005_audit.sql" in names

    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
    )
    (site,) = (env_dir / "lib").glob("python3*/site-packages")
    # The dependencies, by a path: a plain line of a .pth file (this
    # environment's own .pth files, the editable checkout's among them, are
    # not read from there).
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "PYTHON"))}

    def run(*args: str) -> str:
        result = subprocess.run(
            [str(env_dir / "bin" / "relay"), *args],
            capture_output=True,
            text=True,
            cwd=away,
            env=env,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert run("--version").strip() == f"relay, version {version}"
    assert "replay" in run("--help") and "audit" in run("--help")
    assert "CREATE TABLE IF NOT EXISTS relay_audit" in run("schema", "sql")
    assert "--producer-only" in run("demo", "--help")
    where = subprocess.run(
        [str(python), "-c", "import relay; print(relay.__file__)"],
        capture_output=True,
        text=True,
        cwd=away,
        env=env,
        check=True,
    ).stdout
    assert where.startswith(str(site)), where


@pytest.mark.parametrize(
    ("args", "allowed"),
    [
        (["--help"], ""),
        (["dead", "--help"], ""),
        # the DDL is SQLAlchemy's, printed without a connection
        (["schema", "sql"], "sqlalchemy relay.db"),
    ],
)
def test_help_and_schema_sql_load_no_database_or_broker_code(args, allowed):
    """relay.cli imports the library inside each command: a command that
    needs no server loads no driver, no broker client and no web stack."""
    script = f"""
import sys
sys.argv = ["relay", *{args!r}]
from relay.cli import main
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
heavy = {{"psycopg", "psycopg_pool", "sqlalchemy", "aio_pika", "aiormq", "boto3",
         "botocore", "aiobotocore", "starlette", "uvicorn", "jinja2"}}
loaded = {{m.split(".")[0] for m in sys.modules}} & heavy
loaded |= {{m for m in ("relay.db", "relay.brokers", "relay.console") if m in sys.modules}}
print("loaded:", " ".join(sorted(loaded - set({allowed.split()!r}))), file=sys.stderr)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout, "the command printed nothing"
    assert result.stderr.strip().splitlines()[-1] == "loaded:"
