"""A small Django project on PostgreSQL (psycopg 3) that produces outbox
messages with relay.enqueue; the database comes from SHOP_DATABASE_URL."""

import os
import urllib.parse

_url = urllib.parse.urlsplit(os.environ["SHOP_DATABASE_URL"])

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["shop"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or 5432),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
