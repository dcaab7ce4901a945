"""relay: the transactional outbox and inbox patterns for PostgreSQL, RabbitMQ and SQS.

Producers call `enqueue` (or `enqueue_async`) inside their own transaction;
consumers register handlers on a `HandlerRegistry`. The daemons are
`relay outbox` and `relay inbox`.
"""

from relay.handlers import HandlerRegistry, Message
from relay.producer import enqueue, enqueue_async

__all__ = ["HandlerRegistry", "Message", "enqueue", "enqueue_async"]
