"""Standard Webhooks signatures (https://www.standardwebhooks.com/), which the openai SDK's
``client.webhooks.unwrap(body, headers, secret=...)`` checks: ``webhook-id``, ``webhook-timestamp``
(Unix seconds; the SDK refuses one more than 5 minutes off, so it is stamped per attempt) and
``webhook-signature``, ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">`` for each secret in force,
space-separated. The HMAC is ``standardwebhooks``' own."""

from __future__ import annotations

import base64
import secrets
from datetime import UTC, datetime

from standardwebhooks import Webhook

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    """A signing secret as the SDK reads one: ``whsec_`` and the base64 of random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def hint(secret: str) -> str:
    """A masked form to tell secrets apart in listings."""
    return f"{secret[:len(SECRET_PREFIX) + 4]}…{secret[-4:]}"


def signed_headers(msg_id: str, body: str, signing_secrets: list[str], timestamp: int) -> dict[str, str]:
    moment = datetime.fromtimestamp(timestamp, UTC)
    signatures = " ".join(Webhook(secret).sign(msg_id, moment, body) for secret in signing_secrets)
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp), "webhook-signature": signatures}
