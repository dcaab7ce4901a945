"""Settings: one frozen object per command, built and validated here.

The CLI parses flags and RELAY_* variables into these; the library takes them.
Every check that can fail on bad input raises ConfigError with one clear line.
"""

from __future__ import annotations

import dataclasses
import os
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from relay.errors import ConfigError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}

DEFAULT_OUTBOX_RETENTION = 86400.0
DEFAULT_INBOX_RETENTION = 7 * 86400.0


def parse_duration(text: str | float) -> float:
    """`90s`, `30m`, `24h`, `7d` or plain seconds, as seconds."""
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        match = _DURATION.match(text)
        if not match:
            raise ConfigError(
                f"invalid duration {text!r}: use a number of seconds or 90s, 30m, 24h, 7d"
            )
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds <= 0:
        raise ConfigError(f"invalid duration {text!r}: must be greater than zero")
    return seconds


# Where a list of broker URLs (`amqp://a/,amqp://b/`) starts its next URL.
_NEXT_URL = re.compile(r",(?=\s*[A-Za-z][A-Za-z0-9+.-]*://)")


def split_urls(url: str) -> list[str]:
    """The URLs of a comma-separated list (one URL gives a list of one)."""
    return [part.strip() for part in _NEXT_URL.split(url)]


def redact_url(url: str) -> str:
    """The URL (or each URL of a comma-separated list) with its password
    replaced by ***, for logs and errors."""
    if _NEXT_URL.search(url):
        return ",".join(_redact_one(part) for part in _NEXT_URL.split(url))
    return _redact_one(url)


# Query parameters that hold a secret (kafka://…?ssl.key.password=…).
_SECRET_PARAM = re.compile(r"(?<=[?&])([^=&]*password[^=&]*)=[^&]*", re.IGNORECASE)


def _redact_one(url: str) -> str:
    if "?" in url:
        head, _, query = url.partition("?")
        if _SECRET_PARAM.search("?" + query):
            url = head + _SECRET_PARAM.sub(r"\1=***", "?" + query)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        if "@" in url and "@" not in parts.netloc:
            # Malformed (`user:pass@host`, `postgresql:/user:pass@host`): the
            # parser found no user info, so mask from the first ':' that does
            # not start `://` up to the last '@'.
            head, _, tail = url.rpartition("@")
            colon = re.search(r":(?!/)", head)
            if colon:
                return f"{head[: colon.start()]}:***@{tail}"
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def url_password(url: str | None) -> str | None:
    """The password in a URL (percent-decoded), so logs can mask it."""
    if not url:
        return None
    try:
        password = urllib.parse.urlsplit(url).password
    except ValueError:
        return None
    return urllib.parse.unquote(password) if password else None


def url_passwords(url: str | None) -> list[str]:
    """The passwords of a URL or of each URL of a comma-separated list."""
    if not url:
        return []
    return [p for p in (url_password(part) for part in split_urls(url)) if p]


def normalize_database_url(url: str, what: str = "database") -> str:
    """A SQLAlchemy URL for psycopg 3, or ConfigError for anything else.
    `what` names the URL in errors (the --listen-url is one too)."""
    if not url:
        raise ConfigError("no database URL: set --database-url or RELAY_DATABASE_URL")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(
            f"invalid {what} URL {redact_url(url)!r}: expected postgresql://user@host/dbname"
        )
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        _check_libpq_url(url, what)
        return "postgresql+psycopg://" + rest
    raise ConfigError(
        f"unsupported {what} URL scheme {scheme!r}: use postgresql:// or postgresql+psycopg://"
    )


