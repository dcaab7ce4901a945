from tests.redis_server import Redis, redis_server, redis_streams  # noqa: F401 - fixtures

__all__ = ["Redis", "redis_server", "redis_streams"]
