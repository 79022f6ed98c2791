"""Alert delivery: alerts raised by node state changes, policy actions and breaker trips,
queued in a database outbox and delivered to webhooks with retries and deduplication."""