def _check_libpq_url(url: str, what: str) -> None:
    """ConfigError for what libpq would refuse to parse (an unknown query
    parameter such as `?sslmod=require`), which would otherwise fail only
    at the first connect."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict("postgresql://" + url.partition("://")[2])
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        password = url_password(url)
        if password:
            reason = reason.replace(password, "***")
        raise ConfigError(f"invalid {what} URL {redact_url(url)!r}: {reason}") from None
    for port in str(params.get("port") or "").split(","):
        if port.strip() and not (port.strip().isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"invalid {what} URL {redact_url(url)!r}: bad port {port!r}")
    problem = _tls_setting_problem(params)
    if problem:
        raise ConfigError(f"invalid {what} URL {redact_url(url)!r}: {problem}")


_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_TARGET_SESSION_ATTRS = ("any", "read-write", "read-only", "primary", "standby", "prefer-standby")


def _tls_setting_problem(params: Mapping[str, object]) -> str | None:
    """What libpq would refuse at every connect in the URL's TLS (and
    target_session_attrs) parameters, which it only says when it connects:
    an unknown sslmode, a certificate or key file that is not there."""
    sslmode = params.get("sslmode")
    if sslmode is not None and sslmode not in _SSLMODES:
        return f"unknown sslmode {sslmode!r}: use one of {', '.join(_SSLMODES)}"
    attrs = params.get("target_session_attrs")
    if attrs is not None and attrs not in _TARGET_SESSION_ATTRS:
        return (
            f"unknown target_session_attrs {attrs!r}: use one of {', '.join(_TARGET_SESSION_ATTRS)}"
        )
    for name in ("sslrootcert", "sslcert", "sslkey", "sslcrl"):
        path = params.get(name)
        if not path or (name == "sslrootcert" and path == "system"):
            continue
        if not os.path.isfile(os.path.expanduser(str(path))):
            return f"{name} {str(path)!r}: no such file"
    if sslmode in ("verify-ca", "verify-full") and not params.get("sslrootcert"):
        default = os.path.expanduser("~/.postgresql/root.crt")
        if not os.path.isfile(default):
            return (
                f"sslmode={sslmode} verifies the server's certificate, but no sslrootcert "
                f"is given and {default} does not exist (sslrootcert=system uses the "
                "system's roots)"
            )
    return None


def _check_tls_files(url: str, query: Mapping[str, list[str]]) -> None:
    """ConfigError for an amqps:// URL's cafile, certfile or keyfile that is
    not there (aiormq would only fail at each connect)."""
    for name in ("cafile", "certfile", "keyfile"):
        for path in query.get(name, []):
            if not os.path.isfile(os.path.expanduser(path)):
                raise ConfigError(
                    f"invalid broker URL {redact_url(url)!r}: {name} {path!r}: no such file"
                )
    if "keyfile" in query and "certfile" not in query:
        raise ConfigError(f"invalid broker URL {redact_url(url)!r}: keyfile without certfile")


# A schema name relay takes (--schema): what PostgreSQL takes unquoted, case
# kept (relay always quotes it), at most 63 bytes; `pg_` is PostgreSQL's own.
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def check_schema_name(name: str | None) -> str | None:
    """--schema: None (the connection's search_path) or a usable schema
    name, else ConfigError."""
    if name is None:
        return None
    if not _SCHEMA_NAME.match(name) or name.startswith("pg_"):
        raise ConfigError(
            f"invalid --schema {name[:80]!r}: use a name of letters, digits and _ "
            "(not starting with a digit or pg_), at most 63 characters"
        )
    return name


# The inbox's options a broker's URL kind refuses, and why (a new broker's
# URL adds its line): RabbitMQ takes them all.
_SQS_QUEUE = (
    "--queue-type and --queue-arg apply to RabbitMQ only: an SQS queue's "
    "attributes are set where it is created"
)
# The URL kinds `relay inbox` cannot read, and why.
PUBLISH_ONLY: dict[str, str] = {
    "sns": "sns:// publishes only (relay outbox): relay inbox reads an SQS queue "
    "subscribed to the SNS topic (--broker-url sqs:// --queue QUEUE)",
}
REFUSED_OPTIONS: dict[str, dict[str, str]] = {
    "amqp": {},
    "sqs": {
        "--queue-type": _SQS_QUEUE,
        "--queue-arg": _SQS_QUEUE,
        "--bind": "--bind applies to RabbitMQ only: an SQS queue receives what is sent to it "
        "(subscribe it to an SNS topic to fan out)",
    },
    "kafka": dict.fromkeys(
        ("--queue-type", "--queue-arg", "--bind"),
        "--bind, --queue-type and --queue-arg apply to RabbitMQ only: a Kafka "
        "consumer reads the topics --queue lists",
    ),
    "redis": dict.fromkeys(
        ("--queue-type", "--queue-arg", "--bind"),
        "--bind, --queue-type and --queue-arg apply to RabbitMQ only: a Redis "
        "consumer group reads the streams --queue lists",
    ),
    "nats": dict.fromkeys(
        ("--queue-type", "--queue-arg", "--bind"),
        "--bind, --queue-type and --queue-arg apply to RabbitMQ only: a NATS "
        "stream captures the subjects it was made with",
    ),
}


@dataclass(frozen=True)
class BrokerURL:
    """A parsed --broker-url: `amqp(s)://…` for RabbitMQ, `sqs://…` for SQS,
    `sns://…` for SNS, `kafka(s)://…` for Kafka, `nats(s)://…` for NATS
    JetStream or `redis(s)://…` for Redis Streams."""

    url: str
    kind: str  # "amqp", "sqs", "sns", "kafka", "nats" or "redis"
    # SQS and SNS: the URL's region and endpoint_url, over boto3's own.
    aws_region: str | None = None
    aws_endpoint_url: str | None = None
    # RabbitMQ: the nodes to try, in order (`url` may list several).
    nodes: tuple[str, ...] = ()
    # Kafka: the librdkafka client properties the URL gives (bootstrap
    # servers, security protocol, SASL and the query's own), relay's own
    # settings not included (relay.brokers.kafka adds them).
    kafka: tuple[tuple[str, str], ...] = ()
    # NATS: the servers (`nodes`: nats://[USER:PASSWORD@]HOST:PORT each) and
    # the URL's options (`ca`, `creds`; `tls` when natss://).
    nats: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, url: str | None) -> BrokerURL:
        if not url:
            raise ConfigError("no broker URL: set --broker-url or RELAY_BROKER_URL")
        urls = split_urls(url)
        if len(urls) > 1:
            nodes = [cls._parse_one(part) for part in urls]
            if any(node.kind != "amqp" for node in nodes):
                raise ConfigError(
                    f"invalid broker URL {redact_url(url)!r}: only amqp:// URLs can be "
                    "listed (several RabbitMQ nodes, separated by commas)"
                )
            return cls(url=url, kind="amqp", nodes=tuple(urls))
        return cls._parse_one(url)

    @classmethod
    def _parse_one(cls, url: str) -> BrokerURL:
        if not url:
            raise ConfigError("invalid broker URL: an empty URL in the list")
        if url.partition("://")[0] in ("kafka", "kafkas"):  # HOST:PORT,HOST:PORT
            return cls(url=url, kind="kafka", kafka=parse_kafka_url(url))
        if url.partition("://")[0] in ("nats", "natss"):
            servers, options = parse_nats_url(url)
            return cls(url=url, kind="nats", nodes=servers, nats=options)
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            raise ConfigError(f"invalid broker URL {redact_url(url)!r}: {exc}") from None
        if parts.scheme in ("amqp", "amqps"):
            if not parts.hostname:
                raise ConfigError(f"invalid broker URL {redact_url(url)!r}: no host")
            if "," in url:
                raise ConfigError(
                    f"invalid broker URL {redact_url(url)!r}: a comma outside a list of "
                    "URLs (list nodes as amqp://u:p@a:5672/,amqp://u:p@b:5672/)"
                )
            if parts.scheme == "amqps":
                _check_tls_files(url, urllib.parse.parse_qs(parts.query))
            return cls(url=url, kind="amqp", nodes=(url,))
        if parts.scheme in ("kafka", "kafkas"):
            return cls(url=url, kind="kafka", kafka=parse_kafka_url(url))
        if parts.scheme in ("redis", "rediss"):
            check_redis_url(url)
            return cls(url=url, kind="redis")
        if parts.scheme in ("sqs", "sns"):  # the AWS settings, as boto3 resolves them
            query = urllib.parse.parse_qs(parts.query)
            unknown = set(query) - {"region", "endpoint_url"}
            if unknown:
                raise ConfigError(
                    f"invalid broker URL {redact_url(url)!r}: unknown parameter(s) "
                    f"{', '.join(sorted(unknown))}; {parts.scheme}:// takes region and "
                    "endpoint_url"
                )
            endpoint = query.get("endpoint_url", [None])[-1]
            if endpoint and not urllib.parse.urlsplit(endpoint).scheme.startswith("http"):
                raise ConfigError(
                    f"invalid {parts.scheme.upper()} endpoint_url {redact_url(endpoint)!r}: "
                    "expected http(s)://"
                )
            return cls(
                url=url,
                kind=parts.scheme,
                aws_region=query.get("region", [None])[-1],
                aws_endpoint_url=endpoint,
            )
        raise ConfigError(
            f"unsupported broker URL scheme {parts.scheme or redact_url(url)!r}: "
            "use amqp://user:pass@host:port/vhost, sqs://, sns://, kafka://host:port, "
            "nats://host:port or redis://host:port"
        )

    def __repr__(self) -> str:  # never leak the password through a repr
        return f"BrokerURL({redact_url(self.url)!r})"


# --------------------------------------------------------------------------
# kafka:// and kafkas://
# --------------------------------------------------------------------------

KAFKA_EXTRA = "pip install 'relay-outbox[kafka]'"
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
# Properties relay's guarantees rest on: the values they may take (the first
# is what relay sets), and why. Anything else set against them: exit 2.
KAFKA_FIXED: dict[str, tuple[tuple[str, ...], str]] = {
    "enable.idempotence": (("true",), "the producer must be idempotent: no duplicate, no reorder"),
    "acks": (("all", "-1"), "a row is published only once every in-sync replica has it"),
    "partitioner": (
        ("murmur2_random", "murmur2"),
        "a key's partition must be the one Java's clients pick (murmur2)",
    ),
    "allow.auto.create.topics": (("false",), "relay never creates topics"),
    "enable.auto.commit": (("false",), "offsets are committed only behind committed rows"),
    "enable.auto.offset.store": (("false",), "offsets are stored only behind committed rows"),
    "auto.offset.reset": (
        ("earliest", "smallest", "beginning"),
        "a new group starts at the earliest offset",
    ),
    "isolation.level": (("read_committed",), "the inbox reads only committed records"),
    "partition.assignment.strategy": (
        ("range,roundrobin", "range", "roundrobin"),
        "relay commits by hand, which the cooperative assignor breaks: librdkafka #4059",
    ),
    "enable.ssl.certificate.verification": (
        ("true",),
        "kafkas:// verifies the brokers' certificates",
    ),
    "ssl.endpoint.identification.algorithm": (
        ("https",),
        "kafkas:// verifies the brokers' host names",
    ),
}
# librdkafka's other names for them (its CONFIGURATION.md): the same check.
_KAFKA_ALIASES = {"request.required.acks": "acks"}
# How librdkafka reads a boolean property.
_KAFKA_BOOLEANS = {
    "true": "true",
    "t": "true",
    "1": "true",
    "false": "false",
    "f": "false",
    "0": "false",
}
# Properties the URL itself or relay's flags give.
_KAFKA_FROM_URL = {
    "bootstrap.servers": "list the brokers as kafka://HOST:PORT,HOST:PORT",
    "metadata.broker.list": "list the brokers as kafka://HOST:PORT,HOST:PORT",
    "security.protocol": "kafka:// is plain text and kafkas:// TLS; a user and password add SASL",
    "sasl.username": "give SASL credentials as kafka://USER:PASSWORD@HOST:PORT",
    "sasl.password": "give SASL credentials as kafka://USER:PASSWORD@HOST:PORT",
    "group.id": "the consumer group is --consumer-name",
    "transactional.id": "relay's producer is idempotent, not transactional",
}
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::([0-9]{1,5}))?$")


def parse_kafka_url(url: str) -> tuple[tuple[str, str], ...]:
    """`kafka(s)://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][?PROPERTY=VALUE&…]`
    as librdkafka properties, or ConfigError naming what is wrong."""
    shown = redact_url(url)
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    rest = rest.rstrip("/")
    userinfo, at, hosts = rest.rpartition("@")
    if "/" in hosts:
        raise ConfigError(f"invalid broker URL {shown!r}: a Kafka URL has no path")
    servers = []
    for host in hosts.split(","):
        match = _HOST_PORT.match(host.strip())
        if not match:
            raise ConfigError(
                f"invalid broker URL {shown!r}: expected HOST:PORT[,HOST:PORT…], not "
                f"{host.strip()!r}"
            )
        port = int(match.group(2) or 9092)
        if not 0 < port < 65536:
            raise ConfigError(f"invalid broker URL {shown!r}: bad port {port}")
        servers.append(f"{match.group(1)}:{port}")
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise ConfigError(f"invalid broker URL {shown!r}: {exc}") from None
    given = dict(pairs)
    for name, value in given.items():
        if name in _KAFKA_FROM_URL:
            raise ConfigError(
                f"invalid broker URL {shown!r}: {name} is not a URL parameter: "
                f"{_KAFKA_FROM_URL[name]}"
            )
        fixed = KAFKA_FIXED.get(_KAFKA_ALIASES.get(name, name))
        spelled = value.strip().lower()
        if fixed is not None and _KAFKA_BOOLEANS.get(spelled, spelled) not in fixed[0]:
            raise ConfigError(
                f"invalid broker URL {shown!r}: {name}={value} is against relay's guarantees "
                f"({fixed[1]}); leave it out"
            )
    tls = scheme == "kafkas"
    sasl = bool(at) or "sasl.mechanism" in given or "sasl.mechanisms" in given
    config = {
        "bootstrap.servers": ",".join(servers),
        "security.protocol": ("SASL_" if sasl else "") + ("SSL" if tls else "PLAINTEXT"),
    }
    if at:
        user, _, password = userinfo.partition(":")
        mechanism = given.pop("sasl.mechanism", given.pop("sasl.mechanisms", "PLAIN"))
        if mechanism.upper() not in SASL_MECHANISMS:
            raise ConfigError(
                f"invalid broker URL {shown!r}: sasl.mechanism {mechanism!r} does not take a "
                f"user and password; use {', '.join(SASL_MECHANISMS)}"
            )
        config["sasl.mechanism"] = mechanism.upper()
        config["sasl.username"] = urllib.parse.unquote(user)
        config["sasl.password"] = urllib.parse.unquote(password)
    for name in ("ssl.ca.location",):
        path = given.get(name)
        if path and path != "probe" and not os.path.exists(os.path.expanduser(path)):
            raise ConfigError(f"invalid broker URL {shown!r}: {name} {path!r}: no such file")
    config.update(given)
    try:
        import confluent_kafka  # noqa: F401 - the optional extra
    except ImportError:
        raise ConfigError(
            f"{scheme}:// needs the Kafka client, which is not installed: {KAFKA_EXTRA}"
        ) from None
    return tuple(config.items())


# --------------------------------------------------------------------------
# redis:// and rediss://
# --------------------------------------------------------------------------

REDIS_EXTRA = "pip install 'relay-outbox[redis]'"


def check_redis_url(url: str) -> None:
    """`redis(s)://[[USER]:PASSWORD@]HOST:PORT[/DB][?…]` as redis-py reads
    it (its own parser, so that relay takes what redis-py takes), or
    ConfigError naming what is wrong; ConfigError naming the extra when
    redis-py is not installed."""
    shown = redact_url(url)
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise ConfigError(f"invalid broker URL {shown!r}: no host")
    if "," in parts.netloc:
        raise ConfigError(f"invalid broker URL {shown!r}: a Redis URL names one server")
    if not re.fullmatch(r"/?[0-9]*", parts.path):
        # redis-py would ignore it and use database 0.
        raise ConfigError(
            f"invalid broker URL {shown!r}: the path is the database number (/0, /1, …)"
        )
    try:
        from redis.connection import parse_url
    except ImportError:
        raise ConfigError(
            f"{parts.scheme}:// needs the Redis client, which is not installed: {REDIS_EXTRA}"
        ) from None
    try:
        parse_url(url)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"invalid broker URL {shown!r}: {exc}") from None


# --------------------------------------------------------------------------
# nats:// and natss://
# --------------------------------------------------------------------------

NATS_EXTRA = "pip install 'relay-outbox[nats]'"
NATS_DEFAULT_PORT = 4222
_NATS_FILES = {"ca": "natss://", "creds": "nats:// or natss://"}


def parse_nats_url(url: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """`nats(s)://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][?ca=PATH&creds=PATH]`
    as the servers to give nats-py (each `nats://[USER:PASSWORD@]HOST:PORT`)
    and the options (`ca`, `creds`, `tls`), or ConfigError naming what is wrong."""
    shown = redact_url(url)
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    rest = rest.rstrip("/")
    userinfo, at, hosts = rest.rpartition("@")
    if "/" in hosts:
        raise ConfigError(f"invalid broker URL {shown!r}: a NATS URL has no path")
    servers = []
    for host in hosts.split(","):
        match = _HOST_PORT.match(host.strip())
        if not match:
            raise ConfigError(
                f"invalid broker URL {shown!r}: expected HOST:PORT[,HOST:PORT…], not "
                f"{host.strip()!r}"
            )
        port = int(match.group(2) or NATS_DEFAULT_PORT)
        if not 0 < port < 65536:
            raise ConfigError(f"invalid broker URL {shown!r}: bad port {port}")
        servers.append(f"nats://{userinfo + '@' if at else ''}{match.group(1)}:{port}")
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise ConfigError(f"invalid broker URL {shown!r}: {exc}") from None
    options: dict[str, str] = {}
    for name, value in pairs:
        if name not in _NATS_FILES:
            raise ConfigError(
                f"invalid broker URL {shown!r}: unknown parameter {name!r}; {scheme}:// takes "
                + ("ca and creds" if scheme == "natss" else "creds (and natss:// ca)")
            )
        if name == "ca" and scheme != "natss":
            raise ConfigError(
                f"invalid broker URL {shown!r}: ca applies to natss:// (TLS), not nats://"
            )
        if not value or not os.path.isfile(os.path.expanduser(value)):
            raise ConfigError(f"invalid broker URL {shown!r}: {name} {value!r}: no such file")
        options[name] = os.path.expanduser(value)
    if scheme == "natss":
        options["tls"] = "1"
    try:
        import nats  # noqa: F401 - the optional extra
    except ImportError:
        raise ConfigError(
            f"{scheme}:// needs the NATS client, which is not installed: {NATS_EXTRA}"
        ) from None
    return tuple(servers), tuple(options.items())


_SIZE = re.compile(r"^\s*(\d+)\s*(|B|KiB|MiB|GiB)\s*$")
_SIZE_UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
DEFAULT_CLAIM_CHECK_OVER = 256 * 1024
# --batch-bytes: a byte of payload held costs a daemon about three to six
# bytes of memory on its way (docs/operations.md); with 16 MiB the outbox
# and the inbox (with its receiver) stay well inside 256 and 384 MiB with
# rows of 10 MiB (tests/ops/test_memory_limit.py; 32 MiB took the inbox
# to 370 MiB of 384 with claim checked bodies).
DEFAULT_BATCH_BYTES = 16 * 1024 * 1024
# S3 bucket names: 3-63 lowercase letters, digits, dots and hyphens.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def parse_size(text: str | int, what: str = "--claim-check-over") -> int:
    """`256KiB`, `1MiB`, `1GiB` or plain bytes, as bytes (more than zero)."""
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.match(text)
        if not match:
            raise ConfigError(f"invalid {what} {text!r}: use bytes, or a size such as 256KiB, 1MiB")
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size <= 0:
        raise ConfigError(f"invalid {what} {text!r}: must be greater than zero")
    return size


@dataclass(frozen=True)
class ClaimCheckURL:
    """A parsed --claim-check: `s3://BUCKET[/PREFIX][?region=..&endpoint_url=..]`.

    Region, endpoint and credentials are otherwise boto3's own resolution
    (AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3, the credentials chain), as for SQS."""

    url: str
    bucket: str
    prefix: str = ""  # without leading or trailing slashes
    region: str | None = None
    endpoint_url: str | None = None

    @classmethod
    def parse(cls, url: str) -> ClaimCheckURL:
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError as exc:
            raise ConfigError(f"invalid --claim-check {url!r}: {exc}") from None
        if parts.scheme != "s3":
            raise ConfigError(f"invalid --claim-check {url!r}: expected s3://BUCKET[/PREFIX]")
        bucket = parts.netloc
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise ConfigError(
                f"invalid --claim-check {url!r}: {bucket!r} is not an S3 bucket name "
                "(3-63 lowercase letters, digits, dots and hyphens)"
            )
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        unknown = set(query) - {"region", "endpoint_url"}
        if unknown:
            raise ConfigError(
                f"invalid --claim-check {url!r}: unknown parameter(s) "
                f"{', '.join(sorted(unknown))}; s3:// takes region and endpoint_url"
            )
        endpoint = query.get("endpoint_url", [None])[-1] or None
        if endpoint and not urllib.parse.urlsplit(endpoint).scheme.startswith("http"):
            raise ConfigError(
                f"invalid --claim-check endpoint_url {redact_url(endpoint)!r}: expected http(s)://"
            )
        prefix = urllib.parse.unquote(parts.path).strip("/")
        if len(prefix.encode()) > 900:  # S3 keys: 1,024 bytes, the id's 36 included
            raise ConfigError(f"invalid --claim-check {url!r}: the prefix is over 900 bytes")
        return cls(
            url=url,
            bucket=bucket,
            prefix=prefix,
            region=query.get("region", [None])[-1] or None,
            endpoint_url=endpoint,
        )

    def key(self, message_id: str) -> str:
        """The object key of a message: PREFIX/<id>, or <id> with no prefix."""
        return f"{self.prefix}/{message_id}" if self.prefix else message_id


@dataclass(frozen=True)
class DaemonSettings:
    """What both daemons share."""

    database_url: str
    broker: BrokerURL | None = None
    batch_size: int = 500
    # The bytes of claimed rows' payloads the daemon holds at once (issue 43;
    # docs/operations.md): its workers' claims share it.
    batch_bytes: int = DEFAULT_BATCH_BYTES
    poll_interval: float = 1.0
    max_attempts: int = 10
    backoff_min: float = 1.0
    backoff_max: float = 300.0
    exchange: str = "relay"
    http_port: int = 0
    shutdown_timeout: float = 30.0
    retention: float = DEFAULT_OUTBOX_RETENTION
    on_dead: str = "skip"
    # A direct PostgreSQL URL for LISTEN, when database_url is a pooler's.
    listen_url: str | None = None
    # Large messages through S3 (relay.claimcheck); None: off.
    claim_check: ClaimCheckURL | None = None
    claim_check_over: int = DEFAULT_CLAIM_CHECK_OVER
    # The schema of relay's tables (None: the connection's search_path).
    schema: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "database_url", normalize_database_url(self.database_url))
        check_schema_name(self.schema)
        if self.listen_url:
            object.__setattr__(
                self, "listen_url", normalize_database_url(self.listen_url, "listen")
            )
        else:
            object.__setattr__(self, "listen_url", None)
        _positive("batch-size", self.batch_size)
        _positive("poll-interval", self.poll_interval)
        _positive("max-attempts", self.max_attempts)
        _positive("shutdown-timeout", self.shutdown_timeout)
        if self.backoff_min < 0 or self.backoff_max < self.backoff_min:
            raise ConfigError(
                f"invalid backoff: need 0 <= --backoff-min ({self.backoff_min}) "
                f"<= --backoff-max ({self.backoff_max})"
            )
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"invalid --http-port {self.http_port}: must be 0 to 65535")
        if self.on_dead not in ("skip", "block"):
            raise ConfigError(f"invalid --on-dead {self.on_dead!r}: use skip or block")
        if not self.exchange:
            raise ConfigError("invalid --exchange: must not be empty")
        if isinstance(self.claim_check, str):
            url = self.claim_check
            object.__setattr__(self, "claim_check", ClaimCheckURL.parse(url) if url else None)
        object.__setattr__(self, "claim_check_over", parse_size(self.claim_check_over))
        object.__setattr__(self, "batch_bytes", parse_size(self.batch_bytes, "--batch-bytes"))

    @property
    def secrets(self) -> list[str]:
        """Strings that must never reach a log line."""
        found = [url_password(self.database_url), url_password(self.listen_url)]
        if self.broker:
            found.extend(url_passwords(self.broker.url))
            found.extend(v for n, v in self.broker.kafka if "password" in n and len(v) > 2)
        return [s for s in found if s]

    def replace(self, **changes: object) -> DaemonSettings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(database_url={redact_url(self.database_url)!r}, ...)"


@dataclass(frozen=True, repr=False)
class OutboxSettings(DaemonSettings):
    """`relay outbox`."""

    # RabbitMQ: a message the broker confirms but returns unroutable is
    # "publish"ed (and counted) or a "fail"ed attempt.
    on_unroutable: str = "publish"
    # Every message also a CloudEvent with this source (relay.cloudevents); None: off.
    cloudevents_source: str | None = None
    # Redis Streams: XADD's `MAXLEN ~ N` (None: the streams grow).
    stream_maxlen: int | None = None
    # How committed rows are learnt of: "poll" (the claim, woken by
    # notifications) or "wal" (a logical replication slot: relay.capture).
    capture: str = "poll"
    # --slot: the slot's and publication's name (None: relay_outbox[_SCHEMA]).
    slot: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stream_maxlen is not None:
            if self.stream_maxlen <= 0:
                raise ConfigError(f"invalid --stream-maxlen {self.stream_maxlen}: must be positive")
            if self.broker is not None and self.broker.kind != "redis":
                raise ConfigError("--stream-maxlen applies to Redis Streams (redis://) only")
        if self.capture not in ("poll", "wal"):
            raise ConfigError(f"invalid --capture {self.capture!r}: use poll or wal")
        if self.slot is not None and not re.fullmatch(r"[a-z0-9_]{1,63}", self.slot):
            raise ConfigError(
                f"invalid --slot {self.slot!r}: a replication slot's name is 1 to 63 "
                "lower-case letters, digits and underscores"
            )
        if self.on_unroutable not in ("publish", "fail"):
            raise ConfigError(
                f"invalid --on-unroutable {self.on_unroutable!r}: use publish or fail"
            )
        if self.cloudevents_source is not None:
            why = uri_reference_problem(self.cloudevents_source)
            if why:
                raise ConfigError(
                    f"invalid --cloudevents-source {self.cloudevents_source!r}: {why} "
                    "(a URI-reference, such as https://example.com/orders or /orders)"
                )


# The inbox's default --prefetch, in batches of --batch-size: what its
# receiver may run ahead of the dispatchers (relay.pacing.PACE_BATCHES for
# each of relay.inbox.DISPATCHERS: the batch each has in hand and the next).
# A smaller window starves them: each one's part of a received batch is
# then a fraction of --batch-size (docs/inbox.md, "Batches").
RECEIVED_AHEAD = 6
# ... at most RabbitMQ's largest prefetch (basic.qos takes a 16-bit count).
PREFETCH_MOST = 65535


@dataclass(frozen=True, repr=False)
class InboxSettings(DaemonSettings):
    """`relay inbox`."""

    retention: float = DEFAULT_INBOX_RETENTION
    queue: str = ""
    binds: tuple[str, ...] = ()
    handlers: tuple[str, ...] = ()
    consumer_name: str = ""
    # 0: RECEIVED_AHEAD times --batch-size (set in __post_init__).
    prefetch: int = 0
    handler_timeout: float = 60.0
    # RabbitMQ, used when relay declares the queue. None: not asked for, so a
    # queue its owner declared otherwise is used as it is.
    queue_type: str | None = None
    queue_args: tuple[tuple[str, str | int], ...] = ()
    # Redis Streams: seconds an entry delivered to a consumer of the group
    # stays unacknowledged before another consumer claims it.
    claim_idle: float = 30.0
    # received: handlers run in the transaction that stores the message
    # (relay.inbox.Handing); stored: messages are stored, then handled by
    # the dispatchers (docs/inbox.md).
    dispatch: str = "received"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.broker is not None and self.broker.kind in PUBLISH_ONLY:
            raise ConfigError(PUBLISH_ONLY[self.broker.kind])
        if not self.queue:
            raise ConfigError("no queue: set --queue or RELAY_QUEUE")
        if self.queue_type not in (None, "classic", "quorum"):
            raise ConfigError(f"invalid --queue-type {self.queue_type!r}: use classic or quorum")
        object.__setattr__(
            self,
            "queue_args",
            tuple(parse_queue_arg(arg) if isinstance(arg, str) else arg for arg in self.queue_args),
        )
        asked = dict(self.queue_args).get("x-queue-type")
        if asked is not None and self.queue_type is not None and asked != self.queue_type:
            raise ConfigError(
                f"--queue-arg x-queue-type={asked} contradicts --queue-type {self.queue_type}"
            )
        refused = REFUSED_OPTIONS.get(self.broker.kind, {}) if self.broker is not None else {}
        for option, given in (
            ("--queue-type", self.queue_type == "quorum"),
            ("--queue-arg", bool(self.queue_args)),
            ("--bind", bool(self.binds)),
        ):
            if given and option in refused:
                raise ConfigError(refused[option])
        # Kafka's topics and Redis's streams: --queue is a list.
        kind = self.broker.kind if self.broker is not None else None
        listed = kind in ("kafka", "redis")
        if listed and not all(t.strip() for t in self.queue.split(",")):
            what = (
                "Kafka topics as TOPIC,TOPIC"
                if kind == "kafka"
                else "Redis streams as STREAM,STREAM"
            )
            raise ConfigError(f"invalid --queue {self.queue!r}: list {what}")
        if not self.consumer_name:
            # Kafka and Redis: the consumer group (and dedup scope) is the
            # first topic's or stream's name.
            first = self.queue.split(",")[0].strip() if listed else self.queue
            object.__setattr__(self, "consumer_name", first)
        if self.prefetch == 0:
            default = min(RECEIVED_AHEAD * self.batch_size, PREFETCH_MOST)
            object.__setattr__(self, "prefetch", default)
        _positive("prefetch", self.prefetch)
        _positive("handler-timeout", self.handler_timeout)
        _positive("claim-idle", self.claim_idle)
        if self.dispatch not in ("received", "stored"):
            raise ConfigError(f"invalid --dispatch {self.dispatch!r}: use received or stored")


_INTEGER = re.compile(r"^[+-]?[0-9]+$")


def parse_queue_arg(text: str) -> tuple[str, str | int]:
    """`NAME=VALUE` of --queue-arg: a value that is an integer as an int."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(f"invalid --queue-arg {text!r}: use NAME=VALUE (e.g. x-max-length=10000)")
    if len(name.encode()) > 255:
        raise ConfigError(f"invalid --queue-arg {name[:40]!r}...: the name is over 255 bytes")
    if not _INTEGER.match(value.strip()):
        return name, value
    number = int(value)
    if not -(2**63) <= number < 2**63:
        raise ConfigError(f"invalid --queue-arg {text!r}: the integer is out of AMQP's range")
    return name, number


# RFC 3986: the characters a URI-reference may hold (but for %XX escapes),
# and a scheme.
_URI_CHARS = re.compile(r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")


def uri_reference_problem(value: str) -> str | None:
    """Why `value` is not a non-empty URI-reference (RFC 3986), or None."""
    if not value:
        return "it is empty"
    if not _URI_CHARS.fullmatch(value):
        return "it holds characters a URI cannot (spaces, non-ASCII, a lone %)"
    if value.count("#") > 1:
        return "it has more than one #"
    head = re.split(r"[/?#]", value, maxsplit=1)[0]
    if ":" in head and not _SCHEME.fullmatch(head.split(":", 1)[0]):
        return "its scheme (before the first colon) is not a valid one"
    try:
        urllib.parse.urlsplit(value).port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        return str(exc)
    return None


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"invalid --{name} {value}: must be greater than zero")


# -- several sources in one outbox -------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One place `relay outbox` drains: a database (URL, normalized) and the
    schema of relay's tables there (None: the connection's search_path)."""

    database_url: str
    schema: str | None = None

    @property
    def label(self) -> str:
        """`database/schema`, the metrics' and status's name for it: never a
        host or a credential. Without --schema, `database/public`."""
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict("postgresql://" + self.database_url.partition("://")[2])
        database = params.get("dbname") or params.get("user") or "postgres"
        return f"{database}/{self.schema or 'public'}"

    def __repr__(self) -> str:
        return f"Source({redact_url(self.database_url)!r}, {self.schema!r})"


def combine_sources(urls: Sequence[str], schemas: Sequence[str | None]) -> list[Source]:
    """Every schema in every database (`--database-url` and `--schema`
    repeated; each URL may hold several separated by whitespace, as
    RELAY_DATABASE_URL does), each once, in the order given."""
    found: list[Source] = []
    for given in urls:
        for url in given.split():
            normalized = normalize_database_url(url)
            for schema in schemas or [None]:
                source = Source(normalized, check_schema_name(schema))
                if source not in found:
                    found.append(source)
    if not found:
        normalize_database_url("")  # the usual "no database URL" error
    return found


def read_sources(path: str) -> list[Source]:
    """A file of sources (`--sources`): one `URL [SCHEMA]` a line; `#` starts
    a comment, blank lines are skipped. ConfigError names the bad line."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --sources {path!r}: {exc}") from None
    found: list[Source] = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ConfigError(
                f"--sources {path!r} line {number}: expected `URL [SCHEMA]`, got {len(words)} words"
            )
        try:
            source = Source(
                normalize_database_url(words[0]),
                check_schema_name(words[1] if len(words) > 1 else None),
            )
        except ConfigError as exc:
            raise ConfigError(f"--sources {path!r} line {number}: {exc}") from None
        if source not in found:
            found.append(source)
    return found


def labelled(sources: Sequence[Source]) -> dict[str, Source]:
    """The sources by label; two of one label (same database name on two
    servers) are told apart as `label~2`, `label~3`, in order."""
    named: dict[str, Source] = {}
    for source in sources:
        label, n = source.label, 1
        while label in named:
            n += 1
            label = f"{source.label}~{n}"
        named[label] = source
    return named
