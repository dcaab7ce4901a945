from tests.kafka_server import Kafka, kafka, kafka_server  # noqa: F401 - fixtures

__all__ = ["Kafka", "kafka", "kafka_server"]
