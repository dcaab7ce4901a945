from tests.nats_server import Nats, nats_helper, nats_server  # noqa: F401 - fixtures

__all__ = ["Nats", "nats_helper", "nats_server"]
