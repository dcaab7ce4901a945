"""The package people install: `relay --version` says the version the
distribution was built with, whatever the distribution is named."""

from __future__ import annotations

import importlib.metadata

import relay


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
