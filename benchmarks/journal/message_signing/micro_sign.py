"""Interleaved in-process cost of signing (relay) and verifying (worker), per event."""
import json, time, uuid, statistics
from datetime import datetime, UTC
from pipeline.envelope import OutboxEvent, encode_envelope, decode_envelope
from pipeline.signing import EnvelopeSigner, MessageKeys

payload = json.dumps({"order_id": "ord-000123", "customer": "cus_042", "sku": "sku-017", "quantity": 2,
                      "amount_cents": 4658, "lines": [{"sku": "a", "q": 1}, {"sku": "b", "q": 3}]})
events = [OutboxEvent(uuid.uuid4(), i, "order", f"o{i}", f"o{i}", "order.placed", 1, payload,
                      '{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}', 0,
                      datetime.now(UTC)) for i in range(500)]
on = EnvelopeSigner(MessageKeys(current=b"k" * 40), "/pipeline/pipeline")
off = EnvelopeSigner(MessageKeys(), "/pipeline/pipeline")

def relay(signer):
    t = time.perf_counter()
    texts = {e.id: encode_envelope(e, "/pipeline/pipeline") for e in events}
    signer.sign_texts(events, "payments", texts, {})
    return (time.perf_counter() - t) / len(events)

received = [json.loads(t) for t in on.sign_texts(events, "payments", {e.id: encode_envelope(e, "/pipeline/pipeline") for e in events}, {})]
def worker(signer):
    t = time.perf_counter()
    for env in received:
        assert signer.verify(env, "payments") is None
        decode_envelope(env)
    return (time.perf_counter() - t) / len(received)

r = {"relay_off": [], "relay_on": [], "worker_off": [], "worker_on": []}
for _ in range(30):
    r["relay_off"].append(relay(off)); r["relay_on"].append(relay(on))
    r["worker_on"].append(worker(on)); r["worker_off"].append(worker(off))
med = {k: statistics.median(v) * 1e6 for k, v in r.items()}
ratios_relay = statistics.median(a / b for a, b in zip(r["relay_on"], r["relay_off"]))
ratios_worker = statistics.median(a / b for a, b in zip(r["worker_on"], r["worker_off"]))
print(json.dumps({"us_per_event_median": {k: round(v, 2) for k, v in med.items()},
                  "relay_encode_on_over_off": round(ratios_relay, 2),
                  "worker_decode_on_over_off": round(ratios_worker, 2),
                  "payload_bytes": len(payload)}, indent=1))
