"""Interleaved in-process cost of signing (relay) and verifying (worker), per event."""

import json
import statistics
import time
import uuid
from datetime import UTC, datetime

from pipeline.envelope import OutboxEvent, decode_envelope, encode_envelope
from pipeline.signing import EnvelopeSigner, MessageKeys

SOURCE = "/pipeline/pipeline"
PAYLOAD = json.dumps(
    {
        "order_id": "ord-000123",
        "customer": "cus_042",
        "sku": "sku-017",
        "quantity": 2,
        "amount_cents": 4658,
        "lines": [{"sku": "a", "q": 1}, {"sku": "b", "q": 3}],
    }
)
HEADERS = '{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}'
EVENTS = [
    OutboxEvent(
        uuid.uuid4(),
        i,
        "order",
        f"o{i}",
        f"o{i}",
        "order.placed",
        1,
        PAYLOAD,
        HEADERS,
        0,
        datetime.now(UTC),
    )
    for i in range(500)
]
ON = EnvelopeSigner(MessageKeys(current=b"k" * 40), SOURCE)
OFF = EnvelopeSigner(MessageKeys(), SOURCE)


def texts() -> dict[uuid.UUID, str]:
    return {e.id: encode_envelope(e, SOURCE) for e in EVENTS}


def relay(signer: EnvelopeSigner) -> float:
    started = time.perf_counter()
    signer.sign_texts(EVENTS, "payments", texts(), {})
    return (time.perf_counter() - started) / len(EVENTS)


RECEIVED = [json.loads(text) for text in ON.sign_texts(EVENTS, "payments", texts(), {})]


def worker(signer: EnvelopeSigner) -> float:
    started = time.perf_counter()
    for envelope in RECEIVED:
        assert signer.verify(envelope, "payments") is None
        decode_envelope(envelope)
    return (time.perf_counter() - started) / len(RECEIVED)


def main() -> None:
    runs: dict[str, list[float]] = {
        "relay_off": [],
        "relay_on": [],
        "worker_off": [],
        "worker_on": [],
    }
    for _ in range(30):
        runs["relay_off"].append(relay(OFF))
        runs["relay_on"].append(relay(ON))
        runs["worker_on"].append(worker(ON))
        runs["worker_off"].append(worker(OFF))

    def ratio(on: str, off: str) -> float:
        return round(statistics.median(a / b for a, b in zip(runs[on], runs[off], strict=True)), 2)

    print(
        json.dumps(
            {
                "us_per_event_median": {
                    k: round(statistics.median(v) * 1e6, 2) for k, v in runs.items()
                },
                "relay_encode_on_over_off": ratio("relay_on", "relay_off"),
                "worker_decode_on_over_off": ratio("worker_on", "worker_off"),
                "payload_bytes": len(PAYLOAD),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
