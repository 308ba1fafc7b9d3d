"""lm-evaluation-harness on a batchapi service (the ``eval`` extra): the ``batchapi`` model of
``lm.py``, registered with lm-eval when that module is imported; ``python -m batchapi.evals``
is lm-eval's command line with it registered."""
