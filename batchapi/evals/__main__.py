"""``python -m batchapi.evals ARGS``: lm-eval's own command line (``lm_eval ARGS``) with the
``batchapi`` model registered. lm-eval 0.4 finds models only in its registry, which an installed
package joins by being imported; this is that import."""

from __future__ import annotations


def main() -> None:
    import sys

    from lm_eval.__main__ import cli_evaluate

    import batchapi.evals.lm  # noqa: F401  (registers the "batchapi" model)

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
