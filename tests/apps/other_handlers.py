"""A second registry: one new type, and one that clashes with tests.apps.handlers."""

import relay

registry = relay.HandlerRegistry()
extra = relay.HandlerRegistry()


@registry.handler("Effect")
def clashing_effect(message, conn):
    raise AssertionError("never run: the clash stops the daemon at start-up")


@extra.handler("Other")
def other(message, conn):
    pass


not_a_registry = 42
