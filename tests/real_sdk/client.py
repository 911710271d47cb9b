"""One call of Stripe's Python SDK (from PyPI) against a test server, for tests/http/real_sdk.rs.

Usage: python3 client.py BASE_URL

The SDK as a user would configure it for a slow upstream: a 1 s timeout and
max_network_retries=3. It sends an Idempotency-Key of its own on every POST and reuses it on
each retry (after a timeout, a 409 or a 5xx). Prints one JSON line on stdout: whether the
call succeeded, how long it took, the object's id, the answer's Idempotency-Key header (if
the server echoes it) or the error. The SDK's own log (its retries) goes to stderr.
"""

import json
import sys
import time

import stripe


def main() -> int:
    base = sys.argv[1]
    stripe.log = "info"  # "Initiating retry N ..." lines on stderr, for the test's output
    client = stripe.StripeClient(
        "sk_test_idempotency_store",
        base_addresses={"api": base},
        max_network_retries=3,
        http_client=stripe.RequestsClient(timeout=1),
    )
    started = time.monotonic()
    out = {"sdk_version": stripe.VERSION}
    try:
        intent = client.v1.payment_intents.create(
            params={
                "amount": 4999,
                "currency": "usd",
                "customer": "cus_123",
                "payment_method_types": ["card"],
            }
        )
        response = intent.last_response
        out.update(
            ok=True,
            id=intent.id,
            status=response.code if response else None,
            echoed_key=response.headers.get("Idempotency-Key") if response else None,
        )
    except stripe.StripeError as err:
        out.update(
            ok=False,
            error="%s(%s): %s" % (type(err).__name__, err.http_status, err.user_message),
            status=err.http_status,
        )
    out["seconds"] = round(time.monotonic() - started, 3)
    out["finished_at_unix"] = time.time()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
