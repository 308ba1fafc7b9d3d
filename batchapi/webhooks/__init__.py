"""Webhooks, OpenAI's way: a project's endpoints (``endpoints``), the events a batch's end sends
(``events``), the outbox rows written in the transaction that ends the batch (``outbox``), and
their at-least-once delivery, signed by the Standard Webhooks scheme (``signing``, ``delivery``);
``ended`` is the hook ``batches.states`` calls when a batch ends.

Imports only ``db`` and ``config`` of batchapi: ``batches.states`` calls into ``outbox``."""
