"""Webhooks, OpenAI's way: a project's endpoints (``endpoints``), the events a batch's end sends
(``events``), the outbox rows written in the transaction that ends the batch (``outbox``, which
``batches.ended`` calls), and their at-least-once delivery, signed by the Standard Webhooks scheme
(``signing``, ``delivery``).

Imports only ``db`` and ``config`` of batchapi, so ``batches`` may call into it."""
